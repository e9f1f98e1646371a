"""bf16 master weights and optimizer states: model-state bytes and loss, zerospeed vs DeepSpeed 0.19.8.

Run from the repository root (DeepSpeed's venv is optional; without it only zerospeed is measured)::

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python bench/bf16_master_bench.py [--deepspeed_python .venv-bench/bin/python]

Four runs of ``bench/bf16_master_worker.py`` at world size 2, ZeRO-2, bf16, AdamW, the same 8-layer
MLP (2.1 M parameters), data and steps: {zerospeed, DeepSpeed} x {fp32 masters, bf16 masters +
bf16 optimizer states} (``bf16.bf16_master_weights_and_grads`` + ``bf16.bf16_optimizer_states``).
Reported per rank: master-weight bytes and optimizer-state bytes as each library holds them, their
sum against the formula (fp32: 4 + 8 bytes per sharded element; bf16: 0 + 4), the mean of the last 5
losses against the fp32-master run of the same library, and DeepSpeed's loss against zerospeed's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from common import command_line, launch_workers, write_results  # noqa: E402

WORKER = REPO / "bench" / "bf16_master_worker.py"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_python", default=str(REPO / ".venv-bench" / "bin" / "python"),
                        help="python of a venv with DeepSpeed (make bench-env builds .venv-bench)")
    parser.add_argument("--timeout_s", type=float, default=300)
    args = parser.parse_args()
    libs = ["zerospeed"] + (["deepspeed"] if Path(args.deepspeed_python).exists() else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"), DS_ACCELERATOR="cpu",
               TORCH_EXTENSIONS_DIR=str(Path(args.deepspeed_python).parents[1] / "torch_extensions"))
    runs: dict[tuple[str, bool], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for lib in libs:
            for low in (False, True):
                out = Path(tmp) / f"{lib}-{int(low)}.json"
                python = args.deepspeed_python if lib == "deepspeed" else sys.executable
                done = launch_workers(WORKER, [lib, "1" if low else "0", str(out)], num_procs=2, python=python,
                                      env=env, timeout_s=args.timeout_s)
                runs[(lib, low)] = json.loads(out.read_text()) if done.returncode == 0 and out.exists() else \
                    {"error": done.error or f"exit {done.returncode}"}
    rows = []
    for (lib, low), r in runs.items():
        if "error" in r:
            rows.append({"library": lib, "masters": "bf16" if low else "fp32", "error": r["error"]})
            continue
        shard = -(-r["numel"] // 2)
        state = r["master_bytes"] + r["optimizer_state_bytes"]
        formula = (4 if low else 12) * shard
        last5 = sum(r["losses"][-5:]) / 5
        base = runs.get((lib, False), {})
        zs = runs.get(("zerospeed", low), {})
        rows.append({
            "library": lib, "masters": "bf16" if low else "fp32",
            "master_MiB": r["master_bytes"] / 2**20, "optim_states_MiB": r["optimizer_state_bytes"] / 2**20,
            "master+states_MiB": state / 2**20, "formula_MiB": formula / 2**20,
            "vs_fp32_masters": state / (base["master_bytes"] + base["optimizer_state_bytes"]) if "losses" in base
            else None,
            "loss_last5": last5,
            "loss_vs_fp32_masters": last5 / (sum(base["losses"][-5:]) / 5) - 1 if "losses" in base else None,
            "max_loss_rel_diff_vs_zerospeed": max(abs(a - b) / abs(b) for a, b in zip(r["losses"], zs["losses"]))
            if "losses" in zs else None,
            "median_step_s": r["median_step_s"], "peak_rss_MiB": r["peak_rss_bytes"] / 2**20,
        })
    for row in rows:
        print(row)
    json_path, md_path = write_results(
        "bf16_master", rows, command=command_line(),
        params={"world_size": 2, "zero_stage": 2, "steps": 20, "model": "8 x Linear(512, 512) + Linear(512, 16)",
                "optimizer": "AdamW lr 1e-3"},
        notes=["per-rank bytes of the optimizer's master weights and states, as each library holds them",
               "this 2-core machine was shared with other jobs while it ran: step times are noisy"])
    print(json_path, md_path)


if __name__ == "__main__":
    main()
