"""Rank functions of the DeepSpeed-checkpoint tests (issue #26): build a zerospeed engine on the
fixture model, load a folder DeepSpeed 0.19.8 wrote, report the loaded state, train on."""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures", "deepspeed")
sys.path.insert(0, FIXTURES)

from tiny_model import batch, config, make_model, param_groups  # noqa: E402

from checkpoint_cases import shard_state  # noqa: E402


def zs_config(stage: int, precision: str, world: int, offload: bool = False) -> dict:
    cfg = copy.deepcopy(config(stage, precision, world))
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def build(cfg: dict, seed: int = 99, groups: bool = False):
    """The fixture model; ``groups``: with tiny_model.param_groups, as the ``*_groups`` fixtures trained."""
    import zerospeed

    model = make_model(seed)
    params = param_groups(model) if groups else model.parameters()
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=params, config=cfg)
    return engine


def train(engine, first: int, num: int) -> list[float]:
    rank, world = engine.dp_rank, engine.dp_world_size
    losses = []
    dtype = engine.compute_dtype
    for step in range(first, first + num):
        x, y = batch(step)
        loss = engine(x.chunk(world)[rank].to(dtype), y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def resume_case(cfg: dict, load_dir: str, num_steps: int, groups: bool = False, **load_kwargs) -> dict:
    engine = build(cfg, groups=groups)
    path, client = engine.load_checkpoint(load_dir, **load_kwargs)
    state = shard_state(engine)
    scaler = getattr(engine, "loss_scaler", None)
    out = {"path": path, "client_keys": sorted(client) if client is not None else None,
           "client": {k: client[k] for k in ("epoch", "note", "best") if client and k in client},
           "client_weights": client["weights"].tolist() if client and "weights" in client else None,
           "state": state, "global_steps": engine.global_steps, "global_samples": engine.global_samples,
           "skipped_steps": engine.skipped_steps,
           "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
           "loss_scale": None if scaler is None else float(scaler.scale),
           "weights": {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
           if engine.dp_world_size == 1 or cfg["zero_optimization"]["stage"] < 3 else None}
    out["losses"] = train(engine, int(engine.global_steps), num_steps) if num_steps else []
    return out


def error_case(cfg: dict, load_dir: str) -> str:
    engine = build(cfg)
    try:
        engine.load_checkpoint(load_dir)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return "no error"


class Wrapped(torch.nn.Module):
    """The fixture model one level down: every parameter name gains a ``net.`` prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model(99)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(x, y)


def resume_many(items: list[tuple[str, dict, int, dict]]) -> list[dict]:
    """``resume_case`` for several (fixture, config, steps, load options) in one set of processes."""
    return [resume_case(cfg, os.path.join(FIXTURES, case, "ckpt"), steps, groups=case.endswith("_groups"), **opts)
            for case, cfg, steps, opts in items]


def mismatch_case(cfg: dict, load_dir: str) -> str:
    import zerospeed

    model = Wrapped()
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    try:
        engine.load_checkpoint(load_dir)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return "no error"


def resave_case(cfg: dict, load_dir: str, save_dir: str, num_steps: int = 0) -> list[float]:
    """Load a DeepSpeed folder, train ``num_steps``, save a zerospeed checkpoint; the losses trained."""
    engine = build(cfg)
    engine.load_checkpoint(load_dir)
    losses = train(engine, int(engine.global_steps), num_steps) if num_steps else []
    engine.save_checkpoint(save_dir, client_state={"epoch": 2})
    return losses
