"""Mixture-of-experts benchmark: a GPT with MoE FFNs (8 experts, top-2) on 2 and 4 processes.

Rows per world size (same model, data and ZeRO-1 AdamW, one run):

* ``dense``: the same GPT with dense FFNs of the active width (equal active parameters per token);
* ``moe``: zerospeed's MoE, experts spread over all ranks (ep = world), grouped experts;
* ``moe_loop``: the same with the per-expert Python loop;
* ``deepspeed``: DeepSpeed 0.19.8's ``deepspeed.moe.layer.MoE`` (ep = world), where it runs on CPU.

Reported: median step time, peak RSS per rank (max over ranks), all-to-all elements per step against
the formula (layers x 4 exchanges x E x C x M, i.e. tokens x k x hidden x 2 directions x 2 passes with
capacity padding), and ratios to dense, to DeepSpeed and grouped / loop.

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python bench/moe_bench.py [--worlds 2,4] [--steps 8]

DeepSpeed runs with ``.venv-bench/bin/python`` (or ``$BENCH_PYTHON``) and ``DS_ACCELERATOR=cpu``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import command_line, launch_workers, write_results  # noqa: E402

WORKER = ROOT / "bench" / "moe_worker.py"
BENCH_PY = ROOT / ".venv-bench" / "bin" / "python"


def run(system: str, world: int, ep: int, steps: int, warmup: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    python = None
    if system == "deepspeed":
        bench_py = Path(os.environ.get("BENCH_PYTHON", BENCH_PY))
        if not bench_py.exists():
            return {"system": system, "world": world, "error": f"{bench_py} missing (make bench-env, or set "
                    "BENCH_PYTHON to a python with deepspeed)"}
        python = str(bench_py)
        env.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(bench_py.parents[1] / "torch_extensions")))
    out = launch_workers(WORKER, ["--system", system, "--ep", str(ep), "--steps", str(steps), "--warmup",
                                  str(warmup)], num_procs=world, python=python, env=env, timeout_s=600)
    for line in out.output_tail:
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"system": system, "world": world, "error": out.error or f"exit {out.returncode}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no_write", action="store_true")
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    for world in (int(w) for w in args.worlds.split(",")):
        got = {s: run(s, world, world if s != "dense" else 1, args.steps, args.warmup)
               for s in ("dense", "moe", "moe_loop", "deepspeed")}
        tokens, k, experts, d, layers = 8 * 128, 2, 8, 256, 4
        capacity = max(4, math.ceil(k * tokens / experts * 1.25))
        formula = layers * 4 * experts * capacity * d
        for system, r in got.items():
            row = {"world": world, "system": system, **{k2: v for k2, v in r.items() if k2 not in ("system", "world")}}
            if "step_s" in r:
                for ref in ("dense", "deepspeed", "moe_loop"):
                    if ref != system and "step_s" in got[ref]:
                        row[f"step / {ref}"] = r["step_s"] / got[ref]["step_s"]
                if "peak_rss_bytes" in got["deepspeed"] and system != "deepspeed":
                    row["rss / deepspeed"] = r["peak_rss_bytes"] / got["deepspeed"]["peak_rss_bytes"]
            if system != "dense":
                row["all_to_all formula"] = formula if world > 1 else 0
                if r.get("all_to_all_elements_per_step") is not None:
                    row["all_to_all MiB / step"] = r["all_to_all_elements_per_step"] * 4 / 2**20
                    row["all_to_all / formula"] = r["all_to_all_elements_per_step"] / formula
            rows.append(row)
            print(row, flush=True)
    if not args.no_write:
        notes = ["GPT d_model 256, 4 layers, seq 128, micro-batch 8 per rank; MoE: 8 experts of width 512, top-2, "
                 "capacity factor 1.25; dense FFN width 1024 (equal active parameters); ZeRO-1 AdamW for every system.",
                 "all_to_all elements per step per rank: zerospeed's from its comm counter, DeepSpeed's from its "
                 "comms logger (all_to_all_single only); formula = layers x 4 exchanges (dispatch and combine, "
                 "forward and backward) x experts x capacity x d_model, capacity = ceil(k x tokens / experts x 1.25).",
                 "peak_rss_bytes: the largest peak RSS over the ranks.",
                 "The machine (2 cores) was shared with other jobs during the run: compare ratios within this file."]
        print("wrote", *write_results("moe_bench", rows, params=vars(args), notes=notes, command=command_line()))


if __name__ == "__main__":
    main()
