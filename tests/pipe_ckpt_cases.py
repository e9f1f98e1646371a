"""Pipeline engine checkpoints: save on a 2-stage engine, resume on a fresh one (imported by the ranks
the harness starts; see ``test_pipe_checkpoint.py``)."""
from __future__ import annotations

import os

import torch.distributed as dist

from pipe_cases import config, make_pipeline, micro_batches

GAS = 2


def _engine(stages: int, zero: int, async_save: bool = False):
    import zerospeed

    cfg = config("1f1b", GAS, zero=zero, checkpoint={"async_save": async_save})
    engine, _, _, _ = zerospeed.initialize(model=make_pipeline(stages), config=cfg)
    return engine


def _train(engine, stages: int, steps: range) -> list[float]:
    num_dp = dist.get_world_size() // stages
    dp_rank = dist.get_rank() % num_dp
    losses = []
    for step in steps:
        data = iter(micro_batches(step, dp_rank, num_dp, GAS))
        losses.append(float(engine.train_batch(data if engine.is_first_stage() or engine.is_last_stage() else None)))
    return losses


def save_and_resume(save_dir: str, zero: int = 0, async_save: bool = False, steps: int = 2, more: int = 2) -> dict:
    """2 stages: train ``steps``, save, train ``more`` (the continued losses); a fresh engine loads and
    trains ``more``."""
    engine = _engine(2, zero, async_save)
    _train(engine, 2, range(steps))
    engine.save_checkpoint(save_dir, client_state={"stage": engine.stage_id})
    continued = _train(engine, 2, range(steps, steps + more))
    engine.wait_for_checkpoint() if async_save else None
    fresh = _engine(2, zero)
    path, client = fresh.load_checkpoint(save_dir)
    loaded_steps = fresh.global_steps
    resumed = _train(fresh, 2, range(steps, steps + more))
    listing = sorted(os.listdir(save_dir)) if dist.get_rank() == 0 else None
    tag_files = sorted(os.listdir(path)) if dist.get_rank() == 0 else None
    return {"continued": continued, "resumed": resumed, "path": path, "client": client,
            "global_steps": loaded_steps, "listing": listing, "tag_files": tag_files}


def resume_only(load_dir: str, stages: int, zero: int, steps: int = 2, more: int = 2) -> dict:
    """A fresh engine (other stage count / data-parallel size) loads ``load_dir`` and trains ``more`` steps."""
    fresh = _engine(stages, zero)
    fresh.load_checkpoint(load_dir)
    loaded_steps = fresh.global_steps
    return {"resumed": _train(fresh, stages, range(steps, steps + more)), "global_steps": loaded_steps}
