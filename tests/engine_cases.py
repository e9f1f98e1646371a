"""Shared model, data and reference run for engine tests (imported by the test modules and by
the ranks the harness starts)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

GLOBAL_BATCH = 16
STEPS = 4
LR = (0.02, 0.01)  # the two parameter groups
WEIGHT_DECAY = (0.0, 0.1)


class TinyNet(nn.Module):
    """Parameter sizes chosen not to be multiples of 2 or 4 (7x13, 13, 13x5, 5, 3x5, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.mid = nn.Linear(13, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        return nn.functional.mse_loss(self.out(h).float(), y.float())


def make_model(frozen: bool = False) -> TinyNet:
    """``frozen``: the middle layer does not train (requires_grad=False)."""
    torch.manual_seed(1234)
    model = TinyNet()
    if frozen:
        model.mid.requires_grad_(False)
    return model


def param_groups(model: nn.Module) -> list[dict]:
    first = [model.inp.weight, model.inp.bias]
    rest = [p for n, p in model.named_parameters() if not n.startswith("inp.") and p.requires_grad]
    return [{"params": first, "lr": LR[0], "weight_decay": WEIGHT_DECAY[0]},
            {"params": rest, "lr": LR[1], "weight_decay": WEIGHT_DECAY[1]}]


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def config(stage: int, gas: int, precision: str = "fp32", clip: float = 1.0, bucket: int = 64, **extra) -> dict:
    cfg = {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "betas": [0.9, 0.99], "eps": 1e-8}},
           "gradient_clipping": clip, "steps_per_print": 0,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
           "bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": precision == "fp16"}}
    cfg.update(extra)
    return cfg


def reference_run(gas: int, clip: float = 1.0, steps: int = STEPS,
                  frozen: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single process, plain PyTorch: the global batch in ``gas`` micro-batches, mean loss."""
    model = make_model(frozen)
    opt = torch.optim.AdamW(param_groups(model), lr=0.05, betas=(0.9, 0.99), eps=1e-8, foreach=False)
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x.chunk(gas), y.chunk(gas)):
            loss = model(xm, ym) / gas
            loss.backward()
            total += loss.item()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_run(cfg: dict, steps: int = STEPS, frozen: bool = False) -> dict:
    """Train with zerospeed on this rank's slice of each global batch; return losses, weights, stats."""
    import zerospeed
    from zerospeed import comm

    model = make_model(frozen)
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    gas = engine.gradient_accumulation_steps()
    losses, comms, norms = [], [], []
    for step in range(steps):
        x, y = global_batch(step)
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        total = torch.zeros(())
        comm.COUNTER.reset()
        for xm, ym in zip(xs.chunk(gas), ys.chunk(gas)):
            loss = engine(xm, ym)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / gas
        comms.append(comm.COUNTER.snapshot())
        dist.all_reduce(total)
        losses.append(total.item() / world)
        norms.append(engine.get_global_grad_norm())
    weights = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "weights": weights, "comms": comms, "norms": norms,
            "num_buckets": engine.strategy.num_buckets, "memory": engine.memory_breakdown(),
            "global_steps": engine.global_steps, "lr": engine.get_lr()}


def max_rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max()).item() for k in b)


def copy_of(x):
    return copy.deepcopy(x)
