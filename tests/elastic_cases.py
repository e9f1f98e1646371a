"""The training job of the elastic-restart tests: resumes from ``latest`` at start-up, as README shows.

``python elastic_cases.py OUT STEPS EVERY KILL_STEP MODE`` (under ``zerospeed --max_restarts``):
trains ``STEPS`` optimizer steps on a fixed 64-sample data set through the loader ``initialize``
returns, saving a checkpoint every ``EVERY`` steps, after ``engine.load_checkpoint`` at start-up. On
the first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0) it is interrupted:

* ``MODE=step``: rank 1 SIGKILLs itself right after step ``KILL_STEP`` (between two checkpoints);
* ``MODE=save``: rank 0 stops inside the save at step ``KILL_STEP``, after every rank wrote its
  shards and before the checkpoint is published, writing ``OUT/paused``; the test SIGKILLs it there.

Each attempt logs, per rank, the global step and sample ids of every step (``OUT/seen-<attempt>-<rank>``)
and rank 0 the checkpoint it resumed from (``OUT/attempts``); the final fp32 weights go to ``OUT/final.pt``.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import zerospeed

NUM_SAMPLES, DIM = 64, 8


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(NUM_SAMPLES, DIM, generator=g)
    return TensorDataset(x, torch.tanh(x @ torch.randn(DIM, DIM, generator=g)), torch.arange(NUM_SAMPLES))


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "seed": 3,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 200,
                                  "stage3_param_persistence_threshold": 0}}


def run(out: str, steps: int, every: int, kill_step: int = -1, mode: str = "none", stage: int = 2) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, DIM))
    engine, _, loader, _ = zerospeed.initialize(model=model, config=config(stage), training_data=dataset())
    ckpt = os.path.join(out, "ckpt")
    os.makedirs(ckpt, exist_ok=True)
    resumed_from, _ = engine.load_checkpoint(ckpt)  # (None, None) on the first attempt: nothing saved yet
    rank = torch.distributed.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    interrupt = attempt == 0 and mode != "none"
    with open(os.path.join(out, f"pid-{attempt}-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 0:
        with open(os.path.join(out, "attempts"), "a") as f:
            f.write(f"{attempt} {os.path.basename(resumed_from) if resumed_from else '-'} {engine.global_steps}\n")
    seen = open(os.path.join(out, f"seen-{attempt}-{rank}"), "a")
    while engine.global_steps < steps:
        for x, y, ids in loader:
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            seen.write(f"{engine.global_steps} {' '.join(map(str, ids.tolist()))}\n")
            seen.flush()
            if interrupt and mode == "step" and rank == 1 and engine.global_steps == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if engine.global_steps % every == 0:
                if interrupt and mode == "save" and rank == 0 and engine.global_steps == kill_step:
                    os.environ.update(ZEROSPEED_CKPT_TEST_PAUSE="index", ZEROSPEED_CKPT_TEST_PAUSE_S="120",
                                      ZEROSPEED_CKPT_TEST_PAUSE_MARKER=os.path.join(out, "paused"))
                engine.save_checkpoint(ckpt)
            if engine.global_steps >= steps:
                break
    seen.close()
    weights = engine.consolidated_state_dict()
    if rank == 0 and out:
        torch.save(weights, os.path.join(out, "final.pt"))
    return weights


if __name__ == "__main__":
    out_dir, num_steps, cadence, kill_at, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
        sys.argv[5]
    run(out_dir, num_steps, cadence, kill_at, how, stage=int(sys.argv[6]) if len(sys.argv) > 6 else 2)
