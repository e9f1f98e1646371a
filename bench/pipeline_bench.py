"""Pipeline parallelism: bubble, activation memory and step time per schedule, and vs DeepSpeed.

Run from the repository root (the bench venv has DeepSpeed; without it the DeepSpeed row is
reported as skipped)::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv-bench/bin/python bench/pipeline_bench.py
    .venv/bin/python bench/pipeline_bench.py --steps 3 --warmup 1 --no_write   # quick check

The script is its own driver: it launches ``--num_procs`` workers of itself through the
``zerospeed`` launcher (torchrun underneath); each worker builds one engine per system (zerospeed
with each schedule, and DeepSpeed's ``PipelineEngine``) in the same process group, and the steps go
round-robin over the systems (order rotated every step), so that every system sees the same load
on a shared machine. Every engine gets the same model: ``--layers`` blocks ``tanh(Linear(H, H))``
as a ``PipelineModule`` partitioned uniformly (so stages, and virtual stages, are balanced), MSE
loss, fp32, torch's AdamW for both systems, clipping 1.0, ZeRO 0, ``--micro_batches``
micro-batches of ``--micro_batch`` rows per step, the same data (the final losses agree).

Measured per rank, each timed step starting after a barrier:

* step time (``train_batch``, median over ``--steps`` after ``--warmup``; reported: slowest rank);
* bubble fraction = idle / schedule time, where the schedule time runs from the barrier to the end
  of the rank's last forward/backward/communication (the gradient reduction and optimizer step are
  left out, as in the theory) and idle is everything that is not forward or backward compute.
  zerospeed's engine records each action (``enable_profiling``); for DeepSpeed the bench times
  its ``ForwardPass`` / ``BackwardPass`` instructions the same way (instrumentation only: the
  instruction map is wrapped on the engine instance);
* peak activation memory: bytes of tensors autograd saves for backward (parameters excluded),
  summed over micro-batches alive at once, peak over the step (same accounting for both systems).

Theory columns: the textbook bubble ((p-1)/(m+p-1) for GPipe/1F1B, (p-1)/(v m+p-1) interleaved,
(p-1)/(3m+p-1) for ZB-H1 when F = I = W), the simulator (``zerospeed.pipe.simulate``) run on the
same schedule with the per-action costs measured in this run (communication free), and the stash
depth (micro-batches whose activations are alive at the peak) to read the memory column against.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from common import RESULTS_DIR, format_bytes, package_version, write_results  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SCHEDULES) + ",deepspeed",
                   help="comma-separated: zerospeed schedules and/or 'deepspeed'")
    p.add_argument("--num_procs", type=int, default=2, help="pipeline stages (one process each)")
    p.add_argument("--virtual_stages", type=int, default=2, help="virtual stages per rank (interleaved)")
    p.add_argument("--micro_batches", type=int, default=8, help="micro-batches per step (m)")
    p.add_argument("--micro_batch", type=int, default=64, help="rows per micro-batch")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--watchdog_s", type=int, default=900,
                   help="a worker still running after this many seconds dumps its stacks and exits")
    p.add_argument("--no_write", action="store_true")
    p.add_argument("--out_dir", default=str(RESULTS_DIR))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make_config(args: argparse.Namespace, schedule: str | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_batch_size": args.micro_batch * args.micro_batches,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                   "weight_decay": 0.01, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if schedule is not None:  # zerospeed's own keys (DeepSpeed's schema has no schedule choice)
        cfg["optimizer"]["params"].pop("torch_adam")
        cfg["pipeline"] = {"schedule": schedule,
                           "virtual_stages": args.virtual_stages if schedule == "interleaved_1f1b" else 1}
    return cfg


# --------------------------------------------------------------------------- worker side
class Block(torch.nn.Module):
    """One pipeline layer: tanh(Linear(dim, dim))."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _layers(args: argparse.Namespace, LayerSpec: Any) -> list[Any]:
    return [LayerSpec(Block, args.hidden) for _ in range(args.layers)]


def _batches(args: argparse.Namespace) -> list[list[tuple[Any, Any]]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [[(torch.randn(args.micro_batch, args.hidden, generator=g),
              torch.randn(args.micro_batch, args.hidden, generator=g))
             for _ in range(args.micro_batches)] for _ in range(args.warmup + args.steps)]


class _SavedBytes:
    """Bytes autograd saves for backward during one forward (parameters excluded, deduplicated)."""

    def __init__(self, params: set[int]) -> None:
        self.params, self.seen, self.total = params, set(), 0

    def pack(self, t: Any) -> Any:
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes())
        if key[0] not in self.params and key not in self.seen:
            self.seen.add(key)
            self.total += key[1]
        return t


