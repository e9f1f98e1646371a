"""The training script bench/autotune_bench.py tunes: gpt_bench (~14.3M parameters), synthetic
byte tokens, ``zerospeed.initialize`` from ``--deepspeed_config``. Under an autotuning experiment
the engine ends the process after ``end_profile_step``."""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import zerospeed  # noqa: E402
from gpt_model import GPT, gpt_bench  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--deepspeed_config", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--local_rank", type=int, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = gpt_bench()
    model = GPT(cfg)
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=args.deepspeed_config)
    gen = torch.Generator().manual_seed(1 + zerospeed.comm.get_rank())
    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        x = torch.randint(0, cfg.vocab_size, (engine.train_micro_batch_size_per_gpu(), cfg.seq_len), generator=gen)
        engine.backward(engine(x, x))
        engine.step()


if __name__ == "__main__":
    main()
