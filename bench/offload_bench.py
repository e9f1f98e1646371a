"""End-to-end training step with the optimizer offloaded (CPU or NVMe): zerospeed vs DeepSpeed.

Run from the repository root (DeepSpeed workers need the bench venv, see ``bench/README.md``)::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR=$PWD/.venv-bench/torch_extensions \\
        .venv-bench/bin/python bench/offload_bench.py --stages 2,3 --devices none,cpu,nvme

For every ZeRO stage in ``--stages`` and every ``zero_optimization.offload_optimizer.device`` in
``--devices`` (``none`` is the baseline without offload; ``nvme`` gets a fresh directory under
``--nvme_dir`` as ``nvme_path`` and the ``aio`` defaults), each system in ``--systems`` trains
``gpt_bench()`` (~14.3M params) on ``--num_procs`` processes with the worker of
``ddp_vs_zerospeed.py``: same seed, same precomputed batches, fp32, ``"optimizer": {"type":
"AdamW"}`` from the config (DeepSpeed then uses its DeepSpeedCPUAdam under offload), clipping 1.0.
One system and configuration at a time, so peak RSS belongs to it; configurations are run in the
order stage, device, system (the systems' order reversed every other round), and the whole
sequence ``--rounds`` times, keeping each row's best.

Measured per row: median step time after ``--warmup`` (max over ranks) and its forward /
backward / optimizer-step medians, peak RSS per rank, the final loss on rank 0 (the same data on
both systems, so the losses show parity), the bytes found under ``nvme_path`` after the run, and
the ratios zerospeed/DeepSpeed and offload/no-offload. A configuration a system refuses or fails
is kept as a row with its exception line, also in the notes of
``bench/results/offload_bench-<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import ddp_vs_zerospeed as dvz  # noqa: E402
from common import RESULTS_DIR, format_bytes, launch_workers, package_version, write_results  # noqa: E402

SYSTEMS = ("zerospeed", "deepspeed")
DEVICES = ("none", "cpu", "nvme", "infinity")
#: ``infinity``: ZeRO-Infinity, optimizer states *and* (stage 3 only) parameters on NVMe
NVME_DEVICES = ("nvme", "infinity")
# DeepSpeed's ``aio`` defaults (runtime/swap_tensor/constants.py), written out so both systems
# read the same block; zerospeed takes ``intra_op_parallelism`` as its ``thread_count``.
AIO_DEFAULTS = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
                "single_submit": False, "overlap_events": True, "use_gds": False}
LOSS_TOLERANCE = 1e-3  # relative difference of final losses above which a row is noted as training differently
BENCH_VENV_PYTHON = REPO / ".venv-bench" / "bin" / "python"
BENCH_EXTENSIONS = REPO / ".venv-bench" / "torch_extensions"


# --------------------------------------------------------------------------- arguments


def _csv(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in items if x not in allowed]
    if unknown or not items:
        sys.exit(f"{flag}: {unknown or 'empty'}; choose from {', '.join(allowed)}")
    return items


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ", ".join(SYSTEMS))
    p.add_argument("--stages", default="2,3", help="comma-separated ZeRO stages (1-3)")
    p.add_argument("--devices", default=",".join(DEVICES),
                   help="comma-separated offload_optimizer devices; none = the no-offload baseline; "
                        "infinity = optimizer states and (stage 3) parameters on NVMe")
    p.add_argument("--num_procs", type=int, default=2, help="data-parallel processes")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the whole sequence this many times and keep each row's best round")
    p.add_argument("--micro_batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--model", choices=("bench", "small"), default="bench",
                   help="gpt_bench() (~14M params) or gpt_small() (~1.8M, for a quick check)")
    p.add_argument("--nvme_dir", default=tempfile.gettempdir(),
                   help="a fresh nvme_path is made under this directory for every nvme run")
    p.add_argument("--deepspeed_python", default=None,
                   help="interpreter of the DeepSpeed workers (default: this one if it has deepspeed, "
                        "else .venv-bench/bin/python)")
    p.add_argument("--zerospeed_python", default=None, help="interpreter of the zerospeed workers (default: this one)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds before one run's workers are killed")
    p.add_argument("--no_write", action="store_true", help="print only, write no result files")
    p.add_argument("--out_dir", default=str(RESULTS_DIR), help="where result files go")
    # worker side (the names ddp_vs_zerospeed's worker reads)
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--offload", choices=DEVICES, default="none", help=argparse.SUPPRESS)
    p.add_argument("--nvme_path", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.ds_torch_adam = False  # offload needs DeepSpeed's own CPU Adam
    return args


def offload_config(args: argparse.Namespace, world_size: int) -> dict[str, Any]:
    """``ddp_vs_zerospeed``'s config at ``args.stage`` plus ``offload_optimizer`` (and ``aio``)."""
    cfg = dvz.ds_config(args, world_size)
    if args.offload != "none":
        offload: dict[str, Any] = {"device": "cpu" if args.offload == "cpu" else "nvme"}
        if args.offload in NVME_DEVICES:
            offload["nvme_path"] = args.nvme_path
        cfg["zero_optimization"]["offload_optimizer"] = offload
        if args.offload == "infinity":
            cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": args.nvme_path}
        cfg["aio"] = dict(AIO_DEFAULTS)
    return cfg


