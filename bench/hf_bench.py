"""HuggingFace on zerospeed: the HF Trainer plain (DDP) vs ZeroSpeedTrainer at ZeRO-2 / ZeRO-3, and the
cost of building an HF model under ``zero.Init`` (HF initialisation applied on gathered parameters).

Same random Llama (hidden 256, 4 layers, vocab 8000; 7.0M parameters), same data (seq 128, micro
batch 4 per rank, AdamW), 2 processes on CPU (gloo), one run. DeepSpeed's own HF Trainer path is not
measured: it needs accelerate in the DeepSpeed bench environment, which does not have it.

Reported per row: median seconds per optimizer step (slowest rank), peak RSS (largest rank), the
engine's model-state bytes per rank; ratios to the plain Trainer. Init rows: build seconds and peak
RSS growth, plain vs zero.Init.

    python bench/hf_bench.py [--steps 8] [--world 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import command_line, launch_workers, write_results  # noqa: E402

WORKER = ROOT / "bench" / "hf_worker.py"


def run(what: str, system: str, world: int, steps: int, warmup: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    out = launch_workers(WORKER, ["--what", what, "--system", system, "--steps", str(steps), "--warmup", str(warmup)],
                         num_procs=world, env=env, timeout_s=900)
    for line in out.output_tail:
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"what": what, "system": system, "world": world, "error": out.error or f"exit {out.returncode}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no_write", action="store_true")
    args = p.parse_args()
    rows = [run("trainer", s, args.world, args.steps, args.warmup) for s in ("plain", "zs2", "zs3")]
    base = rows[0]
    for r in rows[1:]:
        for key in ("step_s", "peak_rss_bytes"):
            if key in r and key in base:
                r[f"{key} / plain"] = r[key] / base[key]
    init = [run("init", s, args.world, 0, 0) for s in ("plain", "zero_init")]
    if "build_s" in init[0] and "build_s" in init[1]:
        init[1]["build_s / plain"] = init[1]["build_s"] / init[0]["build_s"]
        init[1]["peak_rss_growth / plain"] = init[1]["peak_rss_growth_bytes"] / max(1, init[0]["peak_rss_growth_bytes"])
    rows += init
    for r in rows:
        print(r, flush=True)
    if not args.no_write:
        notes = ["Llama hidden 256, 4 layers, intermediate 688, vocab 8000, seq 128, micro batch 4 per rank, AdamW, "
                 "fp32, gloo on CPU, one torch thread per rank.",
                 "The machine was shared with other jobs while this ran (2 cores, load ~10+): absolute times are "
                 "noisy; the ratios within one run are what this measures.",
                 "zero.Init rows: building the model under zero.Init runs HF's _init_weights on gathered "
                 "parameters (one gather + broadcast per module); the plain build holds every parameter."]
        paths = write_results("hf_bench", rows, params=vars(args), notes=notes, command=command_line())
        print("written:", *paths)


if __name__ == "__main__":
    main()
