"""Worker of tests/test_comm_multihost.py, started by the launcher in two network namespaces.

``python comm_link_worker.py OUT_DIR STAGE``: trains 2 warm-up steps then 3 counted ones; rank 0 writes the veth's
rx+tx bytes over the counted steps, Ψ (padded bucket elements) and host A's counted inter-host bytes.

``python comm_link_worker.py OUT_DIR 3 NAME ZEROPP_JSON``: ZeRO-3 with the ZeRO++ keys in ZEROPP_JSON for 20 steps;
rank 0 writes the loss of every step (mean over ranks), the veth's rx+tx bytes per step over steps 2-19 and the
block-quantization kernel in use, to ``zeropp-NAME.json``."""

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


def _engine(stage: int, **zero: object) -> tuple:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 256))
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 1 << 22, "allgather_bucket_size": 1 << 22,
                                 "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, **zero}}
    return zerospeed.initialize(model=net, config=cfg)


def zeropp(out: str, name: str, keys: dict) -> None:
    zerospeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    engine, _, _, _ = _engine(3, **keys)
    losses, before = [], 0
    for i in range(20):
        if i == 2:
            comm.barrier()
            before = veth_bytes()
        x = torch.randn(2, 256, generator=torch.Generator().manual_seed(10 * i + rank))
        loss = nn.functional.mse_loss(engine(x), x.flip(-1))
        engine.backward(loss)
        engine.step()
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    comm.barrier()
    after = veth_bytes()
    from zerospeed.zero import zeropp as pp

    if rank == 0:
        json.dump({"losses": losses, "veth": (after - before) / 18, "kernel": pp.kernel_path() if keys else None},
                  open(os.path.join(out, f"zeropp-{name}.json"), "w"))
    engine.destroy()


def main(out: str, stage: int) -> None:
    zerospeed.init_distributed()
    rank = dist.get_rank()
    engine, _, _, _ = _engine(stage)

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
    if len(sys.argv) > 3:
        zeropp(sys.argv[1], sys.argv[3], json.loads(sys.argv[4]))
    else:
        main(sys.argv[1], int(sys.argv[2]))