# --------------------------------------------------------------------------- driver side


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


class _DirWatch:
    """Largest total size of the files under ``path`` seen while watching (polled every
    ``interval`` s): what a system swapped to ``nvme_path``, even if it deletes it at exit."""

    def __init__(self, path: str, interval: float = 0.5) -> None:
        self.path, self.interval, self.peak = path, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, _dir_bytes(self.path))
            if self._stop.wait(self.interval):
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _dir_bytes(self.path))
        return self.peak


def _pythons(args: argparse.Namespace) -> dict[str, str | None]:
    ds = args.deepspeed_python
    if ds is None:
        if package_version("deepspeed") is not None:
            ds = sys.executable
        elif BENCH_VENV_PYTHON.exists():
            ds = str(BENCH_VENV_PYTHON)
    return {"zerospeed": args.zerospeed_python or sys.executable, "deepspeed": ds}


def _env(args: argparse.Namespace) -> dict[str, str]:
    env = dvz.worker_env(args.threads)
    if BENCH_EXTENSIONS.is_dir():  # DeepSpeed's prebuilt cpu_adam / async_io ops
        env.setdefault("TORCH_EXTENSIONS_DIR", str(BENCH_EXTENSIONS))
    return env


def run_one(args: argparse.Namespace, system: str, python: str, env: dict[str, str], tmp: Path,
            name: str) -> dict[str, Any]:
    """Launch the workers of one row; returns its record (``status`` ok / failed)."""
    result_path = tmp / f"{name}.json"
    result_path.unlink(missing_ok=True)
    extra = ["--offload", args.offload]
    nvme_path = watch = None
    if args.offload in NVME_DEVICES:
        nvme_path = tempfile.mkdtemp(prefix=f"zs-offload-{name}-", dir=args.nvme_dir)
        extra += ["--nvme_path", nvme_path]
        watch = _DirWatch(nvme_path)
    try:
        launched = launch_workers(Path(__file__).resolve(), dvz.worker_args(args, system, result_path) + extra,
                                  num_procs=args.num_procs, python=python, env=env, timeout_s=args.timeout)
    finally:
        nvme_bytes = watch.stop() if watch else None
        if nvme_path:
            shutil.rmtree(nvme_path, ignore_errors=True)
    if not result_path.exists():
        return {"status": "failed", "reason": launched.error or f"exit code {launched.returncode}",
                "returncode": launched.returncode}
    rec = json.loads(result_path.read_text())
    if launched.returncode != 0:  # measured, then died (e.g. a native abort at shutdown)
        rec["exit"] = f"exit code {launched.returncode} after writing its result: {launched.error}"
        rec["exit_code"] = launched.returncode
    if nvme_bytes is not None:
        rec["nvme_bytes"] = nvme_bytes
    return rec


