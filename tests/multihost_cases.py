"""Training cases shared by the multi-host tests: one function, run under the launcher or run_distributed.

:func:`train` builds the same model and data on every run (seeded), so a world of 4 split over two
network namespaces and a world of 4 on one host must produce the same weights.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

import zerospeed

DIM = 16


def model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, DIM))


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 600, "allgather_bucket_size": 600,
                                  "stage3_param_persistence_threshold": 0},
            "gradient_clipping": 1.0}


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, DIM, generator=g)
    return x, x.flip(-1) * 0.5


def train(stage: int, steps: int = 4, save_dir: str | None = None) -> dict[str, torch.Tensor]:
    """Train ``steps`` steps at ZeRO ``stage``; return the full fp32 weights on rank 0 (``{}`` elsewhere)."""
    engine, _, _, _ = zerospeed.initialize(model=model(), config=config(stage))
    rank = torch.distributed.get_rank()
    for step in range(steps):
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    weights = engine.consolidated_state_dict()
    engine.destroy()
    return weights


def load_weights(load_dir: str, stage: int) -> dict[str, torch.Tensor]:
    """Load a checkpoint at ZeRO ``stage`` on this world; return the full weights on rank 0."""
    engine, _, _, _ = zerospeed.initialize(model=model(), config=config(stage))
    path, _ = engine.load_checkpoint(load_dir)
    assert path is not None, f"nothing loaded from {load_dir}"
    weights = engine.consolidated_state_dict()
    engine.destroy()
    return weights


if __name__ == "__main__":  # the launched worker: python multihost_cases.py OUT_DIR
    out = sys.argv[1]
    zerospeed.init_distributed()
    results = {"stage2": train(2), "stage3": train(3, save_dir=os.path.join(out, "ckpt"))}
    results["world_size"] = torch.distributed.get_world_size()
    results["hosts"] = os.environ.get("GROUP_RANK")
    results["ifname"] = os.environ.get("GLOO_SOCKET_IFNAME")
    if torch.distributed.get_rank() == 0:
        torch.save(results, os.path.join(out, "result.pt"))
