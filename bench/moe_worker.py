"""One system of bench/moe_bench.py on N processes: a GPT whose FFNs are dense or mixture-of-experts
(8 experts, top-2, each expert half the dense FFN's width, so active parameters per token equal the
dense model's), trained with ZeRO-1 AdamW (DeepSpeed and zerospeed alike) on synthetic byte tokens. Prints one ``RESULT {json}`` line.

``--system``: ``dense`` | ``moe`` (zerospeed, grouped experts) | ``moe_loop`` (zerospeed, per-expert
loop) | ``deepspeed`` (DeepSpeed 0.19.8's ``deepspeed.moe.layer.MoE``; run with .venv-bench).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from gpt_model import GPT, GPTConfig  # noqa: E402


class Expert(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, hidden)
        self.proj = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.nn.functional.gelu(self.fc(x)))


class MoEFFN(nn.Module):
    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.moe = moe
        self.l_aux = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, l_aux, _ = self.moe(x)
        self.l_aux = l_aux
        return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--system", required=True)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--local_rank", type=int, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    ds = args.system == "deepspeed"
    if ds:
        import deepspeed as lib
        from deepspeed.moe.layer import MoE
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    else:
        import zerospeed as lib
        from zerospeed.moe.layer import MoE
        from zerospeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    lib.init_distributed()
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=256, seq_len=128)
    torch.manual_seed(0)
    model = GPT(cfg)
    if args.system != "dense":
        for block in model.blocks:
            kwargs = dict(num_experts=8, ep_size=args.ep, k=2, capacity_factor=1.25, min_capacity=4)
            if args.system == "moe_loop":
                kwargs["grouped_experts"] = False
            block.mlp = MoEFFN(MoE(cfg.d_model, Expert(cfg.d_model, 2 * cfg.d_model), **kwargs))
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "dense"})
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
              "zero_optimization": {"stage": 1}, "steps_per_print": 10_000}
    if ds:  # DeepSpeed's own comms logger counts its MoE all-to-alls (only those: the others run untimed)
        config["comms_logger"] = {"enabled": True, "prof_all": False, "prof_ops": ["all_to_all_single"],
                                  "verbose": False}
        opt = torch.optim.AdamW(groups, lr=3e-4)
        config.pop("optimizer")
        engine, *_ = lib.initialize(model=model, optimizer=opt, config=config)
    else:
        engine, *_ = lib.initialize(model=model, model_parameters=groups, config=config)
    gen = torch.Generator().manual_seed(1 + rank)
    times = []
    counter = None if ds else lib.comm.COUNTER
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            if counter is not None:
                counter.reset()
            else:
                from deepspeed.comm.comm import comms_logger
                comms_logger.reset_data()
        x = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len), generator=gen)
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(x, x)
        if args.system != "dense":
            loss = loss + 0.01 * sum(b.mlp.l_aux for b in engine.module.blocks)
        engine.backward(loss)
        engine.step()
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    if counter is not None:
        a2a = counter.elements("all_to_all") // args.steps
    else:  # {op: {message bytes: [count, ...]}}; fp32 elements
        from deepspeed.comm.comm import comms_logger
        logged = comms_logger.get_raw_data().get("all_to_all_single", {})
        a2a = sum(size * rec[0] for size, rec in logged.items()) // 4 // args.steps
    params = sum(p.numel() for p in engine.module.parameters())
    if rank == 0:
        version = getattr(lib, "__version__", None)
        print("RESULT " + json.dumps({"system": args.system, "version": version, "ep": args.ep, "world": world,
                                      "step_s": statistics.median(times), "peak_rss_bytes": max(peaks),
                                      "all_to_all_elements_per_step": a2a, "params_rank0": params,
                                      "final_loss": float(loss.detach())}), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