def _better(new: dict[str, Any], old: dict[str, Any] | None) -> bool:
    if old is None or old.get("status") != "ok":
        return True
    return new.get("status") == "ok" and max(new["median_s_per_rank"]) < max(old["median_s_per_rank"])


def _step_s(rec: dict[str, Any] | None) -> float | None:
    return max(rec["median_s_per_rank"]) if rec and rec.get("status") == "ok" else None


def _peak(rec: dict[str, Any] | None) -> int | None:
    return max(rec["peak_rss_bytes_per_rank"]) if rec and rec.get("status") == "ok" else None


def _loss_reference(key: tuple[str, int, str], systems: list[str]) -> tuple[str, int, str] | None:
    """The row whose losses ``key``'s must match: the same system and stage without offload; for
    a no-offload row, the other system's (zerospeed's is checked against DeepSpeed's)."""
    system, stage, device = key
    if device != "none":
        return (system, stage, "none")
    others = [s for s in systems if s != system]
    return (others[0], stage, "none") if system == "zerospeed" and others else None


def make_row(key: tuple[str, int, str], records: dict[tuple[str, int, str], dict[str, Any]]) -> dict[str, Any]:
    system, stage, device = key
    rec = records[key]
    status = rec.get("status")
    if rec.get("exit_code"):
        status = f"{status}, then exit code {rec['exit_code']}"
    row: dict[str, Any] = {"system": system, "stage": stage, "offload": device, "status": status}
    if rec.get("status") != "ok":
        row["error"] = rec.get("reason", "")
        return row
    step = _step_s(rec)
    row["step_s"] = step
    phases = rec.get("phase_median_s_per_rank")
    if phases:
        for phase, col in zip(dvz.PHASES, ("fwd_s", "bwd_s", "opt_s")):
            row[col] = max(p[phase] for p in phases)
    row["peak_rss_per_rank_MiB"] = " / ".join(f"{b / 2**20:.0f}" for b in rec["peak_rss_bytes_per_rank"])
    row["peak_rss_max"] = format_bytes(_peak(rec))
    row["final_loss"] = rec["losses"][-1]
    for label, other in (("deepspeed", records.get(("deepspeed", stage, device))),
                         ("no_offload", records.get((system, stage, "none")))):
        if other is rec or _step_s(other) is None:
            continue
        row[f"time_vs_{label}"] = step / _step_s(other)
        row[f"rss_vs_{label}"] = _peak(rec) / _peak(other)
        if label == "deepspeed":
            row["loss_minus_deepspeed"] = rec["losses"][-1] - other["losses"][-1]
    if "nvme_bytes" in rec:
        row["nvme_bytes"] = format_bytes(rec["nvme_bytes"])
    return row


