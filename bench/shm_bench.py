"""Single-host collectives: gloo's loopback TCP against shared memory (zerospeed.comm.shm), per-rank CPU time.

Each rank times one collective through zerospeed.comm (reduce-scatter, all-gather, equal-split all-to-all) with
``ZEROSPEED_SHM_COLLECTIVES=0`` (TCP: the algorithm zerospeed picks on gloo) and ``=1`` (shared memory), the two
modes alternating repeat by repeat so that load drift hits both alike. The figure is the median per op of the
process's CPU time over all its threads (``time.process_time``: gloo's loop thread and the kernel's copies
included), the mean over ranks, since the ranks share the cores; the wall time is recorded too.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python bench/shm_bench.py [--world 4 --repeats 15]``

``--sp-pairs N`` measures a training step instead: ``bench/sp_worker.py`` at SP 4 (1024 tokens per rank, 6 steps,
``SP_BENCH_PHASES=1``) N times with ``ZEROSPEED_SHM_COLLECTIVES=0`` and unset, alternating, and reports each run's
per-rank median of ``cpu_s[1:]`` (mean over ranks) and gloo's TCP-thread CPU, plus SP 1 at 1024 tokens once each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from common import write_results  # noqa: E402

#: (collective, elements of the logical message, fp32): ZeRO-2's 4.6M-element buckets of sp_bench's hidden-128 model,
#: a 1 MB all-to-all (Ulysses' at sp_bench's shape), and small messages around the size threshold
CASES = [("reduce_scatter", 4_600_000), ("all_gather", 4_600_000), ("all_to_all", 262_144),
         ("all_to_all", 65_536), ("reduce_scatter", 65_536), ("all_gather", 65_536),
         ("all_to_all", 16384), ("reduce_scatter", 16384), ("all_gather", 16384),
         ("all_to_all", 4096), ("reduce_scatter", 4096), ("all_gather", 4096),
         ("all_to_all", 1024), ("reduce_scatter", 1024), ("all_gather", 1024),
         ("all_to_all", 256), ("reduce_scatter", 256),
         # the per-op synchronisation candidates (the same in both columns: neither goes through shared memory)
         ("barrier", 0), ("all_reduce_1int", 0)]


def _rank(cases: list, repeats: int, inner: int) -> dict:
    import torch
    import torch.distributed as dist

    from zerospeed import comm

    k = dist.get_world_size()
    out = {}
    for kind, numel in cases:
        numel = numel // k * k
        x = torch.randn(numel)
        part = torch.empty(numel // k)
        full = torch.empty(numel)

        one = torch.zeros(1, dtype=torch.int32)

        def once() -> None:
            if kind == "barrier":
                dist.barrier()
            elif kind == "all_reduce_1int":
                dist.all_reduce(one)
            elif kind == "reduce_scatter":
                comm.reduce_scatter(part, x)
            elif kind == "all_gather":
                comm.all_gather(full, part)
            else:
                comm.all_to_all_single(full, x)

        samples = {"0": [], "1": []}
        for r in range(repeats + 1):
            for mode in ("0", "1"):
                os.environ["ZEROSPEED_SHM_COLLECTIVES"] = mode
                dist.barrier()
                c0, w0 = time.process_time(), time.perf_counter()
                for _ in range(inner):
                    once()
                cpu, wall = (time.process_time() - c0) / inner, (time.perf_counter() - w0) / inner
                if r:  # the first repeat warms up (and sets up the shared memory)
                    samples[mode].append((cpu, wall))
        out[f"{kind}/{numel}"] = {mode: (statistics.median(c for c, _ in s), statistics.median(w for _, w in s))
                                  for mode, s in samples.items()}
    return out


def _sp_run(sp: int, mode: str) -> dict:
    import json
    import subprocess
    import tempfile

    env = dict(os.environ, OMP_NUM_THREADS="1", SP_BENCH_PHASES="1")
    env.pop("ZEROSPEED_SHM_COLLECTIVES", None)
    if mode == "0":
        env["ZEROSPEED_SHM_COLLECTIVES"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "sp.json")
        load = os.getloadavg()[0]
        subprocess.run([sys.executable, "-m", "zerospeed.launcher.runner", "--num_procs", str(sp),
                        str(BENCH / "sp_worker.py"), "--impl", "zerospeed", "--sp", str(sp), "--seq", str(1024 * sp),
                        "--steps", "6", "--out", out], env=env, check=True, cwd=BENCH.parent, capture_output=True,
                       timeout=600)
        ranks = json.load(open(out))
    cpu = statistics.mean(statistics.median(r["cpu_s"][1:]) for r in ranks)
    gloo = statistics.mean(r.get("thread_cpu_s", {}).get("gloo_tcp_loop", 0.0) for r in ranks)
    return {"sp": sp, "shm": "off" if mode == "0" else "on (size rule)", "cpu_s_per_step": round(cpu, 4),
            "gloo_tcp_thread_s": round(gloo, 4), "last_loss": ranks[0]["losses"][-1], "load_1min": round(load, 2)}


def sp_steps(pairs: int) -> None:
    rows = []
    for _ in range(pairs):
        for mode in ("0", ""):
            rows.append(_sp_run(4, mode))
            print(rows[-1], flush=True)
    for mode in ("0", ""):
        rows.append(_sp_run(1, mode))
        print(rows[-1], flush=True)
    notes = ["cpu_s_per_step: per-rank median of sp_worker's cpu_s[1:] (process CPU, all threads), mean over ranks; "
             "gloo_tcp_thread_s: the gloo TCP loop thread's CPU per step (SP_BENCH_PHASES), mean over ranks",
             "SP 4: hidden 128 (sp_worker's default model), 1024 tokens per rank, ZeRO-2; runs alternate off / on"]
    print(*write_results("shm_sp_step", rows, params={"pairs": pairs}, notes=notes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cases", type=int, default=len(CASES), help="only the first N cases")
    parser.add_argument("--max-bytes", type=int, default=None,
                        help="ZEROSPEED_SHM_MAX_BYTES: a smaller half, so large messages go in pieces")
    parser.add_argument("--sp-pairs", type=int, default=0, help="measure sp_worker steps instead (see above)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.sp_pairs:
        return sp_steps(args.sp_pairs)
    from zerospeed.testing import run_distributed

    if args.max_bytes:
        os.environ["ZEROSPEED_SHM_MAX_BYTES"] = str(args.max_bytes)
    load = os.getloadavg()
    per_rank = run_distributed(_rank, args.world, CASES[:args.cases], args.repeats, 4, timeout=1800)
    rows = []
    for key in per_rank[0]:
        kind, numel = key.split("/")
        tcp = [r[key]["0"] for r in per_rank]
        fast = [r[key]["1"] for r in per_rank]
        tcp_cpu, shm_cpu = statistics.mean(c for c, _ in tcp), statistics.mean(c for c, _ in fast)
        rows.append({"collective": kind, "elements": int(numel), "MB": round(int(numel) * 4 / 1e6, 3),
                     "tcp_cpu_ms": round(1e3 * tcp_cpu, 3), "shm_cpu_ms": round(1e3 * shm_cpu, 3),
                     "cpu_ratio": round(shm_cpu / tcp_cpu, 3),
                     "tcp_wall_ms": round(1e3 * statistics.mean(w for _, w in tcp), 3),
                     "shm_wall_ms": round(1e3 * statistics.mean(w for _, w in fast), 3)})
        print(rows[-1], flush=True)
    notes = [f"load average before the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; after: "
             + " ".join(f"{v:.2f}" for v in os.getloadavg()),
             "cpu = per-rank process CPU time per op (all threads, kernel included), mean over ranks of the median "
             "over repeats; 4 ops per repeat"]
    params = {"world": args.world, "repeats": args.repeats, "dtype": "fp32", "shm_max_half_bytes": args.max_bytes}
    paths = write_results("shm_collectives", rows, params=params, notes=notes)
    print(*paths)


if __name__ == "__main__":
    main()
