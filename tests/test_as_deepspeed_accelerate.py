"""`accelerate launch --use_deepspeed` under zerospeed-as-deepspeed (issue 27): a plain Accelerate loop, unchanged.

tests/hf_scripts/accelerate_loop.py (an MLP, AdamW, gradients clipped to 1.0, fp32, 8 steps) runs three times on 2
CPU ranks: under DDP (torchrun with ACCELERATE_USE_CPU, Accelerate's multi-CPU path) and under
``zerospeed-as-deepspeed accelerate launch --use_deepspeed`` at ZeRO-2 and ZeRO-3 (Accelerate builds the DeepSpeed
config, calls ``deepspeed.initialize``, wraps the engine, calls ``engine.backward`` / ``step``,
``set_gradient_accumulation_boundary`` and ``_zero3_consolidated_16bit_state_dict``). Every step's loss and the final
weights (Accelerate's ``get_state_dict``) equal DDP's to 1e-5 relative: fp32 Adam over 8 steps, where only the order
of the gradient sums differs (all-reduce against reduce-scatter), which moves values by a few ulps per step.

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


def _run(cmd, out, cwd, **env):
    proc = subprocess.run(cmd + [SCRIPT, str(out)], capture_output=True, text=True, timeout=240, cwd=cwd,
                          env=_env(**env))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(out) as f:
        return json.load(f)


def _rel(a, b):
    num = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))
    return num / max(math.sqrt(sum(y * y for y in b)), 1e-30)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    return _run([os.path.join(BIN, "torchrun"), "--nproc-per-node", "2"], tmp / "ddp.json", tmp,
                ACCELERATE_USE_CPU="true")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_launch_use_deepspeed_equals_ddp(ddp, stage, tmp_path):
    cmd = [os.path.join(BIN, "zerospeed-as-deepspeed"), os.path.join(BIN, "accelerate"), "launch", "--use_deepspeed",
           "--zero_stage", str(stage), "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--gradient_accumulation_steps", "1", "--gradient_clipping", "1.0"]
    if stage == 3:
        cmd += ["--zero3_save_16bit_model", "true"]
    ds = _run(cmd, tmp_path / "ds.json", tmp_path)
    assert (ds["engine"], ds["distributed_type"], ds["world"], ds["clipping"]) == \
        ("ZeroSpeedEngine", "DistributedType.DEEPSPEED", 2, 1.0)
    assert ddp["engine"] == "DistributedDataParallel" and ddp["world"] == 2
    assert len(ds["losses"]) == len(ddp["losses"]) == 8
    assert max(abs(a - b) / abs(b) for a, b in zip(ds["losses"], ddp["losses"])) < TOL, (ds["losses"], ddp["losses"])
    assert set(ds["weights"]) == set(ddp["weights"])
    errors = {k: _rel(ds["weights"][k], ddp["weights"][k]) for k in ddp["weights"]}
    assert max(errors.values()) < TOL, errors
    assert ds["losses"][-1] < ds["losses"][0]  # it trained
