"""Sequence parallelism (issue #29): the longest sequence that trains under a per-rank activation-memory budget, by
bisection, at SP 1, 2 and 4, for zerospeed and DeepSpeed 0.19.8's ALST, plain / tiled / tiled+checkpointed; and
the step time at a fixed per-rank length.

Each trial is one launch of ``bench/sp_worker.py`` (``sp`` processes, gloo, one thread each) training a random-init
Llama (GQA) for one step at one sequence length; a length "fits" when every rank's peak resident memory during the
step, minus its resident memory just before, stays within ``--budget_mib``. The search probes two lengths,
extrapolates the (nearly linear: sdpa on CPU keeps attention O(seq)) growth to the budget, and bisects around the
guess until the bracket is within ``--granularity`` tokens. DeepSpeed runs with ``.venv-bench/bin/python`` and
``DS_ACCELERATOR=cpu``; a configuration that fails is reported with its error line. Every configuration runs in
this one invocation, so the ratios compare like with like on this machine.

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
#: trials read back from an earlier run's log (--reuse_log): (impl, sp, mode, seq) -> {"ok", "activation_mib"}
REUSED: dict[tuple[str, int, str, int], dict] = {}
_LOG_LINE = re.compile(r"^\[sp_bench\] (\w+) sp=(\d+) (\S+) seq=(\d+): ([\d.]+) MiB$")


def read_log(path: str) -> None:
    for line in Path(path).read_text(errors="replace").splitlines():
        m = _LOG_LINE.match(line.strip())
        if m:
            impl, sp, mode, seq, mib = m.groups()
            REUSED[(impl, int(sp), mode, int(seq))] = {"ok": True, "activation_mib": float(mib), "reused": True}


def trial(impl: str, sp: int, seq: int, mode: str, steps: int = 1, timeout_s: float = 600) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    python = sys.executable
    if impl == "deepspeed":
        env.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(ROOT / ".venv-bench" / "torch_extensions"))
        python = str(BENCH_PY)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        run = launch_workers(WORKER, ["--impl", impl, "--sp", str(sp), "--seq", str(seq), "--mode", mode,
                                      "--steps", str(steps), "--out", str(out)], num_procs=sp, python=python, env=env,
                             timeout_s=timeout_s, tail_lines=60)
        if run.returncode != 0 or not out.exists():
            return {"ok": False, "error": run.error or f"exit {run.returncode}"}
        ranks = json.loads(out.read_text())
    return {"ok": True, "activation_mib": max(r["activation_bytes"] for r in ranks) / MIB,
            "step_s": [statistics.median(r["step_s"][1:] or r["step_s"]) for r in ranks],
            "loss": ranks[0]["losses"][-1]}


def longest(impl: str, sp: int, mode: str, budget_mib: float, granularity: int, probe: int) -> dict:
    """Bisection for the longest multiple of ``granularity * sp`` tokens whose step fits the budget."""
    unit = granularity * sp
    tried: dict[int, dict] = {}

    def fits(seq: int) -> bool:
        if seq not in tried:
            tried[seq] = REUSED.get((impl, sp, mode, seq)) or trial(impl, sp, seq, mode, timeout_s=420)
            r = tried[seq]
            print(f"[sp_bench] {impl} sp={sp} {mode} seq={seq}: "
                  f"{'%.0f MiB' % r['activation_mib'] if r['ok'] else r['error']}", flush=True)
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
        guess = snap(a + (budget_mib - ma) / slope)
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
                x = snap(x * 1.15) if hi is None else snap((lo + hi) / 2)
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
    p.add_argument("--granularity", type=int, default=128, help="tokens per rank the search resolves")
    p.add_argument("--probe", type=int, default=512, help="first probe, tokens per rank (plain; x3 when tiled)")
    p.add_argument("--fixed_per_rank", type=int, default=1024, help="per-rank length of the step-time rows")
    p.add_argument("--sps", default="1,2,4")
    p.add_argument("--modes", default="plain,tiled+ckpt")
    p.add_argument("--impls", default="zerospeed,deepspeed")
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
    rows = []
    for mode in args.modes.split(","):
        for impl in impls:
            for sp in sps:
                probe = args.probe if mode == "plain" else 3 * args.probe
                r = longest(impl, sp, mode, args.budget_mib, args.granularity, probe)
                rows.append({"table": "longest", "impl": impl, "mode": mode, "sp": sp, **r})
    for impl in impls:
        for sp in sps:
            seq = args.fixed_per_rank * sp
            r = trial(impl, sp, seq, "plain", steps=3)
            step = max(r["step_s"]) if r["ok"] else None
            rows.append({"table": "step_time", "impl": impl, "mode": "plain", "sp": sp, "seq": seq,
                         "per_rank": args.fixed_per_rank, "step_s": round(step, 3) if step else None,
                         "tokens_per_s_per_rank": round(args.fixed_per_rank / step, 1) if step else None,
                         "loss": r.get("loss"), "error": r.get("error")})
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
        tps = {r["sp"]: r["tokens_per_s_per_rank"] for r in rows if r["table"] == "step_time" and r["impl"] == impl
               and r["tokens_per_s_per_rank"]}
        for sp in sps[1:]:
            if 1 in tps and sp in tps:
                notes.append(f"{impl}: tokens/s per rank at SP {sp} = {tps[sp] / tps[1]:.2f} x SP 1 "
                             f"({args.fixed_per_rank} tokens per rank; {os.cpu_count()} cores shared by {sp} ranks)")
    notes.append("activation memory = peak RSS during the step minus RSS before it, max over ranks (fp32, ZeRO-2, "
                 "Adam); tiled = TiledMLP (ceil(seq/hidden) tiles) + tiled fused logits+loss; +ckpt = every decoder "
                 "layer checkpointed with the library's checkpoint function, cpu_checkpointing on (on CPU the "
                 "checkpoints are in host memory already)")
    params = {k: v for k, v in vars(args).items()}
    params["model"] = "Llama hidden 128, 2 layers, 4 heads / 2 KV heads, intermediate 512, vocab 16000"
    for path in write_results("sp_bench", rows, params=params, notes=notes, command=command_line()):
        print(path)


if __name__ == "__main__":
    main()