def _instrument_deepspeed(engine: Any, stats: dict[str, Any]) -> None:
    """Time DeepSpeed's compute instructions and count their saved activations (per instance)."""
    from deepspeed.runtime.pipe import schedule as ds_schedule

    params = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    live: list[int] = []
    compute_kinds = (ds_schedule.ForwardPass, ds_schedule.BackwardPass)
    pipeline_kinds = compute_kinds + (ds_schedule.SendActivation, ds_schedule.RecvActivation,
                                      ds_schedule.SendGrad, ds_schedule.RecvGrad, ds_schedule.LoadMicroBatch)
    wrapped = {}
    for kind, fn in type(engine)._INSTRUCTION_MAP.items():
        def timed(self: Any, *a: Any, _fn: Any = fn, _kind: Any = kind, **kw: Any) -> Any:
            t0 = time.perf_counter()
            if _kind is ds_schedule.ForwardPass:
                counter = _SavedBytes(params)
                with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
                    out = _fn(self, *a, **kw)
                live.append(counter.total)
                stats["peak_activation_bytes"] = max(stats["peak_activation_bytes"], sum(live))
                stats["fwd_bytes"].append(counter.total)
            else:
                out = _fn(self, *a, **kw)
                if _kind is ds_schedule.BackwardPass and live:
                    live.pop(0)
            t1 = time.perf_counter()
            if _kind in compute_kinds:
                stats["compute_s"] += t1 - t0
                stats["per_kind"][_kind.__name__] = stats["per_kind"].get(_kind.__name__, 0.0) + t1 - t0
                stats["counts"][_kind.__name__] = stats["counts"].get(_kind.__name__, 0) + 1
            if _kind in pipeline_kinds:
                stats["last_end"] = t1
            return out
        wrapped[kind] = timed
    engine._INSTRUCTION_MAP = wrapped


def _build(system: str, args: argparse.Namespace) -> Any:
    """One engine for ``system`` (a zerospeed schedule, or 'deepspeed') over the same layers."""
    if system == "deepspeed":
        import deepspeed
        from deepspeed.pipe import LayerSpec, PipelineModule

        model = PipelineModule(_layers(args, LayerSpec), num_stages=args.num_procs,
                               loss_fn=torch.nn.functional.mse_loss, partition_method="uniform")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=make_config(args, None))
        return engine
    import zerospeed
    from zerospeed.pipe import LayerSpec, PipelineModule

    model = PipelineModule(_layers(args, LayerSpec), num_stages=args.num_procs,
                           loss_fn=torch.nn.functional.mse_loss, partition_method="uniform")
    engine, *_ = zerospeed.initialize(model=model, config=make_config(args, system))
    engine.enable_profiling(trace=True, memory=True)
    return engine


def _one_step(system: str, engine: Any, batches: list[Any]) -> dict[str, Any]:
    import torch.distributed as dist

    stats: dict[str, Any] = {"compute_s": 0.0, "last_end": 0.0, "peak_activation_bytes": 0,
                             "per_kind": {}, "counts": {}, "fwd_bytes": []}
    if system == "deepspeed":
        _instrument_deepspeed(engine, stats)
    else:
        engine.executor.peak_activation_bytes = 0
    reads = engine.is_first_stage() or engine.is_last_stage()
    dist.barrier()
    t0 = time.perf_counter()
    loss = engine.train_batch(iter(batches) if reads else None)
    t1 = time.perf_counter()
    if system != "deepspeed":
        trace = engine.executor.trace
        stats["last_end"] = trace[-1].end
        stats["peak_activation_bytes"] = engine.executor.peak_activation_bytes
        for t in trace:
            if t.action.kind.is_compute:
                name = t.action.kind.name
                stats["compute_s"] += t.end - t.start
                stats["per_kind"][name] = stats["per_kind"].get(name, 0.0) + t.end - t.start
                stats["counts"][name] = stats["counts"].get(name, 0) + 1
    return {"loss": float(loss), "step_s": t1 - t0, "schedule_s": stats["last_end"] - t0,
            "compute_s": stats["compute_s"], "peak_activation_bytes": stats["peak_activation_bytes"],
            "per_kind": stats["per_kind"], "counts": stats["counts"]}


