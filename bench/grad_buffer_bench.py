"""ZeRO-2/3 transient gradient buffers: reused (``zero/grad_buffer_pool.py``) vs a fresh ``torch.zeros`` each step.

Run from the repository root::

    .venv/bin/python bench/grad_buffer_bench.py --rounds 3

Each trial is a fresh process of this script (``--worker``), so glibc's allocator state is not carried from one
trial to the next. The process is a world of one, has one torch thread, and uses ``ZEROSPEED_GRAD_BUFFER_POOL=0`` or
``1``. It trains ``gpt_bench()`` (14M parameters; ``examples/gpt_model.py``) with AdamW at the given ZeRO stage and
DeepSpeed's default ``reduce_bucket_size`` (5e8), on 8 x 128 random tokens per step. It measures two things over
the steps after ``--warmup``:

* the main thread's CPU time inside the pool's ``zeros`` calls, including one pass over the returned buffer (the
  first touch that the gradient copies would otherwise pay);
* the main thread's CPU time per whole step.

Pool off and pool on alternate within each round. The reported figures are medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "bench"))

from common import write_results  # noqa: E402


def _worker(stage: int, steps: int, warmup: int) -> dict:
    import torch

    torch.set_num_threads(1)
    import zerospeed
    import zerospeed.zero.grad_buffer_pool as pool_mod
    from gpt_model import GPT, gpt_bench

    torch.manual_seed(0)
    model = GPT(gpt_bench())
    cfg = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": stage}}
    engine, _, _, _ = zerospeed.initialize(model=model, config=cfg)
    reducer = engine.strategy.reducer
    sizes = [getattr(b, "padded_numel", None) or b.layout.padded_numel for b in reducer.buckets]
    spent = [0.0]
    original = pool_mod.GradBufferPool.zeros

    def timed(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        t = time.thread_time()
        out = original(self, *args, **kwargs)
        out.add_(0)  # first touch
        spent[0] += time.thread_time() - t
        return out

    pool_mod.GradBufferPool.zeros = timed
    tokens = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(1))
    step_cpu = []
    for i in range(warmup + steps):
        if i == warmup:
            spent[0] = 0.0
        t = time.thread_time()
        loss = engine(tokens, tokens)  # with targets, the model returns the loss
        engine.backward(loss)
        engine.step()
        if i >= warmup:
            step_cpu.append(time.thread_time() - t)
    return {"buffer_ms_per_step": spent[0] / steps * 1e3, "step_cpu_s": statistics.median(step_cpu),
            "buckets": len(sizes), "largest_bucket_mb": max(sizes) * 4 / 1e6, "reused": reducer._pool.reused}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="2,3")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no_write", action="store_true")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        print(json.dumps(_worker(args.worker, args.steps, args.warmup)), flush=True)
        return
    load_start = os.getloadavg()[0]
    rows = []
    for stage in (int(s) for s in args.stages.split(",")):
        runs: dict[str, list[dict]] = {"0": [], "1": []}
        for _ in range(args.rounds):
            for pool in ("0", "1"):
                env = dict(os.environ, ZEROSPEED_GRAD_BUFFER_POOL=pool, OMP_NUM_THREADS="1")
                out = subprocess.run([sys.executable, __file__, "--worker", str(stage), "--steps", str(args.steps),
                                      "--warmup", str(args.warmup)], env=env, capture_output=True, text=True,
                                     timeout=600, check=True)
                runs[pool].append(json.loads(out.stdout.strip().splitlines()[-1]))
        off, on = runs["0"], runs["1"]
        med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
        rows.append({"stage": stage, "buckets": off[0]["buckets"],
                     "largest_bucket_mb": round(off[0]["largest_bucket_mb"], 1),
                     "buffer_ms_fresh": round(med(off, "buffer_ms_per_step"), 1),
                     "buffer_ms_reused": round(med(on, "buffer_ms_per_step"), 1),
                     "step_cpu_s_fresh": round(med(off, "step_cpu_s"), 3),
                     "step_cpu_s_reused": round(med(on, "step_cpu_s"), 3),
                     "reused_per_run": on[0]["reused"]})
        print(rows[-1], flush=True)
    if not args.no_write:
        paths = write_results("grad_buffer_bench", rows,
                              params={"steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
                                      "model": "gpt_bench (14M)", "tokens_per_step": "8 x 128", "world": 1},
                              notes=[f"load average (1 min) at the start: {load_start:.1f}",
                                     "buffer_ms: main-thread CPU inside the pool's zeros() plus one pass over "
                                     "the buffer, per step; step_cpu_s: main-thread CPU per step (median)"])
        print("wrote", *paths)


if __name__ == "__main__":
    main()
