"""A DeepSpeed-style training script for the autotuning tests (tiny GPT, synthetic tokens).

``--crash_mbs N`` makes it fail when the config's micro-batch size is N, ``--hang_mbs N`` makes it
hang before its first step (an experiment the tuner must kill). Under an autotuning experiment the
engine ends the process after ``end_profile_step``; otherwise it trains ``--steps`` steps and
prints the final loss.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import zerospeed as deepspeed  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--deepspeed_config", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--crash_mbs", type=int, default=-1)
    p.add_argument("--hang_mbs", type=int, default=-1)
    p.add_argument("--local_rank", type=int, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    with open(args.deepspeed_config) as f:
        mbs = json.load(f).get("train_micro_batch_size_per_gpu")
    if mbs == args.crash_mbs:
        raise RuntimeError(f"injected crash at micro-batch size {mbs}")
    if mbs == args.hang_mbs:
        time.sleep(3600)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, n_layer=1, n_head=2, d_model=32, seq_len=16)
    model = GPT(cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=args.deepspeed_config)
    gen = torch.Generator().manual_seed(1 + deepspeed.comm.get_rank())
    loss = None
    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        x = torch.randint(0, cfg.vocab_size, (engine.train_micro_batch_size_per_gpu(), cfg.seq_len), generator=gen)
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
    if deepspeed.comm.get_rank() == 0:
        print(f"trained {engine.global_steps} steps, final loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
