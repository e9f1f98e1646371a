"""Muon against AdamW under ZeRO 0-3 (issue #30): optimizer step time, optimizer-state bytes per rank, loss.

Run from the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python bench/optim_bench.py --model small --worlds 2 4 --steps 8 \
        --tokens_sweep 1 4 16 --deepspeed_python .venv-bench/bin/python

Each configuration trains the example GPT (``examples/gpt_model.py``, same seed, same batches) on
``world`` gloo ranks started by ``zerospeed.testing.run_distributed``, one torch thread per rank. Measured
per rank and reported as the median over ranks: the median wall time of ``engine.step()`` (the
optimizer step: for Muon including the exchange of pieces to the owners, their Newton-Schulz and the way back),
the whole training step, the optimizer-state bytes (``memory_breakdown()['optimizer_states']``) and
the Newton-Schulz FLOPs this rank ran; the loss after the last step.

Muon's tagging follows DeepSpeed's rule (2-D weights whose name has neither ``embed`` nor ``lm_head``);
the example GPT names its embeddings ``tok_emb`` / ``pos_emb``, which that rule would put on Muon, so the
bench passes them (and the tied head) to Adam with a ``use_muon: False`` parameter group, as a DeepSpeed
user would have to.

``--tokens_sweep K ...``: the same comparison on 2 ranks (at ``--tokens_stages``, default ZeRO-2) with K times
the tokens per step (micro batch 4*K... as gradient accumulation of K micro-batches of 4), because the ratio the +25% target is about
depends on it: Newton-Schulz costs about 30*d FLOPs per Muon weight per step (5 iterations of ~3 matmuls on
the d-wide side; ``ns_flops``), spread over N ranks, while forward+backward costs 6*T FLOPs per weight for T
tokens per step, also spread over N ranks; so NS / (fwd+bwd) ~ 5*d / T whatever N is. The example GPT
(d = 192, T = 512 at K = 1) sits at ~1.9; a user's run (d = 4096, T = 1M tokens) at ~0.02.

``--optimizers``: which of Muon, Muon with Newton-Schulz in bf16 (``ns_dtype: bfloat16``) and AdamW to run.
``--onebit``: 1-bit Adam, 0/1 Adam and 1-bit LAMB at ZeRO-0 on 2 ranks next to Adam and Lamb: bytes sent per
step after the warm-up (zerospeed's comms counter) and the loss of every step (issue #28).

``--deepspeed_python``: DeepSpeed 0.19.8's Muon side by side (bench/optim_worker.py under torchrun, the same
script under both libraries, DeepSpeed's tagging in both) at ZeRO 0-3 on 2 and 4 ranks, each run under
``--deepspeed_timeout`` seconds: a run with no result in that time is recorded as a hang.
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

from common import command_line, launch_workers, write_results  # noqa: E402

MICRO_BATCH = 4
OPTIMIZERS = {
    "Muon": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-3, "momentum": 0.95, "weight_decay": 0.0}},
    "Muon bf16-NS": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-3, "momentum": 0.95, "weight_decay": 0.0,
                                                "ns_dtype": "bfloat16"}},
    "AdamW": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8}},
}
#: --onebit: the 1-bit family next to its uncompressed twins, ZeRO-0 (their only stage); the warm-up / variance
#: freeze is the bench's --onebit_warmup steps, so the measured steps are the compressed ones
ONEBIT = {
    "Adam": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.0}},
    "OneBitAdam": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": None}},
    "ZeroOneAdam": {"type": "ZeroOneAdam", "params": {"lr": 1e-3, "var_freeze_step": None, "var_update_scaler": 2,
                                                      "local_step_scaler": 4, "local_step_clipper": 4}},
    "Lamb": {"type": "Lamb", "params": {"lr": 1e-3, "weight_decay": 0.0, "bias_correction": False}},
    "OneBitLamb": {"type": "OneBitLamb", "params": {"lr": 1e-3, "freeze_step": None, "bias_correction": False}},
}


def _optimizer_config(opt_name: str, warmup: int) -> dict:
    import copy

    if opt_name in OPTIMIZERS:
        return copy.deepcopy(OPTIMIZERS[opt_name])
    cfg = copy.deepcopy(ONEBIT[opt_name])
    for key in ("freeze_step", "var_freeze_step"):
        if key in cfg["params"]:
            cfg["params"][key] = warmup
    return cfg


def _worker(model_size: str, opt_name: str, stage: int, steps: int, warmup: int, accumulation: int = 1) -> dict:
    import torch
    import torch.distributed as dist

    import zerospeed
    from zerospeed.comm.counter import COUNTER
    from gpt_model import GPT, gpt_bench, gpt_small

    cfg_model = gpt_small() if model_size == "small" else gpt_bench()
    torch.manual_seed(0)
    model = GPT(cfg_model)
    rank, world = dist.get_rank(), dist.get_world_size()
    aux = [p for n, p in model.named_parameters() if "emb" in n or p.dim() < 2]
    hidden = [p for n, p in model.named_parameters() if not ("emb" in n or p.dim() < 2)]
    groups = [{"params": hidden}, {"params": aux, "use_muon": False}] if opt_name.startswith("Muon") else None
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": accumulation,
           "steps_per_print": 0,
           "gradient_clipping": 1.0, "optimizer": _optimizer_config(opt_name, warmup),
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 2_000_000, "allgather_bucket_size": 2_000_000}}
    engine, opt, _, _ = zerospeed.initialize(model=model, model_parameters=groups, config=cfg)
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg_model.vocab_size, (MICRO_BATCH * world, cfg_model.seq_len + 1), generator=gen)
            for _ in range((warmup + steps) * accumulation)]
    step_s, total_s, step_cpu_s, total_cpu_s, loss, losses = [], [], [], [], 0.0, []
    for i in range(warmup + steps):
        dist.barrier()
        if i == warmup:
            COUNTER.reset()  # bytes of the measured steps only
        t0, c0 = time.perf_counter(), time.process_time()
        for j, batch in enumerate(data[i * accumulation:(i + 1) * accumulation]):
            mine = batch.chunk(world)[rank]
            out = engine(mine[:, :-1], mine[:, 1:])
            engine.backward(out)
            if j < accumulation - 1:
                engine.step()  # not a boundary: the engine only counts the micro-step
        t1, c1 = time.perf_counter(), time.process_time()
        engine.step()
        t2, c2 = time.perf_counter(), time.process_time()
        if i >= warmup:
            step_s.append(t2 - t1)
            total_s.append(t2 - t0)
            step_cpu_s.append(c2 - c1)
            total_cpu_s.append(c2 - c0)
        loss = float(out.detach())
        losses.append(round(loss, 5))
    sent = sum(v.intra_host_bytes + v.inter_host_bytes for v in COUNTER.ops.values()) / steps
    plan = getattr(opt, "shard_plan", None)
    return {"opt_step_s": statistics.median(step_s), "opt_step_cpu_s": statistics.median(step_cpu_s),
            "train_step_s": statistics.median(total_s), "train_step_cpu_s": statistics.median(total_cpu_s), "loss": loss,
            "optimizer_state_bytes": engine.memory_breakdown()["optimizer_states"],
            "sent_bytes_per_step": sent, "losses": losses,
            "ns_gflop_per_step": None if plan is None else plan.ns_flops_done / 1e9 / (warmup + steps),
            "muon_elements": sum(p.numel() for g in opt.param_groups if g.get("use_muon") for p in g["params"]),
            "tokens_per_step": MICRO_BATCH * world * cfg_model.seq_len * accumulation, "d_model": cfg_model.d_model}


def _compare(rows: list[dict], per_opt: dict[str, dict], base: str) -> None:
    b = per_opt[base]
    for row in rows[-len(per_opt):]:
        name = row["optimizer"]
        if name == base:
            continue
        m = per_opt[name]
        row[f"step_vs_{base.lower()}"] = round(m["opt_step_s"] / b["opt_step_s"], 3)
        row[f"step_cpu_vs_{base.lower()}"] = round(m["opt_step_cpu_s"] / b["opt_step_cpu_s"], 3)
        row[f"train_step_vs_{base.lower()}"] = round(m["train_step_s"] / b["train_step_s"], 3)
        row[f"train_step_cpu_vs_{base.lower()}"] = round(m["train_step_cpu_s"] / b["train_step_cpu_s"], 3)
        row[f"state_vs_{base.lower()}"] = round(m["optimizer_state_bytes"] / b["optimizer_state_bytes"], 3)
        if b["sent_bytes_per_step"]:
            row[f"bytes_vs_{base.lower()}"] = round(m["sent_bytes_per_step"] / b["sent_bytes_per_step"], 4)


def _run(args: argparse.Namespace, world: int, stage: int, accumulation: int, rows: list[dict],
         names: list[str] | None = None, part: str | None = None) -> None:
    from zerospeed.testing import run_distributed

    names = names or args.optimizers
    per_opt = {}
    for name in names:
        warmup = args.onebit_warmup if part == "1-bit" else args.warmup
        res = run_distributed(_worker, world, args.model, name, stage, args.steps, warmup, accumulation,
                              timeout=1800)
        med = {k: statistics.median(r[k] for r in res) if res[0][k] is not None and k != "losses" else res[0][k]
               for k in res[0]}
        per_opt[name] = med
        row = {"part": part or ("zerospeed" if accumulation == 1 else "tokens"), "world": world, "stage": stage,
               "optimizer": name, **med}
        if part != "1-bit":
            row.pop("losses")
        rows.append(row)
        print(row, flush=True)
    if part == "1-bit":
        for twin, pair in (("Adam", ("Adam", "OneBitAdam", "ZeroOneAdam")), ("Lamb", ("Lamb", "OneBitLamb"))):
            sub = {k: per_opt[k] for k in pair if k in per_opt}
            if twin in sub and len(sub) > 1:
                # compare each compressed row with its twin: reorder a view of the rows of this pair
                pair_rows = [r for r in rows[-len(per_opt):] if r["optimizer"] in sub]
                _compare(pair_rows, sub, twin)
    elif "AdamW" in per_opt:
        _compare(rows, per_opt, "AdamW")


def _deepspeed(args: argparse.Namespace, rows: list[dict]) -> None:
    """DeepSpeed's and zerospeed's Muon on the same worker script, each --deepspeed_stages x --deepspeed_worlds."""
    import json
    import os
    import tempfile

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"), DS_ACCELERATOR="cpu",
               TORCH_EXTENSIONS_DIR=str(Path(args.deepspeed_python).parents[1] / "torch_extensions"))
    worker = REPO / "bench" / "optim_worker.py"
    with tempfile.TemporaryDirectory() as tmp:
        for world, stage in [(w, s) for w in args.deepspeed_worlds for s in args.deepspeed_stages]:
            runs = {}
            for lib in ("zerospeed", "deepspeed"):
                out = Path(tmp) / f"{lib}-{world}-{stage}.json"
                python = args.deepspeed_python if lib == "deepspeed" else sys.executable
                done = launch_workers(worker, [lib, "Muon", str(stage), str(args.steps), str(out)], num_procs=world,
                                      python=python, env=env, timeout_s=args.deepspeed_timeout)
                if done.returncode == 124:
                    runs[lib] = {"error": f"hangs (no result in {args.deepspeed_timeout:g} s)"}
                elif done.returncode != 0 or not out.exists():
                    runs[lib] = {"error": done.error or f"exit {done.returncode}"}
                else:
                    runs[lib] = json.loads(out.read_text())
            zs = runs["zerospeed"]
            for lib, r in runs.items():
                row = {"part": "vs DeepSpeed", "world": world, "stage": stage, "optimizer": f"Muon ({lib})"}
                if "error" in r:
                    row["error"] = r["error"]
                else:
                    row.update({"opt_step_s": r["opt_step_s"], "train_step_s": r["train_step_s"],
                                "loss_first": r["losses"][0], "loss": r["losses"][-1]})
                    if lib == "deepspeed" and "losses" in zs:
                        row["step_vs_zerospeed"] = round(r["opt_step_s"] / zs["opt_step_s"], 3)
                        row["max_loss_rel_diff_vs_zerospeed"] = max(abs(a - b) / abs(b) for a, b in
                                                                    zip(r["losses"], zs["losses"]))
                rows.append(row)
                print(row, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["small", "bench"], default="small")
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tokens_sweep", type=int, nargs="*", default=[],
                        help="2 ranks, each of --tokens_stages: gradient accumulation K (K x the tokens per step)")
    parser.add_argument("--tokens_stages", type=int, nargs="+", default=[2],
                        help="the ZeRO stages of the --tokens_sweep rows")
    parser.add_argument("--deepspeed_python", default=None, help="python of a venv with DeepSpeed 0.19.8")
    parser.add_argument("--deepspeed_stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--deepspeed_worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--deepspeed_timeout", type=float, default=300.0)
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--onebit", action="store_true", help="ZeRO-0, 2 ranks: the 1-bit family next to Adam/Lamb")
    parser.add_argument("--onebit_warmup", type=int, default=4, help="freeze_step / var_freeze_step of --onebit")
    args = parser.parse_args()

    import os

    load_before = os.getloadavg()[0]
    rows: list[dict] = []
    for world in args.worlds:
        for stage in args.stages:
            _run(args, world, stage, 1, rows)
    for k in args.tokens_sweep:
        for stage in args.tokens_stages:
            _run(args, 2, stage, k, rows)
    if args.onebit:
        _run(args, 2, 0, 1, rows, list(ONEBIT), "1-bit")
    if args.deepspeed_python:
        _deepspeed(args, rows)
    notes = [
        "opt_step_s: median engine.step() wall time (optimizer step incl. Muon's exchange of pieces / NS); "
        "opt_step_cpu_s: the same step's CPU time on the rank (process_time: less sensitive to the other jobs on "
        "this shared machine; gloo's waits block rather than spin); train_step_s: "
        "forward+backward+step; state_vs_adamw: optimizer-state bytes per rank, whole model (Muon's weights hold 1 "
        "buffer, Adam's 2)",
        "part 'tokens': 2 ranks at each of --tokens_stages, K micro-batches accumulated per step; NS/(fwd+bwd) FLOPs ~ 5*d/T "
        "(d = d_model, T = tokens_per_step), so the train-step ratio falls toward 1 as T grows",
        "part 'vs DeepSpeed': bench/optim_worker.py, same script/model/batches under both libraries, DeepSpeed's "
        "name rule tags tok_emb/pos_emb onto Muon in both; DeepSpeed iterates Newton-Schulz in fp16 for ns_method gram "
        "where its accelerator reports fp16 (the CPU accelerator asks mkldnn: no on this machine, so fp32) and bf16 for "
        "standard; zerospeed in fp32 (ns_dtype default)",
        "'Muon bf16-NS': Muon with ns_dtype bfloat16 (Newton-Schulz iterated in bf16 after an fp32 normalisation; "
        "DeepSpeed's choice for ns_method standard on a bf16 device); the default is fp32",
        "part '1-bit' (--onebit): ZeRO-0, 2 ranks, freeze_step / var_freeze_step = --onebit_warmup, the measured steps "
        "after it; sent_bytes_per_step: bytes this rank sent per measured step, counted by zerospeed's comms "
        "counter (intra+inter host); losses: every step's loss (warm-up included) next to the twin's (Adam, Lamb)",
        "the machine is a shared 2-core VM with other jobs running: absolute times are noisy; 4 ranks oversubscribe it",
        f"1-minute load average: {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (2 cores)",
    ]
    json_path, md_path = write_results("optim_bench", rows, params=vars(args), notes=notes, command=command_line())
    print(json_path, md_path)


if __name__ == "__main__":
    main()
