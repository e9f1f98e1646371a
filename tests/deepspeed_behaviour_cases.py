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
