"""Sequence parallelism (issue #29): the longest sequence that trains under a per-rank activation-memory budget, by
bisection, at SP 1, 2 and 4, for zerospeed, DeepSpeed 0.19.8's ALST and PyTorch's context parallel, plain /
tiled+checkpointed; and the step time at a fixed per-rank length: wall time, and each rank's CPU time (user + system
of its process, so an oversubscribed machine, where 4 ranks share 2 cores, does not count the waits for a core).

The step-time table compares SP ``s`` at ``n`` tokens per rank with two SP 1 baselines at the same ``n``: one process
alone on the machine (``fixed_per_rank``, sp 1), and ``s`` data-parallel ranks on the same cores (``dp_same_world``:
SP 1 x DP ``s``, each rank its own ``n``-token sample, ZeRO over the same ``s`` ranks), which is what a user with
``s`` devices runs instead of SP. The first also charges SP for what any ``s``-rank run pays on this machine
(ZeRO's collectives over ``s`` ranks, ``s`` processes sharing 2 cores and their caches); the second isolates what
SP adds: the all-to-alls, the loss's all-gathers and attention over the longer global sequence. Both are reported.

Each trial is one launch of ``bench/sp_worker.py`` (``sp`` processes, gloo, one thread each) training a random-init
Llama (GQA) for one step at one sequence length; a length "fits" when every rank's activation memory during the step
stays within ``--budget_mib``: the peak resident size during the step (the kernel's high-water mark, reset just
before it) minus the resident size before it, with glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``) so
that a freed block leaves the resident set. Runs before 11-28 04:00 left the threshold dynamic and took the
process's lifetime peak: glibc's caching then moved a trial by tens of MiB (one bisection step) between runs; now
a trial repeats to ~0.1 MiB. ``--memory allocated`` (a diagnostic) counts tensor bytes from torch's profiler
instead: it misses frees made on gloo's threads and counts reserved but untouched buffers (DeepSpeed's
5e8-element reduce bucket), so it is not the bench's measure. The search probes two lengths,
extrapolates the (nearly linear: sdpa on CPU keeps attention O(seq)) growth to the budget, and bisects around the
guess until the bracket is within ``--granularity`` tokens. DeepSpeed runs with ``.venv-bench/bin/python`` and
``DS_ACCELERATOR=cpu``; a configuration that fails is reported with its error line. Every configuration runs in
this one invocation, so the ratios compare like with like on this machine. PyTorch's context parallel runs with
this venv's torch (``--impl torch_cp`` in the worker); a configuration that fails is a row with its error line.
The load average is recorded before and after the run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sp_bench.py            # full run (~30 min on 2 cores)
    OMP_NUM_THREADS=1 .venv/bin/python bench/sp_bench.py --quick    # SP 1/2, zerospeed only
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, launch_workers, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "sp_worker.py"
BENCH_PY = Path(os.environ.get("BENCH_PYTHON", ROOT / ".venv-bench" / "bin" / "python"))
MIB = 1 << 20
#: trials read back from an earlier run's log (--reuse_log): (impl, sp, mode, seq, memory) -> {"ok", "activation_mib"}
REUSED: dict[tuple[str, int, str, int, str], dict] = {}
_LOG_LINE = re.compile(r"^\[sp_bench\] (\w+) sp=(\d+) (\S+) seq=(\d+)(?: \((\w+)\))?: ([\d.]+) MiB$")


def read_log(path: str) -> None:
    """Trials of an earlier run; lines without a memory measure are from the RSS-only runs (before 11-28 04:00)."""
    for line in Path(path).read_text(errors="replace").splitlines():
        m = _LOG_LINE.match(line.strip())
        if m:
            impl, sp, mode, seq, memory, mib = m.groups()
            REUSED[(impl, int(sp), mode, int(seq), memory or "rss")] = {"ok": True, "activation_mib": float(mib),
                                                                         "reused": True}


def trial(impl: str, sp: int, seq: int, mode: str, steps: int = 1, timeout_s: float = 600,
          shape: tuple[int, int, int] | None = None, memory: str = "rss", memory_trial: bool = False,
          dp: int = 1) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if memory_trial and memory == "rss":
        # a memory trial: glibc's dynamic mmap threshold lets freed blocks stay in the heap, so the resident size
        # moved with the allocation history (tens of MiB between runs); a fixed threshold maps every block >= 64 KiB
        # on its own and unmaps it on free, so the resident size follows the live memory (repeatable to ~0.1 MiB).
        # Not for the timed trials: a page fault per large allocation would cost CPU time the default allocator
        # does not pay.
        env["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
        # and gloo's TCP transport, as before 11-28 09:30: zerospeed's shared-memory collectives map a fixed 16 MiB
        # segment per rank on the first step, and every rank's resident size also counts the peers' segments it
        # reads (shared pages count in each process that maps them), so the shared-memory transport would add up
        # to 16 MiB x ranks to a measure meant for activations; TCP's buffers are kernel memory, outside it
        env["ZEROSPEED_SHM_COLLECTIVES"] = "0"
    python = sys.executable
    if impl == "deepspeed":
        env.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(ROOT / ".venv-bench" / "torch_extensions"))
        python = str(BENCH_PY)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        run = launch_workers(WORKER, ["--impl", impl, "--sp", str(sp), "--seq", str(seq), "--mode", mode,
                                      "--steps", str(steps), "--memory", memory, "--out", str(out),
                                      "--dp", str(dp), *_shape_args(shape)],
                             num_procs=sp * dp, python=python, env=env,
                             timeout_s=timeout_s, tail_lines=60)
        if run.returncode != 0 or not out.exists():
            return {"ok": False, "error": run.error or f"exit {run.returncode}"}
        ranks = json.loads(out.read_text())
    return {"ok": True, "activation_mib": max(r["activation_bytes"] for r in ranks) / MIB,
            "step_s": [statistics.median(r["step_s"][1:] or r["step_s"]) for r in ranks],
            "cpu_s": [statistics.median(r["cpu_s"][1:] or r["cpu_s"]) for r in ranks if "cpu_s" in r],
            "loss": ranks[0]["losses"][-1]}


def _shape_args(shape: tuple[int, int, int] | None) -> list[str]:
    if shape is None:
        return []
    hidden, heads, kv_heads = shape
    return ["--hidden", str(hidden), "--heads", str(heads), "--kv_heads", str(kv_heads)]


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """"128x4x2,512x8x4" -> [(hidden, heads, kv_heads), ...]"""
    out = []
    for item in text.split(","):
        parts = item.split("x")
        if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
            raise SystemExit(f"sp_bench: --step_shapes entry {item!r} is not HIDDENxHEADSxKV_HEADS")
        out.append(tuple(int(x) for x in parts))
    return out


def step_row(impl: str, sp: int, seq: int, shape: tuple[int, int, int], steps: int, role: str, dp: int = 1) -> dict:
    r = trial(impl, sp, seq, "plain", steps=steps, shape=shape, dp=dp)
    if not r["ok"]:  # once more: a launch aborting at start or exit (DeepSpeed SP 2, 11-28 07:40) is not a verdict
        print(f"[sp_bench] {impl} sp={sp} seq={seq} step time: failed ({r['error'][:120]}), retrying", flush=True)
        r = trial(impl, sp, seq, "plain", steps=steps, shape=shape, dp=dp)
    step = max(r["step_s"]) if r["ok"] else None
    cpu = max(r["cpu_s"]) if r["ok"] and r["cpu_s"] else None
    per_rank = seq // sp
    return {"table": "step_time", "impl": impl, "model": "x".join(map(str, shape)), "role": role, "sp": sp,
            "dp": dp, "seq": seq, "per_rank": per_rank, "step_s": round(step, 3) if step else None,
            "tokens_per_s_per_rank": round(per_rank / step, 1) if step else None,
            "cpu_s_per_rank": round(cpu, 3) if cpu else None,
            "tokens_per_cpu_s_per_rank": round(per_rank / cpu, 1) if cpu else None,
            "loss": r.get("loss"), "error": (r.get("error") or "")[:200] or None}


def step_notes(rows: list[dict], impl: str, sps: list[int], per_rank: int) -> list[str]:
    notes = []
    for model in dict.fromkeys(r["model"] for r in rows if r["table"] == "step_time" and r["impl"] == impl):
        mine = [r for r in rows if r["table"] == "step_time" and r["impl"] == impl and r["model"] == model
                and r["tokens_per_cpu_s_per_rank"]]
        fixed = {r["sp"]: r for r in mine if r["role"] == "fixed_per_rank"}
        whole = {r["seq"]: r for r in mine if r["role"] == "one_process_same_seq"}
        same_world = {r["dp"]: r for r in mine if r["role"] == "dp_same_world"}
        for sp in sps[1:]:
            if sp in fixed and sp in same_world:
                cpu = fixed[sp]["tokens_per_cpu_s_per_rank"] / same_world[sp]["tokens_per_cpu_s_per_rank"]
                notes.append(f"{impl} model {model}: tokens/s per rank at SP {sp} = {cpu:.2f} x SP 1 on the same "
                             f"{sp} ranks (SP 1 x DP {sp}: each rank its own {per_rank}-token sample, ZeRO over the "
                             f"same {sp} ranks, {sp} processes sharing the cores as at SP {sp}) by CPU time "
                             f"({'meets' if cpu >= 0.8 else 'misses'} the 0.8x target)")
            if 1 in fixed and sp in fixed:
                wall = fixed[sp]["tokens_per_s_per_rank"] / fixed[1]["tokens_per_s_per_rank"]
                cpu = fixed[sp]["tokens_per_cpu_s_per_rank"] / fixed[1]["tokens_per_cpu_s_per_rank"]
                notes.append(f"{impl} model {model}: tokens/s per rank at SP {sp} = {cpu:.2f} x SP 1 by CPU time "
                             f"({'meets' if cpu >= 0.8 else 'misses'} the 0.8x target), {wall:.2f} x by wall time "
                             f"({os.cpu_count()} cores shared by {sp} ranks); {per_rank} tokens per rank")
            seq = per_rank * sp
            if sp in fixed and seq in whole:
                eff = whole[seq]["cpu_s_per_rank"] / (sp * fixed[sp]["cpu_s_per_rank"])
                notes.append(f"{impl} model {model}: SP {sp} at {seq} tokens = {eff:.2f} x the ideal split of one "
                             f"process's CPU time at {seq} tokens (what SP itself costs: all-to-alls, the loss and "
                             f"ZeRO over dp x sp; the rest of the gap to SP 1 at {per_rank} is attention's quadratic "
                             f"growth with the global length)")
    return notes


def longest(impl: str, sp: int, mode: str, budget_mib: float, granularity: int, probe: int,
            memory: str = "allocated") -> dict:
    """Bisection for the longest multiple of ``granularity * sp`` tokens whose step fits the budget."""
    unit = granularity * sp
    tried: dict[int, dict] = {}

    def fits(seq: int) -> bool:
        if seq not in tried:
            tried[seq] = REUSED.get((impl, sp, mode, seq, memory)) or trial(impl, sp, seq, mode, timeout_s=420,
                                                                            memory=memory, memory_trial=True)
            if not tried[seq]["ok"]:  # once more: one launch aborting (seen once: DeepSpeed, no Python frame, at exit) is not a verdict
                print(f"[sp_bench] {impl} sp={sp} {mode} seq={seq}: failed ({tried[seq]['error'][:120]}), retrying",
                      flush=True)
                tried[seq] = trial(impl, sp, seq, mode, timeout_s=420, memory=memory, memory_trial=True)
            r = tried[seq]
            print(f"[sp_bench] {impl} sp={sp} {mode} seq={seq} ({memory}): "
                  f"{'%.1f MiB' % r['activation_mib'] if r['ok'] else r['error']}", flush=True)
        r = tried[seq]
        if not r["ok"]:
            raise RuntimeError(r["error"])
        return r["activation_mib"] <= budget_mib

    def snap(x: float) -> int:
        return max(unit, int(x // unit) * unit)

    try:
        a, b = snap(probe * sp), snap(2 * probe * sp)
        fits(a), fits(b)
        ma, mb = tried[a]["activation_mib"], tried[b]["activation_mib"]
        slope = max((mb - ma) / (b - a), 1e-9)
        # at most 2x the longer probe: a flat probe pair (a peak set by something fixed, e.g. the optimizer step)
        # would otherwise send the first guess to a length whose quadratic attention runs past the trial timeout
        guess = min(snap(a + (budget_mib - ma) / slope), 2 * b)
        lo, hi = 0, None
        for seq in sorted({a, b}):
            if tried[seq]["activation_mib"] <= budget_mib:
                lo = max(lo, seq)
            elif hi is None or seq < hi:
                hi = seq
        x = guess
        while hi is None or hi - lo > unit:  # the bracket, then halve it
            if x <= lo or (hi is not None and x >= hi):
                x = snap((lo + hi) / 2) if hi is not None else snap(max(2 * lo, x))
                if x <= lo:
                    break
            if fits(x):
                lo = x
                x = snap(x * 1.5) if hi is None else snap((lo + hi) / 2)
            else:
                hi = x
                x = snap((lo + hi) / 2)
        best = tried.get(lo)
        return {"longest_seq": lo, "per_rank": lo // sp, "activation_mib_at_longest": round(best["activation_mib"], 1)
                if best else None, "trials": len(tried), "error": None}
    except RuntimeError as exc:
        return {"longest_seq": None, "per_rank": None, "activation_mib_at_longest": None, "trials": len(tried),
                "error": str(exc)[:200]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget_mib", type=float, default=256.0)
    p.add_argument("--memory", choices=["rss", "allocated"], default="rss",
                   help="the longest-sequence measure: peak resident size (default) or profiler-counted tensor bytes")
    p.add_argument("--granularity", type=int, default=128, help="tokens per rank the search resolves")
    p.add_argument("--probe", type=int, default=512, help="first probe, tokens per rank (plain; x3 when tiled)")
    p.add_argument("--fixed_per_rank", type=int, default=1024, help="per-rank length of the step-time rows")
    p.add_argument("--sps", default="1,2,4")
    p.add_argument("--modes", default="plain,tiled+ckpt")
    p.add_argument("--impls", default="zerospeed,deepspeed,torch_cp")
    p.add_argument("--tables", default="longest,step_time", help="which tables to measure")
    p.add_argument("--steps", type=int, default=3, help="steps of a step-time trial (the first is not timed)")
    p.add_argument("--step_shapes", default="128x4x2",
                   help="models of the step-time table, HIDDENxHEADSxKV_HEADS each (intermediate 4 x hidden)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--reuse_log", help="an earlier run's output: its trials are not run again (named in the notes)")
    args = p.parse_args()
    sps = [int(s) for s in args.sps.split(",")]
    impls = args.impls.split(",")
    if args.quick:
        sps, impls = [1, 2], ["zerospeed"]
    if "deepspeed" in impls and not BENCH_PY.exists():
        impls.remove("deepspeed")
    if args.reuse_log:
        read_log(args.reuse_log)
    tables = args.tables.split(",")
    load_before = os.getloadavg()
    rows = []
    for mode in (args.modes.split(",") if "longest" in tables else []):
        for impl in impls:
            for sp in sps:
                probe = args.probe if mode == "plain" else 3 * args.probe
                r = longest(impl, sp, mode, args.budget_mib, args.granularity, probe, args.memory)
                rows.append({"table": "longest", "impl": impl, "mode": mode, "sp": sp, **r})
    shapes = parse_shapes(args.step_shapes)
    for shape in (shapes if "step_time" in tables else []):
        for impl in impls:
            for sp in sps:  # the same per-rank length at every degree (the target), then one process at SP s's length
                rows.append(step_row(impl, sp, args.fixed_per_rank * sp, shape, args.steps, "fixed_per_rank"))
                if rows[-1]["error"]:
                    break
            if not rows[-1]["error"]:
                for sp in sps[1:]:
                    rows.append(step_row(impl, 1, args.fixed_per_rank * sp, shape, args.steps,
                                         "one_process_same_seq"))
                for sp in sps[1:]:  # SP 1 on the same ranks: data parallel, a sample per rank
                    rows.append(step_row(impl, 1, args.fixed_per_rank, shape, args.steps, "dp_same_world", dp=sp))
    notes = []
    if args.reuse_log:
        notes.append(f"{len(REUSED)} trials were read back from an earlier run of this script on this machine "
                     f"({args.reuse_log}, same parameters) instead of being run again")
    for impl in impls:
        for mode in args.modes.split(","):
            got = {r["sp"]: r["longest_seq"] for r in rows if r["table"] == "longest" and r["impl"] == impl
                   and r["mode"] == mode and r["longest_seq"]}
            for a, b in ((1, 2), (2, 4)):
                if a in got and b in got:
                    notes.append(f"{impl} {mode}: longest sequence x{got[b] / got[a]:.2f} from SP {a} to SP {b}")
        notes += step_notes(rows, impl, sps, args.fixed_per_rank)
        errors = {r["error"] for r in rows if r["impl"] == impl and r.get("error")}
        for err in sorted(errors):
            notes.append(f"{impl} fails on this machine: {err}")
    measure = ("peak bytes of the tensors allocated during the step and not yet freed, by torch profiler's "
               "allocation events (a diagnostic: frees made on gloo's threads are not seen, reserved but untouched "
               "buffers count)" if args.memory == "allocated" else
               "peak resident size during the step (the kernel's high-water mark, reset just before it) minus the "
               "resident size before it, with glibc's mmap threshold fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_) so "
               "that freed blocks leave the resident set: repeatable to ~0.1 MiB; zerospeed's trials use gloo's TCP "
               "transport (ZEROSPEED_SHM_COLLECTIVES=0), whose buffers are outside the resident set, instead of its "
               "shared-memory segments (16 MiB per rank at most, fixed, and counted in every rank that maps them)")
    if "longest" in tables:
        notes.append(f"activation memory = {measure}, max over ranks (fp32, ZeRO-2, Adam); tiled = TiledMLP "
                     "(ceil(seq/hidden) tiles) + tiled fused logits+loss; +ckpt = every decoder "
                     "layer checkpointed with the library's checkpoint function, cpu_checkpointing on (on CPU the "
                     "checkpoints are in host memory already); +ckpt_no_offload = the same with cpu_checkpointing off")
    load_after = os.getloadavg()
    notes.append("load average (1/5/15 min) before the run: %.2f / %.2f / %.2f, after: %.2f / %.2f / %.2f"
                 % (*load_before, *load_after))
    params = {k: v for k, v in vars(args).items()}
    params["load_avg_before"] = [round(x, 2) for x in load_before]
    params["load_avg_after"] = [round(x, 2) for x in load_after]
    longest_shape = "hidden 128, 4 heads / 2 KV heads, intermediate 512"
    params["model"] = ("Llama, 2 layers, vocab 16000, intermediate 4 x hidden; "
                       + (f"longest-sequence table: {longest_shape}" if "longest" in tables else "")
                       + ("; " if "longest" in tables and "step_time" in tables else "")
                       + (f"step-time table: {', '.join(f'hidden {h}, {a} heads / {k} KV heads' for h, a, k in shapes)}"
                          if "step_time" in tables else ""))
    for path in write_results("sp_bench", rows, params=params, notes=notes, command=command_line()):
        print(path)


if __name__ == "__main__":
    main()
