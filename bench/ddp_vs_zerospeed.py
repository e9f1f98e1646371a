"""Training step time and memory: PyTorch DDP vs zerospeed vs DeepSpeed, same model, same data.

Run from the repository root (``make bench`` does it in the bench venv, which has DeepSpeed)::

    DS_ACCELERATOR=cpu .venv-bench/bin/python bench/ddp_vs_zerospeed.py --num_procs 2 --stage 2

The script is its own driver: for each system it launches ``--num_procs`` workers of itself
through the ``zerospeed`` launcher (torchrun underneath), one system at a time so that peak
memory per process belongs to one system only. Every worker builds ``gpt_bench()`` from the same
seed and takes the same precomputed batches (rank ``r`` of step ``i`` gets samples
``(i * world + r) * micro_batch ...``), so the three systems do identical math up to the
optimizer kernel and reduction order; their final losses are reported as a sanity check.

Measured per system: median step time over ``--steps`` steps after ``--warmup`` (a barrier
before each step), tokens/s across all ranks, peak RSS per rank, and ratios to DDP. Results go to
``bench/results/ddp_vs_zerospeed-<date>.{json,md}``.

Fairness notes: all systems run fp32 with the same AdamW hyper-parameters, gradient clipping 1.0
and no gradient accumulation. DeepSpeed on CPU uses its own C++ fused Adam unless
``--ds_torch_adam`` asks it for ``torch.optim.AdamW``; DDP and zerospeed use torch's AdamW.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "bench"))

from common import (  # noqa: E402
    RESULTS_DIR,
    format_bytes,
    launch_workers,
    package_version,
    peak_rss_bytes,
    time_steps,
    write_results,
)

SYSTEMS = ("ddp", "fsdp2", "zerospeed", "deepspeed")
StepFn = Callable[[int], float]  # step index -> loss of that step (a Python float)
ConfigFn = Callable[[argparse.Namespace, int], dict[str, Any]]  # (args, world size) -> DeepSpeed config
PHASES = ("forward", "backward", "step")


# --------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="ddp,zerospeed,deepspeed",
                   help="comma-separated subset of " + ", ".join(SYSTEMS) + " (fsdp2 is the stage-3 peer)")
    p.add_argument("--num_procs", type=int, default=2, help="data-parallel processes")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--rounds", type=int, default=2,
                   help="run the whole sequence of systems this many times and keep each system's best "
                        "round, so a burst of load from elsewhere cannot decide a ratio")
    p.add_argument("--micro_batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--stages", default="0,1,2",
                   help="comma-separated ZeRO stages to run zerospeed and DeepSpeed at (DDP runs once)")
    p.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3), help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--model", choices=("bench", "small"), default="bench",
                   help="gpt_bench() (~14M params) or gpt_small() (~1.8M, for a quick check)")
    p.add_argument("--ds_torch_adam", action="store_true",
                   help="make DeepSpeed use torch.optim.AdamW instead of its fused CPU Adam")
    p.add_argument("--no_write", action="store_true", help="print only, write no result files")
    p.add_argument("--out_dir", default=str(RESULTS_DIR), help="where result files go")
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def ds_config(args: argparse.Namespace, world_size: int) -> dict[str, Any]:
    """The DeepSpeed-format config given to both zerospeed and DeepSpeed."""
    adam_params: dict[str, Any] = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                   "weight_decay": 0.01}
    if args.ds_torch_adam:
        adam_params["torch_adam"] = True
    return {
        "train_batch_size": args.micro_batch * world_size,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": adam_params},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": False},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


# --------------------------------------------------------------------------- worker side


def _model_and_batches(args: argparse.Namespace, rank: int, world_size: int, device: Any):
    import torch
    from data import SyntheticTextDataset
    from gpt_model import GPT, gpt_bench, gpt_small

    cfg = gpt_bench() if args.model == "bench" else gpt_small()
    torch.manual_seed(0)
    model = GPT(cfg)
    num_steps = args.warmup + args.steps
    data = SyntheticTextDataset(cfg.seq_len, num_steps * world_size * args.micro_batch, seed=0)
    batches = []
    for step in range(num_steps):
        first = (step * world_size + rank) * args.micro_batch
        samples = [data[i] for i in range(first, first + args.micro_batch)]
        x = torch.stack([s[0] for s in samples]).to(device)
        y = torch.stack([s[1] for s in samples]).to(device)
        batches.append((x, y))
    return model, cfg, batches


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_ddp(args: argparse.Namespace, model, batches, device) -> StepFn:
    """Plain torch DDP + torch.optim.AdamW: the baseline a user already has."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = model.to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.01)

    def step(i: int) -> float:
        x, y = batches[i]
        loss = ddp(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        return loss.item()

    return step


def run_zerospeed(args: argparse.Namespace, model, batches, device, config_fn: ConfigFn = ds_config,
                  breakdown: bool = False) -> StepFn:
    """zerospeed through its DeepSpeed-compatible facade.

    The same script a DeepSpeed user runs, with the import changed.
    """
    import torch.distributed as dist

    import zerospeed

    cfg = config_fn(args, dist.get_world_size())
    engine, _opt, _loader, _sched = zerospeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    step = _engine_step_fn(engine, batches, device, breakdown)
    step.model_state_bytes = lambda: engine.memory_breakdown()["total"]  # type: ignore[attr-defined]
    return step


def _engine_step_fn(engine: Any, batches: list[Any], device: Any, breakdown: bool = False) -> StepFn:
    """One training step of a DeepSpeed-API engine (zerospeed's or DeepSpeed's: the same calls).

    With ``breakdown`` the step also appends the seconds of its forward, backward and optimizer
    step to ``step.phase_s[phase]`` (on a GPU at the price of a synchronisation after each).
    """
    phase_s: dict[str, list[float]] = {p: [] for p in PHASES}

    def lap(phase: str, start: float) -> float:
        if breakdown:
            _sync(device)
            now = time.perf_counter()
            phase_s[phase].append(now - start)
            return now
        return start

    def step(i: int) -> float:
        x, y = batches[i]
        t = time.perf_counter()
        loss = engine(x, y)
        t = lap("forward", t)
        engine.backward(loss)
        t = lap("backward", t)
        engine.step()
        lap("step", t)
        _sync(device)
        return loss.item()

    if breakdown:
        step.phase_s = phase_s  # type: ignore[attr-defined]
    return step


def run_deepspeed(args: argparse.Namespace, model, batches, device, config_fn: ConfigFn = ds_config,
                  breakdown: bool = False) -> StepFn:
    """DeepSpeed itself, as a user would call it (needs the bench venv; DS_ACCELERATOR=cpu)."""
    import deepspeed
    import torch.distributed as dist

    cfg = config_fn(args, dist.get_world_size())
    engine, _opt, _loader, _sched = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    return _engine_step_fn(engine, batches, device, breakdown)


def run_fsdp2(args: argparse.Namespace, model, batches, device) -> StepFn:
    """PyTorch FSDP2: ``fully_shard`` on every transformer block, then on the root (the
    documented recipe), torch's AdamW over the DTensor parameters. Fully sharded, like ZeRO-3."""
    import torch
    from torch.distributed.fsdp import fully_shard

    model = model.to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)

    def step(i: int) -> float:
        x, y = batches[i]
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        return loss.item()

    return step


