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
import re
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]

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


def _bench_env_version(name: str) -> str | None:
    """Version of ``name`` in the DeepSpeed bench environment (``make bench-env``: .venv-bench beside this
    repository's src/), which the side-by-side benches run DeepSpeed from; None if it is not there."""
    root = REPO / ".venv-bench"
    for site in sorted(root.glob("lib/python*/site-packages")):
        for dist in importlib.metadata.distributions(path=[str(site)]):
            if (dist.metadata["Name"] or "").lower() == name:
                return f"{dist.version} (.venv-bench)"
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
        "deepspeed": package_version("deepspeed") or _bench_env_version("deepspeed"),
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


# --------------------------------------------------------------------------- launching workers


@dataclass(frozen=True)
class Launched:
    """How a group of workers ended: exit status (124 on timeout), the output's last lines, and
    the last exception line found in it (``"ValueError: ..."``), if any."""

    returncode: int
    output_tail: tuple[str, ...]
    error: str | None


# ``[rank0]: RuntimeError: msg`` / ``ValueError: msg`` / ``deepspeed.x.FooError: msg``; torchrun's own
# summary exception (ChildFailedError) names no cause, so it is never taken as the error.
_ERROR_LINE = re.compile(r"^(?:\[(?:rank|default)\d+\]:\s*)?([\w.]*(?:Error|Exception|Interrupt)(?::\s.*|:?))$")


# What a worker that dies in native code leaves instead (std::terminate, a signal).
_NATIVE_CRASH = re.compile(r"^(terminate called .*|Segmentation fault.*|Fatal Python error: .*|"
                           r"exitcode\s*: -\d+ .*\((SIG\w+)\))$")


def last_error(lines: Iterable[str]) -> str | None:
    """The last line of ``lines`` that reads like a raised exception (``SomeError: message``);
    failing that, the native crash lines (``terminate called ...``, the signal torchrun reports)."""
    found = None
    crash: list[str] = []
    for line in lines:
        m = _ERROR_LINE.match(line.strip())
        if m and "ChildFailedError" not in m.group(1):
            found = m.group(1).strip()
        c = _NATIVE_CRASH.match(line.strip())
        if c:
            text = c.group(2) or c.group(1)
            if text not in crash:
                crash.append(text)
    return found or ("; ".join(crash) if crash else None)


def launch_workers(
    script: Path | str,
    script_args: Sequence[str],
    *,
    num_procs: int,
    python: str | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
    tail_lines: int = 200,
) -> Launched:
    """Run ``num_procs`` workers of ``script`` through the ``zerospeed`` launcher (torchrun).

    Output (stdout and stderr together) is echoed as it comes and its last ``tail_lines`` lines
    are kept, so a failing worker's exception can be reported. ``python`` is the interpreter
    (default: this one); ``env`` the full environment (default: this one). On ``timeout_s`` the
    whole process group is killed and the exit status is 124.
    """
    cmd = [python or sys.executable, "-m", "zerospeed.launcher.runner", "--num_procs", str(num_procs),
           str(script), *script_args]
    print(f"[bench] {shlex.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout_s, kill) if timeout_s else None
    if timer is not None:
        timer.start()
    tail: deque[str] = deque(maxlen=tail_lines)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            tail.append(line.rstrip("\n"))
        code = proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
    if timed_out.is_set():
        code = 124
        tail.append(f"TimeoutError: workers killed after {timeout_s:g} s")
    sys.stdout.flush()
    return Launched(code, tuple(tail), last_error(tail))


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
    versions, load average when written, exact command and benchmark parameters. Returns the two paths.
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
        # how busy the machine was as the results were written (1, 5 and 15 min): a figure taken beside other
        # jobs reads differently from one taken on a quiet machine
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
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
        f"zerospeed {machine['zerospeed']}, deepspeed {machine['deepspeed'] or 'not installed'}",
        "- load average (1, 5, 15 min) when written: "
        + (", ".join(f"{x:.2f}" for x in record["load_average"]) if record["load_average"] else "unknown"),
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
