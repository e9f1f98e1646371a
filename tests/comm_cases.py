"""Rank functions of the hierarchical-collective tests (tests/test_comm_hierarchical.py).

``as_hosts(per_host)`` gives this process torchrun's numbering of ``per_host`` ranks a host
(``rank = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``) before any collective, so a world of 4 on one machine is
seen as 2 hosts x 2 processes: the groups, algorithms and byte counts are those of two hosts; only the wire is
loopback.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from zerospeed import comm


def as_hosts(per_host: int, hierarchical: bool = True) -> None:
    rank = dist.get_rank()
    os.environ.update(LOCAL_WORLD_SIZE=str(per_host), LOCAL_RANK=str(rank % per_host),
                      GROUP_RANK=str(rank // per_host), ZEROSPEED_HIERARCHICAL="1" if hierarchical else "0")


def rank_input(numel: int, integer: bool, rank: int | None = None) -> torch.Tensor:
    rank = dist.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(17 + rank)
    if integer:  # every partial sum is exact in fp32: any order gives the same bits
        return torch.randint(-4096, 4096, (numel,), generator=g).float()
    return torch.randn(numel, generator=g) * torch.logspace(-3, 3, numel)


def collectives(per_host: int, numel_per_rank: int, integer: bool, hierarchical: bool) -> dict:
    """One reduce-scatter, all-gather and all-reduce; the results and what the counter saw."""
    as_hosts(per_host, hierarchical)
    world = dist.get_world_size()
    comm.COUNTER.reset()
    x = rank_input(world * numel_per_rank, integer)
    shard = torch.empty(numel_per_rank)
    comm.reduce_scatter(shard, x.clone())
    gathered = torch.empty(world * numel_per_rank)
    comm.all_gather(gathered, rank_input(numel_per_rank, integer), async_op=True).wait()
    summed = x.clone()[: world * numel_per_rank - 3]  # not a multiple of the group: padded inside
    summed = summed.contiguous()
    comm.all_reduce(summed)
    return {"shard": shard, "gathered": gathered, "summed": summed, "comms": comm.COUNTER.snapshot()}


def model() -> nn.Module:
    torch.manual_seed(4321)
    # every layer above hierarchical.MIN_NUMEL elements (ZeRO-3 gathers a layer at a time)
    return nn.Sequential(nn.Linear(48, 96), nn.Tanh(), nn.Linear(96, 48), nn.Tanh(), nn.Linear(48, 88))


def zero_step_bytes(stage: int, hierarchical: bool, steps: int = 3) -> dict:
    """Train ``steps`` steps at ZeRO ``stage`` on 2 simulated hosts; the last step's counter, the padded Ψ and the
    weights."""
    import zerospeed

    as_hosts(2, hierarchical)
    net = model()
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 1 << 20, "allgather_bucket_size": 1 << 20,
                                 "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1 << 20,
                                 "stage3_max_reuse_distance": 0}}  # re-gathered for backward: the 3Ψ of the formula
    engine, _, _, _ = zerospeed.initialize(model=net, config=cfg)
    rank = dist.get_rank()
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(4, 48, generator=g)
        comm.COUNTER.reset()
        loss = nn.functional.mse_loss(engine(x), x.repeat(1, 2)[:, :88].sin())
        engine.backward(loss)
        engine.step()
    snap = comm.COUNTER.snapshot()
    padded = sum(b.layout.padded_numel for b in engine.strategy.buckets)
    weights = engine.consolidated_state_dict()
    engine.destroy()
    return {"comms": snap, "padded_numel": padded, "weights": weights, "num_buckets": len(engine.strategy.buckets),
            "num_params": sum(p.numel() for p in model().parameters())}


def zeropp_run(zeropp: dict, steps: int = 20, frozen_first: bool = False) -> dict:
    """ZeRO-3 on 2 simulated hosts x 2 with the ZeRO++ keys in ``zeropp``; losses (mean over ranks), the last
    step's host-A link bytes (rx + tx) and the final weights. ``frozen_first``: the first layer does not train."""
    import zerospeed

    as_hosts(2, True)
    net = model()
    if frozen_first:
        net[0].requires_grad_(False)
    # the Adam kernel is fixed, not timed: the runs are compared bit for bit across processes, and the kernel
    # families differ by an ulp (a timing under load can pick another family in one of the runs)
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0, "fast_paths": {"adam_kernel": "foreach"},
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": 1 << 20, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_reuse_distance": 0, **zeropp}}
    engine, _, _, _ = zerospeed.initialize(model=net, config=cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(4, 48, generator=g)
        comm.COUNTER.reset()
        loss = nn.functional.mse_loss(engine(x), x.repeat(1, 2)[:, :88].sin())
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    inter = comm.COUNTER.link_bytes()[1]
    sent = [None] * world
    dist.all_gather_object(sent, inter)
    shards = [b.layout.shard_numel for b in engine.strategy.buckets]
    quantized = [(bool(b.trainable), bool(b.quantized_gather)) for b in engine.strategy.buckets]
    weights = engine.consolidated_state_dict()
    engine.destroy()
    return {"losses": losses, "link_bytes": 2 * sum(sent[:2]), "weights": weights, "shards": shards,
            "quantized": quantized}


def zeropp_fp16_overflow(zeropp: dict, steps: int = 6) -> dict:
    """ZeRO-3 fp16 on 2 simulated hosts x 2 starting at loss scale 2^24 (the first steps overflow in fp16, in some gradient elements, then it trains): the
    skipped steps and the loss scale after each step, and whether the weights stayed finite."""
    import zerospeed

    as_hosts(2, True)
    net = model()
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "fp16": {"enabled": True, "initial_scale_power": 24, "loss_scale_window": 1000},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": 1 << 20, "stage3_param_persistence_threshold": 0,
                                 **zeropp}}
    engine, _, _, _ = zerospeed.initialize(model=net, config=cfg)
    rank = dist.get_rank()
    scales, skipped = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(4, 48, generator=g).half()
        loss = nn.functional.mse_loss(engine(x).float(), x.float().repeat(1, 2)[:, :88].sin())
        engine.backward(loss)
        engine.step()
        scales.append(float(engine.loss_scale() if callable(engine.loss_scale) else engine.loss_scale))
        skipped.append(engine.skipped_steps)
    finite = all(bool(torch.isfinite(v.float()).all()) for v in engine.consolidated_state_dict().values())
    engine.destroy()
    return {"scales": scales, "skipped": skipped, "finite": finite}


def comms_logger_lines(steps: int = 2) -> dict:
    """ZeRO-2 on 2 simulated hosts x 2 with the comms logger on: rank 0's 'comms ...' log lines of the last step
    and the engine's counted bytes for it."""
    import logging

    import zerospeed

    as_hosts(2, True)
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep(level=logging.INFO)
    logging.getLogger("zerospeed").addHandler(handler)
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1, "comms_logger": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 1 << 20, "allgather_bucket_size": 1 << 20}}
    engine, _, _, _ = zerospeed.initialize(model=model(), config=cfg)
    rank = dist.get_rank()
    for step in range(steps):
        x = torch.randn(4, 48, generator=torch.Generator().manual_seed(100 * step + rank))
        lines.clear()
        engine.backward(nn.functional.mse_loss(engine(x), x.repeat(1, 2)[:, :88].sin()))
        engine.step()
    logging.getLogger("zerospeed").removeHandler(handler)
    counted = engine.last_step_comms
    engine.destroy()
    return {"lines": [ln for ln in lines if ln.startswith("comms ")], "counted": counted}
