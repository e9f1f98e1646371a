"""Offload ops: CPU Adam throughput and async-I/O bandwidth, against what a user would pick instead.

**CPU Adam** (one flat fp32 parameter of ``--numel`` elements, its gradient set once, AdamW
lr 1e-3 wd 0.01; all systems hold their own buffers and are stepped round-robin, so a burst of
load from other jobs hits them alike; ``--warmup`` steps, then the median of ``--repeats``):

* ``zerospeed CPUAdam`` (default threads = ``torch.get_num_threads()``; and ``num_threads=1``),
* ``torch AdamW fused=True`` and ``foreach=True``,
* ``DeepSpeedCPUAdam`` when ``deepspeed`` imports and its ``cpu_adam`` op builds/loads.

Throughput is parameters/s and effective GB/s at 28 bytes per element (read param, grad,
exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq; fp32), next to the machine's memory
bandwidth measured the same way and in the same rounds: ``copy_`` of ``--numel`` x 4 bytes
(counting read + write) and an in-place ``add_`` (3 streams, like Adam's in-place updates), each
as one OpenMP-parallel call and as chunks on worker threads; the best of these in a round is that
round's roofline. Ratios (``pct_of_roofline``, ``speedup_vs_*``) are medians of per-round ratios,
which cancels most of the load that other jobs put on this shared 2-core machine.

This section runs in a subprocess with ``--bench_python`` (default ``.venv-bench/bin/python``,
where DeepSpeed is installed; zerospeed is installed editable there too) and ``DS_ACCELERATOR=cpu``
plus ``TORCH_EXTENSIONS_DIR=.venv-bench/torch_extensions`` so the prebuilt ops are found.

**Async I/O** (``--aio_mib`` MiB per request, files in a fresh directory under ``--aio_dir``,
written fresh each time: the file is deleted before every write; round-robin over systems, the
order rotated each repetition; median of ``--aio_repeats``):

* ``dd if=/dev/zero of=F bs=1M count=N oflag=direct`` / ``dd if=F of=/dev/null bs=1M iflag=direct``
  (time as reported by dd),
* ``zerospeed AsyncIOHandle`` with the ``aio`` defaults (1 MiB blocks, queue_depth 8,
  thread_count 1) on an aligned buffer (``new_aligned_tensor``: O_DIRECT straight into it) and on
  an ordinary ``torch.empty`` buffer (64-byte aligned: O_DIRECT through the bounce buffers),
* DeepSpeed's ``aio_handle`` (same settings, ``new_cpu_locked_tensor`` buffer) when the
  ``async_io`` op builds (needs ``libaio-dev``), in a worker process of ``--bench_python``,
* a raw io_uring loop (1 MiB readv/writev, 8 in flight, O_DIRECT, zero-copy) when
  ``--uring_python`` names a Python with the PyPI ``liburing`` binding: the evidence for or
  against an io_uring backend.

Before each read the page cache is dropped (``echo 3 > /proc/sys/vm/drop_caches``, root only;
whether it worked is recorded); all reads are O_DIRECT anyway.

Usage::

    .venv/bin/python bench/offload_ops_bench.py                  # everything, writes results
    .venv/bin/python bench/offload_ops_bench.py --sections aio --aio_mib 256 --repeats 3 --no_write
    .venv/bin/python bench/offload_ops_bench.py --uring_python /path/to/venv-with-liburing/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

ADAM_BYTES_PER_ELEMENT = 28
_MARK = "@@zerospeed-bench "  # worker answers start with this; other output (library logs) is skipped


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


# =========================================================================== CPU Adam worker


def _chunked(fn, tensors, num_threads: int, chunk: int = 4 << 20) -> None:
    """Run ``fn(*chunk_views)`` over ``chunk``-element pieces on the zerospeed Adam pool threads."""
    from zerospeed.ops.adam import AdamThreadPool

    pool = AdamThreadPool.shared(num_threads)
    n = tensors[0].numel()
    pieces = [[t[s:s + chunk] for t in tensors] for s in range(0, n, chunk)]
    if pool._executor is None:
        for p in pieces:
            fn(*p)
        return
    lock, cursor = threading.Lock(), [0]

    def worker() -> None:
        while True:
            with lock:
                i = cursor[0]
                cursor[0] += 1
            if i >= len(pieces):
                return
            fn(*pieces[i])

    for f in [pool._executor.submit(worker) for _ in range(pool.num_workers)]:
        f.result()


def _paired(times: dict[str, list[float]], num: str, den: str) -> float:
    """Median over rounds of ``times[num][i] / times[den][i]`` (both ran in round ``i``)."""
    return statistics.median(a / b for a, b in zip(times[num], times[den]))


def adam_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from zerospeed.ops.adam import CPUAdam

    torch.manual_seed(0)
    n = args.numel
    threads = torch.get_num_threads()
    notes: list[str] = [f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
                        f"{threads} intra-op threads, load at start {_loadavg()}"]

    # Memory-bandwidth cases: bytes per element counted, run in the same rounds as the optimizers.
    src, dst = torch.randn(n), torch.randn(n)
    bandwidth_cases = {
        "copy_ (r+w), one call": (lambda: dst.copy_(src), 8),
        "copy_ (r+w), chunked threads": (lambda: _chunked(lambda d, s: d.copy_(s), [dst, src], threads), 8),
        "add_ in place (3 streams), one call": (lambda: dst.add_(src, alpha=1e-9), 12),
        "add_ in place (3 streams), chunked threads":
            (lambda: _chunked(lambda d, s: d.add_(s, alpha=1e-9), [dst, src], threads), 12),
    }
    base = torch.randn(n)
    grad = torch.randn(n) * 1e-2
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    systems: dict[str, Any] = {}

    def add(name: str, make) -> None:
        p = base.clone().requires_grad_()
        p.grad = grad.clone()
        try:
            systems[name] = (p, make([p]))
        except Exception as exc:  # noqa: BLE001 - report, do not fail the run
            notes.append(f"{name}: not measured ({type(exc).__name__}: {str(exc)[:200]})")

    add("zerospeed CPUAdam", lambda ps: CPUAdam(ps, **hyper))
    if threads > 1:
        add("zerospeed CPUAdam num_threads=1", lambda ps: CPUAdam(ps, num_threads=1, **hyper))
    add("torch AdamW fused", lambda ps: torch.optim.AdamW(ps, fused=True, **hyper))
    add("torch AdamW foreach", lambda ps: torch.optim.AdamW(ps, foreach=True, **hyper))
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        add("DeepSpeedCPUAdam", lambda ps: DeepSpeedCPUAdam(ps, adamw_mode=True, **hyper))
    except ImportError as exc:
        notes.append(f"DeepSpeedCPUAdam: deepspeed not importable here ({exc})")

    cases: dict[str, tuple[Any, int]] = dict(bandwidth_cases)
    cases.update({name: (opt.step, ADAM_BYTES_PER_ELEMENT) for name, (_, opt) in systems.items()})
    times: dict[str, list[float]] = {k: [] for k in cases}
    for i in range(args.warmup + args.repeats):
        for name, (fn, _) in cases.items():
            t0 = time.perf_counter()
            fn()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    # roofline of each round: the best bandwidth case of that round
    rates = {k: [cases[k][1] * n / t / 1e9 for t in ts] for k, ts in times.items()}
    roof_per_round = [max(r) for r in zip(*(rates[k] for k in bandwidth_cases))]
    roofline = statistics.median(roof_per_round)
    best_roofline = max(max(rates[k]) for k in bandwidth_cases)  # the quietest moment of the run

    def pct_of_roof(name: str) -> float:
        return statistics.median(100 * r / roof for r, roof in zip(rates[name], roof_per_round))

    ref = systems.get("torch AdamW fused", next(iter(systems.values())))[0].detach()
    rows = []
    for name in cases:
        med = statistics.median(times[name])
        row: dict[str, Any] = {
            "section": "cpu_adam" if name in systems else "memory_bandwidth", "system": name,
            "numel": n, "median_s": med, "min_s": min(times[name]),
            "effective_GB_s": cases[name][1] * n / med / 1e9, "pct_of_roofline": pct_of_roof(name),
            "best_GB_s": max(rates[name]), "best_pct_of_best_roofline": 100 * max(rates[name]) / best_roofline,
        }
        if name in systems:
            row["params_per_s"] = n / med
            for other, label in (("DeepSpeedCPUAdam", "speedup_vs_DeepSpeed"),
                                 ("torch AdamW fused", "speedup_vs_fused")):
                if other in systems and other != name:
                    row[label] = _paired(times, other, name)
            row["max_abs_diff_vs_torch_fused"] = float((systems[name][0].detach() - ref).abs().max())
        rows.append(row)
    notes.append(f"roofline (median over rounds of the best bandwidth case in the round): "
                 f"{roofline:.1f} GB/s; pct_of_roofline and speedups are medians of per-round ratios "
                 f"(each round runs every case once, so a burst of load hits all alike)")
    notes.append(f"best roofline (fastest bandwidth case, fastest round): {best_roofline:.1f} GB/s; "
                 f"best_pct_of_best_roofline compares peaks. Under load the 'bandwidth' cases are "
                 f"CPU-time-limited like everything else (they then measure a core's share, not the "
                 f"memory), which is how Adam can exceed 100% of the median roofline")
    notes.append(f"load at end of the CPU Adam section {_loadavg()}")
    return {"rows": rows, "notes": notes, "roofline_GB_s": roofline}


# =========================================================================== aio workers


def _serve(handler) -> None:
    """Line protocol for worker processes: JSON command in, JSON answer out."""
    print(_MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            return
        try:
            answer = {"seconds": handler(cmd["op"], cmd["path"])}
        except Exception as exc:  # noqa: BLE001
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(_MARK + json.dumps(answer), flush=True)


def dsaio_worker(args: argparse.Namespace) -> None:
    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder

    handle = AsyncIOBuilder().load().aio_handle(1 << 20, 8, False, True, 1)
    nbytes = args.aio_mib << 20
    buf = handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    buf.fill_(7)

    def run(op: str, path: str) -> float:
        t0 = time.perf_counter()
        (handle.sync_pwrite if op == "write" else handle.sync_pread)(buf, path)
        return time.perf_counter() - t0

    _serve(run)


def uring_worker(args: argparse.Namespace) -> None:
    import mmap

    import liburing as L

    nbytes, block, depth = args.aio_mib << 20, 1 << 20, 8
    buf = mmap.mmap(-1, nbytes)  # page-aligned
    mv = memoryview(buf)
    iovs = [L.Iovec([mv[s:s + block]]) for s in range(0, nbytes, block)]

    def run(op: str, path: str) -> float:
        ring, cqe = L.Ring(), L.Cqe()
        L.io_uring_queue_init(2 * depth, ring)
        write = op == "write"
        flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        fd = os.open(path, flags | os.O_DIRECT, 0o644)
        try:
            t0 = time.perf_counter()
            issued = done = inflight = 0
            while done < len(iovs):
                while inflight < depth and issued < len(iovs):
                    sqe = L.io_uring_get_sqe(ring)
                    prep = L.io_uring_prep_writev if write else L.io_uring_prep_readv
                    prep(sqe, fd, iovs[issued], issued * block)
                    issued += 1
                    inflight += 1
                L.io_uring_submit(ring)
                L.io_uring_wait_cqe(ring, cqe)
                entry = cqe[0]
                if entry.res != block:
                    raise OSError(f"io_uring {op} returned {entry.res}")
                L.io_uring_cqe_seen(ring, entry)
                inflight -= 1
                done += 1
            return time.perf_counter() - t0
        finally:
            os.close(fd)
            L.io_uring_queue_exit(ring)

    _serve(run)


class _Worker:
    """A worker process of this script answering ``write``/``read`` commands."""

    def __init__(self, python: str, kind: str, args: argparse.Namespace, env: dict[str, str]) -> None:
        cmd = [python, __file__, "--worker", kind, "--aio_mib", str(args.aio_mib)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        if self._answer() is None:
            err = self.proc.stderr.read()
            raise RuntimeError(err.strip().splitlines()[-1] if err.strip() else "worker exited")

    def _answer(self) -> dict[str, Any] | None:
        for line in self.proc.stdout:
            if line.startswith(_MARK):
                return json.loads(line[len(_MARK):])
        return None

    def run(self, op: str, path: str) -> float:
        self.proc.stdin.write(json.dumps({"op": op, "path": path}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer()
        if answer is None:
            raise RuntimeError("worker exited: " + self.proc.stderr.read().strip()[-300:])
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer["seconds"]

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def _dd(op: str, path: str, mib: int) -> float:
    if op == "write":
        cmd = ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "oflag=direct"]
    else:
        cmd = ["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip())
    match = re.search(r"copied, ([0-9.e+-]+) s", out.stderr)
    if not match:
        raise RuntimeError(f"cannot parse dd output: {out.stderr!r}")
    return float(match.group(1))


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _fs_facts(directory: str) -> str:
    out = subprocess.run(["df", "-T", directory], capture_output=True, text=True).stdout.splitlines()
    return out[-1] if out else "?"


def aio_section(args: argparse.Namespace, bench_env: dict[str, str]) -> dict[str, Any]:
    import torch

    from zerospeed.ops.aio import AsyncIOHandle, new_aligned_tensor

    notes = [f"load at start of the aio section {_loadavg()}"]
    nbytes = args.aio_mib << 20
    workdir = tempfile.mkdtemp(prefix="zs-aio-bench-", dir=args.aio_dir)
    notes.append(f"files in {workdir}: {_fs_facts(workdir)}")
    handle = AsyncIOHandle.from_config(_aio_config())
    aligned = new_aligned_tensor(nbytes, torch.uint8).fill_(7)
    plain = torch.empty(nbytes + 64, dtype=torch.uint8)[64:].fill_(7)  # 64-byte, not 4 KiB, aligned
    if plain.data_ptr() % 4096 == 0:
        plain = torch.empty(nbytes + 128, dtype=torch.uint8)[128:].fill_(7)

    def ours(buf):
        def run(op: str, path: str) -> float:
            t0 = time.perf_counter()
            (handle.sync_pwrite if op == "write" else handle.sync_pread)(buf, path)
            return time.perf_counter() - t0
        return run

    systems: dict[str, Any] = {
        "dd oflag/iflag=direct": lambda op, path: _dd(op, path, args.aio_mib),
        "zerospeed AsyncIOHandle (aligned buffer)": ours(aligned),
        "zerospeed AsyncIOHandle (torch.empty buffer)": ours(plain),
    }
    workers: list[_Worker] = []
    for label, python, kind, env in (
        ("DeepSpeed aio_handle", args.bench_python, "dsaio", bench_env),
        ("io_uring (liburing from PyPI), raw loop", args.uring_python, "uring", dict(os.environ)),
    ):
        if not python:
            notes.append(f"{label}: not measured (no python given)")
            continue
        try:
            w = _Worker(python, kind, args, env)
        except Exception as exc:  # noqa: BLE001
            notes.append(f"{label}: not measured ({exc})")
            continue
        workers.append(w)
        systems[label] = w.run
    times: dict[tuple[str, str], list[float]] = {}
    drops = []
    try:
        names = list(systems)
        for rep in range(args.aio_repeats):
            # rotate the order each repetition: a disk shared with other jobs has slow spells,
            # and a system should not always follow the same neighbour
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                run = systems[name]
                path = os.path.join(workdir, re.sub(r"\W+", "_", name))
                if os.path.exists(path):
                    os.unlink(path)
                os.sync()
                times.setdefault((name, "write"), []).append(run("write", path))
                drops.append(_drop_caches())
                times.setdefault((name, "read"), []).append(run("read", path))
    finally:
        for w in workers:
            w.close()
        handle.close()
        shutil.rmtree(workdir, ignore_errors=True)
    rows = []
    dd = "dd oflag/iflag=direct"
    for (name, op), ts in times.items():
        gbs = nbytes / statistics.median(ts) / 1e9
        paired = statistics.median(d / t for d, t in zip(times[(dd, op)], ts))
        rows.append({"section": "aio", "system": name, "op": op, "MiB": args.aio_mib,
                     "median_s": statistics.median(ts), "GB_s": gbs,
                     "best_GB_s": nbytes / min(ts) / 1e9, "pct_of_dd": 100 * paired})
    notes.append("aio pct_of_dd: median over repetitions of (dd time / system time) in the same "
                 "repetition; GB_s: bytes / median time")
    notes.append(f"page cache dropped before reads: {all(drops)} (root only); all reads are O_DIRECT")
    notes.append(f"O_DIRECT fallbacks recorded by zerospeed: {handle.direct_io_fallbacks or 'none'}; "
                 f"blocks by mode: {handle.stats()}")
    notes.append(f"load at end of the aio section {_loadavg()}")
    return {"rows": rows, "notes": notes}


def _aio_config():
    from zerospeed.config import AioConfig

    return AioConfig()  # DeepSpeed's defaults: 1 MiB blocks, queue_depth 8, thread_count 1


# =========================================================================== main

SETUP_NOTES = [
    "DeepSpeed ops on this CPU-only machine: cpu_adam (DeepSpeedCPUAdam) JIT-built in ~6 min; "
    "async_io needed `apt-get install libaio-dev` (a system package; zerospeed does not need it) "
    "and a ~12 min JIT build (-O0); both cached in .venv-bench/torch_extensions.",
    "io_uring row: the PyPI `liburing` binding (2026.3.30) in a separate venv; its prep_read/"
    "prep_write take only bytes/bytearray, so the loop uses readv/writev with an Iovec over a "
    "memoryview (zero-copy). It is here to decide whether an io_uring backend is worth a dependency.",
]


def _target_notes(rows: list[dict[str, Any]]) -> list[str]:
    """One line per issue target: CPU Adam >= DeepSpeedCPUAdam and >= 60% of memory bandwidth;
    aio >= 90% of dd."""
    out = []
    adam = {r["system"]: r for r in rows if r["section"] == "cpu_adam"}
    ours = adam.get("zerospeed CPUAdam")
    if ours:
        line = (f"target CPU Adam: zerospeed {ours['effective_GB_s']:.1f} GB/s median = "
                f"{ours['pct_of_roofline']:.0f}% of the measured memory bandwidth, peak "
                f"{ours['best_GB_s']:.1f} GB/s = {ours['best_pct_of_best_roofline']:.0f}% of the peak "
                f"bandwidth (target >= 60%)")
        if "DeepSpeedCPUAdam" in adam:
            ds = adam["DeepSpeedCPUAdam"]
            line += (f"; DeepSpeedCPUAdam {ds['effective_GB_s']:.1f} GB/s, speed ratio "
                     f"{ours['speedup_vs_DeepSpeed']:.2f} (target >= 1)")
        out.append(line)
    for op in ("write", "read"):
        for r in rows:
            if r["section"] == "aio" and r["op"] == op and r["system"].startswith("zerospeed"):
                out.append(f"target aio {op}: {r['system']} {r['GB_s']:.2f} GB/s = "
                           f"{r['pct_of_dd']:.0f}% of dd (target >= 90%)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="adam,aio")
    ap.add_argument("--numel", type=int, default=32 << 20, help="Adam parameter elements")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--aio_mib", type=int, default=512)
    ap.add_argument("--aio_repeats", type=int, default=7)
    ap.add_argument("--aio_dir", default=None, help="parent of the scratch directory (default: $TMPDIR)")
    ap.add_argument("--bench_python", default=str(ROOT / ".venv-bench" / "bin" / "python"))
    ap.add_argument("--uring_python", default=None)
    ap.add_argument("--no_write", action="store_true")
    ap.add_argument("--worker", choices=("adam", "dsaio", "uring"), default=None)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker == "adam":
        Path(args.result).write_text(json.dumps(adam_worker(args)))
        return
    if args.worker == "dsaio":
        return dsaio_worker(args)
    if args.worker == "uring":
        return uring_worker(args)

    from common import command_line, write_results

    if not os.path.exists(args.bench_python):
        args.bench_python = None
    bench_env = {**os.environ, "DS_ACCELERATOR": "cpu",
                 "TORCH_EXTENSIONS_DIR": str(ROOT / ".venv-bench" / "torch_extensions")}
    rows: list[dict[str, Any]] = []
    notes: list[str] = [f"load at start {_loadavg()} (2-core machine shared with other jobs)"]
    sections = set(args.sections.split(","))
    if "adam" in sections:
        python = args.bench_python or sys.executable
        with tempfile.TemporaryDirectory() as tmp:
            result = os.path.join(tmp, "adam.json")
            cmd = [python, __file__, "--worker", "adam", "--result", result, "--numel", str(args.numel),
                   "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
            proc = subprocess.run(cmd, env=bench_env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"adam worker failed:\n{proc.stderr}")
            adam = json.loads(Path(result).read_text())
        rows += adam["rows"]
        notes += adam["notes"]
        notes.append(f"CPU Adam section run by {python} (DS_ACCELERATOR=cpu)")
    if "aio" in sections:
        aio = aio_section(args, bench_env)
        rows += aio["rows"]
        notes += aio["notes"]
    notes += _target_notes(rows)
    notes += SETUP_NOTES
    for r in rows:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
    for n in notes:
        print("note:", n)
    if not args.no_write:
        params = {k: getattr(args, k) for k in ("sections", "numel", "repeats", "warmup", "aio_mib",
                                                  "aio_repeats", "uring_python")}
        paths = write_results("offload_ops", rows, params=params, notes=notes, command=command_line())
        print("wrote", *paths)


if __name__ == "__main__":
    main()