def worker_main(args: argparse.Namespace) -> None:
    """All systems in one process group; steps go round-robin over the systems (rotating the order
    each step) so that every system sees the same machine load."""
    import faulthandler

    import torch.distributed as dist

    # a shared machine can stall a run (seen once in ~10 runs, during start-up): print every
    # thread's stack and exit instead of waiting forever
    faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    torch.set_num_threads(args.threads)
    systems = [s for s in args.systems.split(",") if s]
    if "deepspeed" in systems:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        import zerospeed

        zerospeed.init_distributed(dist_backend="gloo")
    engines = {}
    for system in systems:
        torch.manual_seed(0)
        engines[system] = _build(system, args)
    batches = _batches(args)
    records: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for i, step_batches in enumerate(batches):
        order = systems[i % len(systems):] + systems[:i % len(systems)]
        for system in order:
            record = _one_step(system, engines[system], step_batches)
            if i >= args.warmup:
                records[system].append(record)
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, records)
    if dist.get_rank() == 0 and args.result:
        Path(args.result).write_text(json.dumps(per_rank))
    dist.destroy_process_group()


# --------------------------------------------------------------------------- driver side
def launch(args: argparse.Namespace, systems: list[str], result: Path) -> int:
    cmd = [sys.executable, "-m", "zerospeed.launcher.runner", "--num_procs", str(args.num_procs),
           str(Path(__file__).resolve()), "--worker", "--systems", ",".join(systems), "--result", str(result)]
    for key in ("virtual_stages", "micro_batches", "micro_batch", "hidden", "layers", "steps", "warmup", "threads",
                "watchdog_s"):
        cmd += [f"--{key}", str(getattr(args, key))]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    env.setdefault("DS_ACCELERATOR", "cpu")
    print(f"[bench] {' '.join(cmd)}", flush=True)
    return subprocess.run(cmd, env=env, cwd=REPO).returncode


def theory(args: argparse.Namespace, schedule: str, costs: dict[str, float]) -> dict[str, Any]:
    """Textbook bubble, simulated bubble with measured costs, and stash depth per rank."""
    from zerospeed.pipe import ActionCosts, build_schedule, simulate

    p, m = args.num_procs, args.micro_batches
    v = args.virtual_stages if schedule == "interleaved_1f1b" else 1
    formula = {"gpipe": (p - 1) / (m + p - 1), "1f1b": (p - 1) / (m + p - 1),
               "interleaved_1f1b": (p - 1) / (v * m + p - 1), "zero_bubble": (p - 1) / (3 * m + p - 1)}[schedule]
    sched = build_schedule(schedule, num_stages=p * v, num_microbatches=m, num_ranks=p, virtual_stages_per_rank=v)
    f = costs.get("FORWARD", 1.0)
    measured = ActionCosts(forward=f, backward=costs.get("BACKWARD", 2 * f),
                           backward_input=costs.get("BACKWARD_INPUT", f), backward_weight=costs.get("BACKWARD_WEIGHT", f))
    sim = simulate(sched, measured)
    return {"formula": formula, "simulated": [sim.bubble_fraction[r] for r in range(p)],
            "stash_depth": [sim.peak_rank_activations[r] for r in range(p)]}