RUNNERS: dict[str, Callable[..., StepFn]] = {
    "ddp": run_ddp, "fsdp2": run_fsdp2, "zerospeed": run_zerospeed, "deepspeed": run_deepspeed,
}


def worker_main(args: argparse.Namespace, config_fn: ConfigFn | None = None, breakdown: bool = False) -> None:
    """One worker of system ``args.worker``: build, time ``args.steps`` steps, rank 0 writes
    ``args.result``. ``config_fn`` (engine systems only) replaces :func:`ds_config`;
    ``breakdown`` records the median forward / backward / optimizer-step seconds per rank."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if args.worker == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    else:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    model, model_cfg, batches = _model_and_batches(args, rank, world_size, device)
    num_params = model.num_parameters()
    record: dict[str, Any]
    engine_kw: dict[str, Any] = {}
    if args.worker in ("zerospeed", "deepspeed"):
        engine_kw = {"config_fn": config_fn or ds_config, "breakdown": breakdown}
    try:
        step_fn = RUNNERS[args.worker](args, model, batches, device, **engine_kw)
    except NotImplementedError as e:
        record = {"status": "not implemented", "reason": str(e)}
    else:
        losses: list[float] = []
        timing = time_steps(lambda i: losses.append(step_fn(i)), args.steps, args.warmup,
                            barrier=dist.barrier)
        phase_s = getattr(step_fn, "phase_s", None)
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, {
            "median_s": timing.median_s,
            "peak_rss_bytes": peak_rss_bytes(),
            "phase_median_s": {p: statistics.median(v[args.warmup:]) for p, v in phase_s.items()}
            if phase_s else None,
        })
        record = {
            "status": "ok",
            "num_params": num_params,
            "tokens_per_step": world_size * args.micro_batch * model_cfg.seq_len,
            "timing": timing.as_dict(),
            "median_s_per_rank": [r["median_s"] for r in per_rank],
            "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in per_rank],
            "losses": losses,
        }
        if phase_s:
            record["phase_median_s_per_rank"] = [r["phase_median_s"] for r in per_rank]
        if hasattr(step_fn, "model_state_bytes"):
            record["model_state_bytes"] = step_fn.model_state_bytes()
    if rank == 0 and args.result:
        Path(args.result).write_text(json.dumps(record))
    # tear down together: a rank that destroys its gloo group while a peer is still working on it
    # was seen aborting at exit ("terminate called without an active exception"), both systems alike
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- driver side


def worker_args(args: argparse.Namespace, system: str, result_path: Path) -> list[str]:
    """The arguments of one worker of ``system`` (those :func:`_model_and_batches` and the
    runners read; a benchmark that reuses this worker adds its own)."""
    cmd = ["--worker", system, "--result", str(result_path),
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--micro_batch", str(args.micro_batch), "--stage", str(args.stage),
           "--threads", str(args.threads), "--model", args.model]
    if args.ds_torch_adam:
        cmd.append("--ds_torch_adam")
    return cmd


def worker_env(threads: int) -> dict[str, str]:
    """This environment with ``OMP_NUM_THREADS`` = ``threads`` and ``DS_ACCELERATOR`` set."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.setdefault("DS_ACCELERATOR", "cpu" if not _has_cuda() else "cuda")
    return env


