"""Rank functions of tests/test_onebit_engine.py: OneBitAdam through zerospeed.initialize (ZeRO stage 0)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch import nn


def model() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 6))


def batch(step: int, rank: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(n, 12, generator=g)
    return x, x[:, :6].cos()


def engine_run(freeze: int, steps: int) -> list[dict]:
    import zerospeed

    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0, "gradient_clipping": 0.0,
           "optimizer": {"type": "OnebitAdam", "params": {"lr": 1e-2, "freeze_step": freeze, "cuda_aware": False,
                                                          "comm_backend_name": "nccl"}}}
    engine, _, _, _ = zerospeed.initialize(model=model(), config=cfg)
    out = []
    for step in range(steps):
        x, y = batch(step, dist.get_rank())
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        out.append({k: v.detach().clone() for k, v in engine.module.state_dict().items()})
    return out


def standalone_run(freeze: int, steps: int) -> list[dict]:
    from zerospeed.ops.onebit_adam import OneBitAdam

    net = model()
    opt = OneBitAdam(net.parameters(), lr=1e-2, freeze_step=freeze)
    out = []
    for step in range(steps):
        x, y = batch(step, dist.get_rank())
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        out.append({k: v.detach().clone() for k, v in net.state_dict().items()})
    return out


def shared_config_run(path: str, freeze: int, steps: int) -> dict:
    """A published DeepSpeedExamples config (fp16, gradient clipping, its batch sizes), freeze_step shortened."""
    import zerospeed

    cfg = json.load(open(path))
    cfg["optimizer"]["params"]["freeze_step"] = freeze
    engine, _, _, _ = zerospeed.initialize(model=model(), config=cfg)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses = []
    for step in range(steps):
        for k in range(gas):
            x, y = batch(1000 * step + k, dist.get_rank(), micro)
            loss = nn.functional.mse_loss(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
        losses.append(float(loss))
    return {"losses": losses, "global_steps": engine.global_steps}


def checkpoint_resume(ckpt: str, freeze: int, steps: int, save_at: int) -> dict:
    """Train ``steps`` steps saving at ``save_at`` (after the warm-up), then a fresh engine loads that checkpoint and
    trains the rest: both final weights."""
    import zerospeed

    def build():
        cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0, "gradient_clipping": 0.0,
               "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": freeze}}}
        return zerospeed.initialize(model=model(), config=cfg)[0]

    def train(engine, start: int, stop: int) -> None:
        for step in range(start, stop):
            x, y = batch(step, dist.get_rank())
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()

    first = build()
    train(first, 0, save_at)
    first.save_checkpoint(ckpt)
    train(first, save_at, steps)
    second = build()
    second.load_checkpoint(ckpt)
    train(second, save_at, steps)
    return {"straight": {k: v.clone() for k, v in first.module.state_dict().items()},
            "resumed": {k: v.clone() for k, v in second.module.state_dict().items()}}