def driver_main(args: argparse.Namespace) -> None:
    systems = _csv(args.systems, SYSTEMS, "--systems")
    devices = _csv(args.devices, DEVICES, "--devices")
    stages = [int(x) for x in _csv(args.stages, ("1", "2", "3"), "--stages")]
    pythons = _pythons(args)
    env = _env(args)
    records: dict[tuple[str, int, str], dict[str, Any]] = {}
    trouble: dict[tuple[str, int, str], list[str]] = {}  # every round's failure or exit problem
    with tempfile.TemporaryDirectory(prefix="zs-offload-bench-") as tmp:
        for round_index in range(args.rounds):
            for stage in stages:
                for device in devices:
                    for system in systems if round_index % 2 == 0 else systems[::-1]:
                        key = (system, stage, device)
                        if device == "infinity" and stage != 3:
                            continue  # parameters are partitioned (and so offloadable) at stage 3 only
                        if pythons[system] is None:
                            records[key] = {"status": "skipped",
                                            "reason": "deepspeed not installed (use make bench-env)"}
                            continue
                        args.stage, args.offload = stage, device
                        rec = run_one(args, system, pythons[system], env, Path(tmp),
                                      f"{system}-z{stage}-{device}")
                        if rec.get("status") != "ok" or rec.get("exit"):
                            trouble.setdefault(key, []).append(
                                f"round {round_index + 1}: {rec.get('exit') or rec.get('reason')}")
                        if _better(rec, records.get(key)):
                            records[key] = rec
    rows = [make_row(key, records) for key in records]
    for row in rows:
        print("[bench] " + "  ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    notes = [
        "fp32, optimizer from the config: AdamW(lr=1e-3, betas=(0.9, 0.95), wd=0.01), clip 1.0, no accumulation; "
        "DeepSpeed uses DeepSpeedCPUAdam when offloading and its fused CPU Adam otherwise",
        "step_s = max over ranks of each rank's median step time; fwd_s / bwd_s / opt_s likewise for "
        "engine(x, y) / engine.backward(loss) / engine.step(); best of --rounds rounds per row",
        f"nvme_path: a fresh directory under {args.nvme_dir} per run; aio block: {json.dumps(AIO_DEFAULTS)}; "
        "nvme_bytes = the most bytes seen under nvme_path during the run (polled every 0.5 s)",
        "final_loss = rank 0's loss of the last step (same seed and batches for every row)",
        "without a GPU the training device is the CPU: offload_optimizer=cpu moves no memory off the device, "
        "so the cpu rows measure the cost of the offload code path (CPU Adam, copies) and nvme rows add "
        "the swapping to disk",
        "the machine is shared: compare ratios within this file, not across files",
    ]
    for key, rec in records.items():
        system, stage, device = key
        ref_key = _loss_reference(key, systems)
        ref = records.get(ref_key) if ref_key else None
        if (rec.get("status") == "ok" and ref and ref.get("status") == "ok"
                and abs(rec["losses"][-1] - ref["losses"][-1]) > LOSS_TOLERANCE * abs(ref["losses"][-1])):
            notes.append(f"{system} ZeRO-{stage} offload={device} trained differently from {ref_key[0]} "
                         f"ZeRO-{stage} offload={ref_key[2]}: losses per step "
                         f"{', '.join(f'{x:.6g}' for x in rec['losses'])} vs "
                         f"{', '.join(f'{x:.6g}' for x in ref['losses'])}")
        if rec.get("status") == "skipped":
            notes.append(f"{system} ZeRO-{stage} offload={device} skipped: {rec.get('reason')}")
        if key in trouble:
            notes.append(f"{system} ZeRO-{stage} offload={device} failed or crashed in {len(trouble[key])} of "
                         f"{args.rounds} round(s): " + "; ".join(trouble[key]))
        if rec.get("status") == "ok" and device in NVME_DEVICES and rec.get("nvme_bytes") == 0:
            notes.append(f"{system} ZeRO-{stage} offload=nvme wrote nothing under nvme_path: its optimizer "
                         "state was not swapped to disk")
    if args.no_write:
        return
    params: dict[str, Any] = {k: getattr(args, k) for k in ("systems", "stages", "devices", "num_procs", "steps",
                                                             "warmup", "rounds", "micro_batch", "threads", "model")}
    ok = [r for r in records.values() if r.get("status") == "ok"]
    if ok:
        params["num_params"] = ok[0]["num_params"]
    params["worker_env"] = " ".join(f"{k}={env[k]}" for k in ("DS_ACCELERATOR", "OMP_NUM_THREADS",
                                                               "TORCH_EXTENSIONS_DIR") if k in env)
    params["pythons"] = ", ".join(f"{s}: {os.path.relpath(p, REPO) if p else None}" for s, p in pythons.items()
                                  if s in systems)
    json_path, md_path = write_results("offload_bench", rows, params=params, notes=notes, out_dir=args.out_dir)
    print(f"[bench] wrote {json_path} and {md_path}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        dvz.worker_main(args, config_fn=offload_config, breakdown=True)
    else:
        driver_main(args)


if __name__ == "__main__":
    main()
