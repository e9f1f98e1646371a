"""Muon against AdamW under ZeRO 0-3 (issue #30): optimizer step time, optimizer-state bytes per rank, loss.

Run from the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python bench/optim_bench.py --model small --worlds 2 4 --steps 8

Each configuration trains the example GPT (``examples/gpt_model.py``, same seed, same batches) on
``world`` gloo ranks started by ``zerospeed.testing.run_distributed``, one torch thread per rank. Measured
per rank and reported as the median over ranks: the median wall time of ``engine.step()`` (the
optimizer step: for Muon including the all-gather, the owners' Newton-Schulz and the reduce-scatter),
the whole training step, the optimizer-state bytes (``memory_breakdown()['optimizer_states']``) and
the Newton-Schulz FLOPs this rank ran; the loss after the last step.

Muon's tagging follows DeepSpeed's rule (2-D weights whose name has neither ``embed`` nor ``lm_head``);
the example GPT names its embeddings ``tok_emb`` / ``pos_emb``, which that rule would put on Muon, so the
bench passes them (and the tied head) to Adam with a ``use_muon: False`` parameter group, as a DeepSpeed
user would have to. DeepSpeed's own Muon is not run here (it is not installed in this venv); the issue's
measurements of it (ZeRO-1 hangs, ZeRO-2 diverges from ZeRO-0) are quoted in the notes, not re-measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "bench"))

from common import command_line, write_results  # noqa: E402

MICRO_BATCH = 4
OPTIMIZERS = {
    "Muon": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-3, "momentum": 0.95, "weight_decay": 0.0}},
    "AdamW": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8}},
}


def _worker(model_size: str, opt_name: str, stage: int, steps: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist

    import zerospeed
    from gpt_model import GPT, gpt_bench, gpt_small

    cfg_model = gpt_small() if model_size == "small" else gpt_bench()
    torch.manual_seed(0)
    model = GPT(cfg_model)
    rank, world = dist.get_rank(), dist.get_world_size()
    aux = [p for n, p in model.named_parameters() if "emb" in n or p.dim() < 2]
    hidden = [p for n, p in model.named_parameters() if not ("emb" in n or p.dim() < 2)]
    groups = [{"params": hidden}, {"params": aux, "use_muon": False}] if opt_name == "Muon" else None
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1, "steps_per_print": 0,
           "gradient_clipping": 1.0, "optimizer": OPTIMIZERS[opt_name],
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 2_000_000, "allgather_bucket_size": 2_000_000}}
    engine, opt, _, _ = zerospeed.initialize(model=model, model_parameters=groups, config=cfg)
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg_model.vocab_size, (MICRO_BATCH * world, cfg_model.seq_len + 1), generator=gen)
            for _ in range(warmup + steps)]
    step_s, total_s, loss = [], [], 0.0
    for i, batch in enumerate(data):
        mine = batch.chunk(world)[rank]
        dist.barrier()
        t0 = time.perf_counter()
        out = engine(mine[:, :-1], mine[:, 1:])
        engine.backward(out)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        if i >= warmup:
            step_s.append(t2 - t1)
            total_s.append(t2 - t0)
        loss = float(out.detach())
    plan = getattr(opt, "shard_plan", None)
    return {"opt_step_s": statistics.median(step_s), "train_step_s": statistics.median(total_s), "loss": loss,
            "optimizer_state_bytes": engine.memory_breakdown()["optimizer_states"],
            "ns_gflop_per_step": None if plan is None else plan.ns_flops_done / 1e9 / (warmup + steps),
            "muon_elements": sum(p.numel() for g in opt.param_groups if g.get("use_muon") for p in g["params"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["small", "bench"], default="small")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    from zerospeed.testing import run_distributed

    rows = []
    for world in args.worlds:
        for stage in args.stages:
            per_opt = {}
            for name in OPTIMIZERS:
                res = run_distributed(_worker, world, args.model, name, stage, args.steps, args.warmup, timeout=900)
                med = {k: statistics.median(r[k] for r in res) if res[0][k] is not None else None for k in res[0]}
                per_opt[name] = med
                row = {"world": world, "stage": stage, "optimizer": name, **{k: med[k] for k in med}}
                rows.append(row)
                print(row, flush=True)
            m, a = per_opt["Muon"], per_opt["AdamW"]
            rows[-2]["step_vs_adamw"] = round(m["opt_step_s"] / a["opt_step_s"], 3)
            rows[-2]["state_vs_adamw"] = round(m["optimizer_state_bytes"] / a["optimizer_state_bytes"], 3)
    notes = [
        "opt_step_s: median engine.step() time (optimizer step incl. Muon's all-gather / NS / reduce-scatter); "
        "state_vs_adamw: optimizer-state bytes per rank, whole model (Muon's weights hold 1 buffer, Adam's 2)",
        "DeepSpeed 0.19.8 Muon not re-measured here; the issue reports on CPU, 2 ranks: ZeRO-0 trains, ZeRO-1 hangs, "
        "ZeRO-2 trains to a different loss than ZeRO-0",
    ]
    json_path, md_path = write_results("optim_bench", rows, params=vars(args), notes=notes, command=command_line())
    print(json_path, md_path)


if __name__ == "__main__":
    main()
