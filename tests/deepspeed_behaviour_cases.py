"""Rank functions of tests/test_deepspeed_behaviours.py (importable by the ranks the harness starts)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine_cases import config, global_batch, make_model


def no_optimizer_forward(stage: int) -> dict:
    """An engine built with no optimizer at all: its loss on this rank's half of the batch, the reference module's,
    how many parameter elements this rank holds, and the errors backward and step give."""
    import zerospeed

    reference = make_model()
    x, y = global_batch(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    with torch.no_grad():
        want = reference(x, y)
    cfg = config(stage, 1)
    del cfg["optimizer"]
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition even these small parameters
    engine, optimizer, _, scheduler = zerospeed.initialize(model=make_model(), config=cfg)
    with torch.no_grad():
        got = engine(x, y)
    held = sum(p.numel() for p in engine.module.parameters())
    errors = []
    for call in (lambda: engine.backward(engine(x, y)), lambda: engine.step()):
        try:
            call()
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
    return {"optimizer": optimizer, "scheduler": scheduler, "got": got.item(), "want": want.item(), "held": held,
            "errors": errors}


def bf16_fp32_accumulation(stage: int, gas: int) -> dict:
    """bf16 with data_types.grad_accum_dtype fp32: the first step's global gradient norm and gradient bytes, and the
    norm computed here from this rank's and the other rank's bf16 micro-batch gradients summed in fp32."""
    import zerospeed

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config(stage, gas, precision="bf16", clip=0.0, data_types={"grad_accum_dtype": "fp32"})
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = zerospeed.initialize(model=make_model(), config=cfg)
    reference = make_model().to(torch.bfloat16)
    x, y = global_batch(0)
    micro_x, micro_y = x.chunk(world * gas), y.chunk(world * gas)
    sums = [torch.zeros(p.shape, dtype=torch.float32) for p in reference.parameters()]
    for m in range(gas):
        i = rank * gas + m
        engine.backward(engine(micro_x[i], micro_y[i]))
        if m == gas - 1:
            grad_bytes = engine.memory_breakdown()["grads"]
        engine.step()
        reference.zero_grad()
        (reference(micro_x[i].bfloat16(), micro_y[i].bfloat16()).float() * (1.0 / gas)).backward()
        for s, p in zip(sums, reference.parameters()):
            s.add_(p.grad.float())
    flat = torch.cat([s.reshape(-1) for s in sums])
    dist.all_reduce(flat)  # fp32: the two ranks' sums, one rounding each element
    return {"norm": engine.get_global_grad_norm(), "want": (flat / world).norm().item(), "grad_bytes": grad_bytes}
