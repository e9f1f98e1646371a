"""Worker of tests/test_comm_multihost.py, started by the launcher in two network namespaces:
``python comm_link_worker.py OUT_DIR STAGE``. Trains 2 warm-up steps then 3 counted ones; rank 0 writes the veth's
rx+tx bytes over the counted steps, Ψ (padded bucket elements) and host A's counted inter-host bytes."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import zerospeed
from zerospeed import comm


def veth_bytes() -> int:
    base = f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/"
    return sum(int(open(base + k).read()) for k in ("rx_bytes", "tx_bytes"))


def main(out: str, stage: int) -> None:
    zerospeed.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 256))
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 1 << 22, "allgather_bucket_size": 1 << 22,
                                 "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}}
    engine, _, _, _ = zerospeed.initialize(model=net, config=cfg)

    def step(i: int) -> None:
        x = torch.randn(2, 256, generator=torch.Generator().manual_seed(10 * i + rank))
        engine.backward(nn.functional.mse_loss(engine(x), x.flip(-1)))
        engine.step()

    for i in range(2):
        step(i)
    comm.barrier()
    before, counted = veth_bytes(), comm.COUNTER.link_bytes()[1]
    steps = 3
    for i in range(steps):
        step(2 + i)
    comm.barrier()
    after, inter = veth_bytes(), comm.COUNTER.link_bytes()[1] - counted
    everyone = comm.all_gather_object(inter)
    per_host = int(os.environ["LOCAL_WORLD_SIZE"])
    psi = sum(b.layout.padded_numel for b in engine.strategy.buckets)
    if rank == 0:
        json.dump({"veth": (after - before) / steps, "psi": psi, "counted": 2 * sum(everyone[:per_host]) / steps},
                  open(os.path.join(out, f"links-{stage}.json"), "w"))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
