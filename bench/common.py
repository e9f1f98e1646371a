"""Shared helpers for the benchmarks in ``bench/``: timing, memory, machine facts, result files.

Benchmarks are scripts, not tests: they measure, side by side in one run, what zerospeed exists
for against what a user would pick instead, and write what they measured to ``bench/results/`` as
JSON (for tools) and Markdown (for people), each with the date, the machine, the library versions
and the exact command, so a number can always be traced to how it was produced.

Nothing here imports deepspeed or zerospeed; versions are read from package metadata.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Environment variables that change what a benchmark measures; recorded with the command.
RELEVANT_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR",
                "CUDA_VISIBLE_DEVICES", "TORCH_NUM_THREADS")


# --------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of the measured steps (warmup steps excluded)."""

    median_s: float
    mean_s: float
    min_s: float
    max_s: float
    num_steps: int
    num_warmup: int
    steps_s: tuple[float, ...]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["steps_s"] = list(self.steps_s)
        return d


def time_steps(
    step_fn: Callable[[int], Any],
    num_steps: int,
    num_warmup: int = 3,
    barrier: Callable[[], Any] | None = None,
) -> Timing:
    """Run ``step_fn(i)`` for ``num_warmup + num_steps`` steps; time the last ``num_steps``.

    ``barrier`` (e.g. ``torch.distributed.barrier``) is called before each step so that every
    rank starts a step together and a step time is not polluted by waiting for a slow peer's
    previous step. On a GPU, ``step_fn`` must synchronise the device itself before returning.
    The median is the headline number: it ignores the odd step slowed by a neighbour process.
    """
    if num_steps < 1 or num_warmup < 0:
        raise ValueError(f"need num_steps >= 1 and num_warmup >= 0, got {num_steps}, {num_warmup}")
    times: list[float] = []
    for i in range(num_warmup + num_steps):
        if barrier is not None:
            barrier()
        start = time.perf_counter()
        step_fn(i)
        elapsed = time.perf_counter() - start
        if i >= num_warmup:
            times.append(elapsed)
    return Timing(
        median_s=statistics.median(times),
        mean_s=statistics.fmean(times),
        min_s=min(times),
        max_s=max(times),
        num_steps=num_steps,
        num_warmup=num_warmup,
        steps_s=tuple(times),
    )


# --------------------------------------------------------------------------- memory


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (``getrusage``; KiB on Linux, B on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def current_rss_bytes() -> int:
    """Resident set size of this process now (from ``/proc``; falls back to the peak)."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def format_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- machine facts


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _total_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def package_version(name: str) -> str | None:
    """Installed version of distribution ``name``, or None (never imports the package)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """The facts a reader needs to compare two result files: CPU, cores, memory, versions, GPU."""
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": _total_memory_bytes(),
        "python": platform.python_version(),
        "torch": package_version("torch"),
        "zerospeed": package_version("zerospeed"),
        "deepspeed": package_version("deepspeed"),
    }
    try:
        import torch

        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    return info


def command_line(argv: Sequence[str] | None = None) -> str:
    """The exact command that produced a result, with the environment variables that matter."""
    argv = list(sys.argv if argv is None else argv)
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in RELEVANT_ENV if k in os.environ]
    exe = os.path.relpath(sys.executable)
    exe = sys.executable if exe.startswith("..") else exe  # relative only inside the working dir
    return " ".join([*env, shlex.join([exe, *argv])])


# --------------------------------------------------------------------------- result files


def _markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "" if value is None else str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_results(
    name: str,
    rows: Sequence[dict[str, Any]],
    *,
    params: dict[str, Any] | None = None,
    notes: Iterable[str] = (),
    command: str | None = None,
    out_dir: Path | str = RESULTS_DIR,
) -> tuple[Path, Path]:
    """Write ``rows`` (one flat dict per measured configuration) as JSON and Markdown.

    Files are ``<out_dir>/<name>-<UTC timestamp>.json`` and ``.md``; both hold the date, machine,
    versions, exact command and benchmark parameters. Returns the two paths.
    """
    now = _dt.datetime.now(_dt.timezone.utc)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{name}-{now.strftime('%Y%m%d-%H%M%S')}"
    record = {
        "benchmark": name,
        "date_utc": now.isoformat(timespec="seconds"),
        "command": command or command_line(),
        "machine": machine_info(),
        "params": params or {},
        "results": list(rows),
        "notes": list(notes),
    }
    json_path = stem.with_suffix(".json")
    json_path.write_text(json.dumps(record, indent=2, default=str) + "\n")

    machine = record["machine"]
    md = [
        f"# {name}",
        "",
        f"- date (UTC): {record['date_utc']}",
        f"- machine: {machine['cpu_model']}, {machine['usable_cores']} usable / "
        f"{machine['logical_cores']} logical cores, "
        f"{format_bytes(machine['memory_bytes'] or 0)} RAM"
        + (f", GPUs: {', '.join(machine['gpus'])}" if machine.get("gpus") else ""),
        f"- versions: python {machine['python']}, torch {machine['torch']}, "
        f"zerospeed {machine['zerospeed']}, deepspeed {machine['deepspeed']}",
        "- command:",
        "",
        "```",
        record["command"],
        "```",
        "",
    ]
    if record["params"]:
        md += ["## Parameters", "", _markdown_table([record["params"]]), ""]
    md += ["## Results", "", _markdown_table(record["results"]) if rows else "(none)", ""]
    if record["notes"]:
        md += ["## Notes", "", *[f"- {n}" for n in record["notes"]], ""]
    md_path = stem.with_suffix(".md")
    md_path.write_text("\n".join(md))
    return json_path, md_path
