"""`accelerate launch --use_deepspeed` under zerospeed-as-deepspeed (issue 27): a plain Accelerate loop, unchanged.

tests/hf_scripts/accelerate_loop.py (an MLP, AdamW, gradients clipped to 1.0, fp32, 8 micro-batches under
``accelerator.accumulate``) runs on 2 CPU ranks under DDP (torchrun with ACCELERATE_USE_CPU, Accelerate's multi-CPU
path) and under ``zerospeed-as-deepspeed accelerate launch --use_deepspeed`` at ZeRO-2 and ZeRO-3, with
gradient_accumulation_steps 1 and 2 (Accelerate builds the DeepSpeed config, calls ``deepspeed.initialize``, wraps
the engine, calls ``engine.set_gradient_accumulation_boundary(sync_gradients)`` and ``engine.backward`` before every
micro-batch's backward, ``engine.step`` at each sync, and ``_zero3_consolidated_16bit_state_dict``). Every
micro-batch's loss and the final weights (Accelerate's ``get_state_dict``) equal DDP's to 1e-5 relative: fp32 Adam
over 8 or 4 steps, where only the order of the gradient sums differs (all-reduce against reduce-scatter), which moves
values by a few ulps per step.

On a machine without GPU Accelerate 1.15 picks no process-group backend for DeepSpeed (``--cpu`` excludes
``--use_deepspeed``) and would count a world of 1: the loop names gloo through ``InitProcessGroupKwargs``, as a CPU user
of Accelerate with DeepSpeed does.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "hf_scripts", "accelerate_loop.py")
BIN = os.path.dirname(sys.executable)
TOL = 1e-5


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ZEROSPEED_AS_DEEPSPEED_FORCE", None)
    env.update(extra)
    return env


def _run(cmd, out, cwd, accumulation=1, **env):
    proc = subprocess.run(cmd + [SCRIPT, str(out), str(accumulation)], capture_output=True, text=True, timeout=240,
                          cwd=cwd, env=_env(**env))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(out) as f:
        return json.load(f)


def _rel(a, b):
    num = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))
    return num / max(math.sqrt(sum(y * y for y in b)), 1e-30)


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """gradient_accumulation_steps -> the DDP run (made once per module)."""
    runs = {}

    def get(accumulation):
        if accumulation not in runs:
            tmp = tmp_path_factory.mktemp(f"ddp{accumulation}")
            runs[accumulation] = _run([os.path.join(BIN, "torchrun"), "--nproc-per-node", "2"], tmp / "ddp.json", tmp,
                                      accumulation, ACCELERATE_USE_CPU="true")
        return runs[accumulation]

    return get


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage,accumulation", [(2, 1), (3, 1), (1, 2), (2, 2), (3, 2)])
def test_accelerate_launch_use_deepspeed_equals_ddp(ddp_runs, stage, accumulation, tmp_path):
    """With gradient_accumulation_steps 2 Accelerate declares each micro-batch's boundary to the engine
    (``set_gradient_accumulation_boundary(sync_gradients)``) and calls ``engine.step()`` only at its sync."""
    ddp = ddp_runs(accumulation)
    cmd = [os.path.join(BIN, "zerospeed-as-deepspeed"), os.path.join(BIN, "accelerate"), "launch", "--use_deepspeed",
           "--zero_stage", str(stage), "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--gradient_accumulation_steps", str(accumulation), "--gradient_clipping", "1.0"]
    if stage == 3:
        cmd += ["--zero3_save_16bit_model", "true"]
    ds = _run(cmd, tmp_path / "ds.json", tmp_path, accumulation)
    assert (ds["engine"], ds["distributed_type"], ds["world"], ds["clipping"]) == \
        ("ZeroSpeedEngine", "DistributedType.DEEPSPEED", 2, 1.0)
    assert ddp["engine"] == "DistributedDataParallel" and ddp["world"] == 2
    assert len(ds["losses"]) == len(ddp["losses"]) == 8
    assert max(abs(a - b) / abs(b) for a, b in zip(ds["losses"], ddp["losses"])) < TOL, (ds["losses"], ddp["losses"])
    assert set(ds["weights"]) == set(ddp["weights"])
    errors = {k: _rel(ds["weights"][k], ddp["weights"][k]) for k in ddp["weights"]}
    assert max(errors.values()) < TOL, errors
    assert ds["losses"][-1] < ds["losses"][0]  # it trained