def launch(args: argparse.Namespace, system: str, result_path: Path) -> int:
    """Run ``--num_procs`` workers for ``system`` via the zerospeed launcher; returns exit code."""
    return launch_workers(Path(__file__).resolve(), worker_args(args, system, result_path),
                          num_procs=args.num_procs, env=worker_env(args.threads)).returncode


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _row(system: str, rec: dict[str, Any], baseline: dict[str, Any] | None,
         deepspeed: dict[str, Any] | None = None, fsdp2: dict[str, Any] | None = None) -> dict[str, Any]:
    if rec.get("status") != "ok":
        return {"system": system, "status": rec.get("status"), "note": rec.get("reason", "")}
    median = max(rec["median_s_per_rank"])  # the step is as slow as its slowest rank
    peak = max(rec["peak_rss_bytes_per_rank"])
    row: dict[str, Any] = {
        "system": system,
        "status": "ok",
        "step_s_median": median,
        "tokens_per_s": rec["tokens_per_step"] / median,
        "peak_rss_max_rank": format_bytes(peak),
        "final_loss": rec["losses"][-1],
    }
    if baseline is not None and baseline.get("status") == "ok":
        row["time_vs_ddp"] = median / max(baseline["median_s_per_rank"])
        row["rss_vs_ddp"] = peak / max(baseline["peak_rss_bytes_per_rank"])
    if deepspeed is not None and deepspeed.get("status") == "ok" and deepspeed is not rec:
        row["time_vs_deepspeed"] = median / max(deepspeed["median_s_per_rank"])
        row["rss_vs_deepspeed"] = peak / max(deepspeed["peak_rss_bytes_per_rank"])
    if fsdp2 is not None and fsdp2.get("status") == "ok" and fsdp2 is not rec:
        row["time_vs_fsdp2"] = median / max(fsdp2["median_s_per_rank"])
        row["rss_vs_fsdp2"] = peak / max(fsdp2["peak_rss_bytes_per_rank"])
    if "model_state_bytes" in rec:
        row["model_state_rank0"] = format_bytes(rec["model_state_bytes"])
    return row


def driver_main(args: argparse.Namespace) -> None:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        sys.exit(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    stages = [int(x) for x in args.stages.split(",") if x.strip()]
    runs = [(s, None) for s in ("ddp", "fsdp2") if s in systems]
    runs += [(system, stage) for stage in stages for system in systems if system not in ("ddp", "fsdp2")]
    records: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="zs-bench-") as tmp:
        for round_index in range(args.rounds):
            for system, stage in runs:
                name = system if stage is None else f"{system}-z{stage}"
                if system == "deepspeed" and package_version("deepspeed") is None:
                    records[name] = {"status": "skipped",
                                     "reason": "deepspeed not installed (use make bench-env)"}
                    continue
                if stage is not None:
                    args.stage = stage
                result_path = Path(tmp) / f"{name}-{round_index}.json"
                code = launch(args, system, result_path)
                if code != 0 or not result_path.exists():
                    records.setdefault(name, {"status": "failed", "reason": f"exit code {code}"})
                    continue
                rec = json.loads(result_path.read_text())
                best = records.get(name)
                if best is None or best.get("status") != "ok" or (
                        rec.get("status") == "ok" and max(rec["median_s_per_rank"]) < max(best["median_s_per_rank"])):
                    records[name] = rec
    baseline = records.get("ddp")
    rows = []
    for name, rec in records.items():
        stage_tag = name.rsplit("-", 1)[1] if "-z" in name else None
        rows.append(_row(name, rec, baseline, records.get(f"deepspeed-{stage_tag}") if stage_tag else None,
                         records.get("fsdp2") if stage_tag == "z3" else None))
    for row in rows:
        print("[bench] " + "  ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if args.no_write:
        return
    params = {k: getattr(args, k) for k in ("num_procs", "steps", "warmup", "rounds", "micro_batch",
                                            "stages", "threads", "model", "ds_torch_adam")}
    ok = [r for r in records.values() if r.get("status") == "ok"]
    if ok:
        params["num_params"] = ok[0]["num_params"]
    notes = ["fp32, AdamW(lr=1e-3, betas=(0.9, 0.95), wd=0.01), clip 1.0, no accumulation",
             "step time = max over ranks of each rank's median step time; best of --rounds rounds per system",
             "the machine is shared: compare ratios within this file, not across files"]
    json_path, md_path = write_results("ddp_vs_zerospeed", rows, params=params, notes=notes,
                                       out_dir=args.out_dir)
    print(f"[bench] wrote {json_path} and {md_path}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
    else:
        driver_main(args)


if __name__ == "__main__":
    main()