_TAG = {"FORWARD": "F", "BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
_DS_KINDS = {"ForwardPass": "FORWARD", "BackwardPass": "BACKWARD"}


def summarize(args: argparse.Namespace, system: str, per_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Per-step, per-rank records of one system -> medians, bubbles and theory."""
    num_steps = len(per_rank[0])
    step_s = statistics.median(max(r[i]["step_s"] for r in per_rank) for i in range(num_steps))
    bubbles = []
    for r in per_rank:
        values = []
        for i in range(num_steps):
            span = max(q[i]["schedule_s"] for q in per_rank)  # the step's schedule time: slowest rank
            values.append((span - r[i]["compute_s"]) / span)
        bubbles.append(statistics.median(values))
    totals: dict[str, list[float]] = {}
    for r in per_rank:
        for step in r:
            for kind, seconds in step["per_kind"].items():
                totals.setdefault(_DS_KINDS.get(kind, kind), []).append(seconds / step["counts"][kind])
    costs = {kind: statistics.mean(values) for kind, values in totals.items()}
    th = theory(args, "1f1b" if system == "deepspeed" else system, costs)
    return {"step_s": step_s, "bubbles": bubbles, "theory": th, "costs": costs,
            "peak_activation_bytes": [max(step["peak_activation_bytes"] for step in r) for r in per_rank],
            "final_loss": per_rank[-1][-1]["loss"]}


def row_for(system: str, summary: dict[str, Any], ds: dict[str, Any] | None) -> dict[str, Any]:
    th = summary["theory"]
    row: dict[str, Any] = {
        "system": "deepspeed PipelineEngine (1F1B)" if system == "deepspeed" else f"zerospeed {system}",
        "step_s": round(summary["step_s"], 4),
        "bubble_measured": " / ".join(f"{b:.3f}" for b in summary["bubbles"]),
        "bubble_formula": round(th["formula"], 3),
        "bubble_simulated": " / ".join(f"{b:.3f}" for b in th["simulated"]),
        "peak_act_per_rank": " / ".join(format_bytes(b) for b in summary["peak_activation_bytes"]),
        "stash_depth_theory": " / ".join(str(d) for d in th["stash_depth"]),
        "mean_costs_ms": ", ".join(f"{_TAG.get(k, k)}={v * 1e3:.1f}" for k, v in sorted(summary["costs"].items())),
        "final_loss": round(summary["final_loss"], 5),
    }
    if ds is not None and system != "deepspeed":
        row["step_vs_deepspeed"] = round(summary["step_s"] / ds["step_s"], 3)
    return row


def driver_main(args: argparse.Namespace) -> None:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SCHEDULES and s != "deepspeed"]
    if bad:
        sys.exit(f"--systems: unknown {bad}; choose from {', '.join(SCHEDULES)}, deepspeed")
    skipped = []
    if "deepspeed" in systems and package_version("deepspeed") is None:
        systems.remove("deepspeed")
        skipped.append({"system": "deepspeed PipelineEngine", "status": "skipped",
                        "note": "deepspeed not installed (run in .venv-bench: make bench-env)"})
    with tempfile.TemporaryDirectory(prefix="zs-pipe-bench-") as tmp:
        result = Path(tmp) / "result.json"
        code = launch(args, systems, result)
        if code != 0 or not result.exists():
            sys.exit(f"[bench] workers failed (exit code {code})")
        per_rank = json.loads(result.read_text())
    summaries = {s: summarize(args, s, [r[s] for r in per_rank]) for s in systems}
    ds = summaries.get("deepspeed")
    rows = [row_for(s, summaries[s], ds) for s in systems] + skipped
    for row in rows:
        print("[bench] " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    if args.no_write:
        return
    params = {k: getattr(args, k) for k in ("num_procs", "virtual_stages", "micro_batches", "micro_batch",
                                            "hidden", "layers", "steps", "warmup", "threads")}
    notes = [
        "fp32, ZeRO 0, torch AdamW (lr 1e-3) for both systems, clipping 1.0, uniform partition; every system "
        "runs in the same processes, steps round-robin over the systems so they share the machine's load",
        "step_s: median over timed steps of the slowest rank's train_batch time; each step starts after a barrier",
        "bubble_measured: per rank, median over steps of (schedule time - forward/backward compute) / schedule "
        "time; schedule time = slowest rank's time from the barrier to its last pipeline action (gradient "
        "reduction and optimizer step excluded, as in the theory)",
        "bubble_formula: (p-1)/(m+p-1) GPipe and 1F1B, (p-1)/(v m+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1 "
        "(F = I = W)",
        "bubble_simulated: zerospeed.pipe.simulate on the same schedule with this run's mean per-action costs "
        "(communication free)",
        "peak_act_per_rank: bytes saved for backward (params excluded) plus stashed stage inputs, alive at "
        "once, peak over a step",
        "stash_depth_theory: micro-batches alive at the peak per rank (interleaved: chunks of half the layers)",
        "mean_costs_ms: mean time of one forward (F), backward (B), input-backward (I), weight-backward (W) of "
        "one (virtual) stage; ZB-H1's first stage does its whole backward as W (it has no input gradient)",
    ]
    json_path, md_path = write_results("pipeline_bench", rows, params=params, notes=notes, out_dir=args.out_dir)
    print(f"[bench] wrote {json_path} and {md_path}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
    else:
        driver_main(args)


if __name__ == "__main__":
    main()
