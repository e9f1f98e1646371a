"""HF ``Trainer`` with ``--deepspeed ds.json`` under zerospeed-as-deepspeed (issue 27): an unchanged script, 2 CPU ranks.

tests/hf_scripts/trainer_run.py parses TrainingArguments from its command line, loads a saved tiny Llama with
``from_pretrained`` and trains 6 steps. tests/hf_scripts/ds_config_zero3.json is HF's ZeRO-3 template (every
"auto" value, optimizer and parameter offload to CPU, WarmupLR), and ``--warmup_steps`` is left at 0.

* Full template: the model is partitioned while it loads (``from_pretrained`` inside ``zero.Init``, through
  ``HfDeepSpeedConfig``), the Trainer wraps a ``ZeroSpeedEngine``, and the first loss (before any update) equals the
  plain Trainer's, so the sharded loading loaded the saved weights. Later losses follow DeepSpeed's WarmupLR
  (``warmup_num_steps`` "auto" = max(1, warmup_steps 0), clamped to 2: lr 0 at the first two updates), which no HF
  scheduler type reproduces: every loss equals the plain Trainer given that schedule as a LambdaLR
  (REFERENCE_WARMUP_LR_STEPS=2, read by the script's reference path only) to 1e-5 relative.
* The same template without its ``scheduler`` section (HF's documented way to keep the Trainer's own scheduler,
  here linear with no warmup): every step's loss equals the plain Trainer (DDP on gloo) to 1e-5 relative (fp32 Adam,
  6 steps; only the order of gradient sums differs).
* The same without the scheduler section and with ``--gradient_accumulation_steps 2``, against the plain Trainer with
  that flag (the engine's window is declared by Accelerate's ``set_gradient_accumulation_boundary``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from hf_cases import make_llama

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "hf_scripts", "trainer_run.py")
TEMPLATE = os.path.join(HERE, "hf_scripts", "ds_config_zero3.json")
BIN = os.path.dirname(sys.executable)
GAS2 = ["--gradient_accumulation_steps", "2"]
FLAGS = ["--ddp_backend", "gloo", "--use_cpu", "--per_device_train_batch_size", "2", "--max_steps", "6",
         "--logging_steps", "1", "--learning_rate", "1e-3", "--report_to", "none", "--save_strategy", "no",
         "--seed", "0"]


def _train(tmp, name, model_dir, deepspeed=None, flags=(), **extra_env):
    cmd = [os.path.join(BIN, "torchrun"), "--nproc-per-node", "2", SCRIPT, str(model_dir), str(tmp / name),
           "--output_dir", str(tmp / f"out-{name}")] + FLAGS + list(flags)
    if deepspeed is not None:
        cmd = [os.path.join(BIN, "zerospeed-as-deepspeed")] + cmd + ["--deepspeed", str(deepspeed)]
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra_env)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    out = []
    for rank in range(2):
        with open(tmp / f"{name}.rank{rank}") as f:
            out.append(json.load(f))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer")
    model_dir = tmp / "model"
    make_llama(0).save_pretrained(model_dir)
    with open(TEMPLATE) as f:
        template = json.load(f)
    no_scheduler = {k: v for k, v in template.items() if k != "scheduler"}
    with open(tmp / "no_scheduler.json", "w") as f:
        json.dump(no_scheduler, f)
    return {"plain": _train(tmp, "plain", model_dir),
            "plain_warmup_lr": _train(tmp, "plain_warmup_lr", model_dir, REFERENCE_WARMUP_LR_STEPS="2"),
            "template": _train(tmp, "template", model_dir, TEMPLATE),
            "no_scheduler": _train(tmp, "no_scheduler", model_dir, tmp / "no_scheduler.json"),
            "plain_gas2": _train(tmp, "plain_gas2", model_dir, flags=GAS2),
            "no_scheduler_gas2": _train(tmp, "no_scheduler_gas2", model_dir, tmp / "no_scheduler.json", flags=GAS2)}


@pytest.mark.timeout(900)
def test_trainer_with_hf_zero3_template_loads_sharded_and_trains(runs):
    plain = runs["plain"][0]
    for r in runs["template"]:
        assert r["partitioned_at_load"] and r["wrapped"] == "ZeroSpeedEngine" and r["world"] == 2
        assert len(r["losses"]) == 6 and all(math.isfinite(x) for x in r["losses"])
        assert abs(r["losses"][0] - plain["losses"][0]) <= 1e-6 * plain["losses"][0]
    assert not plain["partitioned_at_load"] and plain["wrapped"] == "DistributedDataParallel"


@pytest.mark.timeout(900)
def test_trainer_with_hf_zero3_template_equals_the_plain_trainer_with_deepspeeds_warmup(runs):
    reference = runs["plain_warmup_lr"][0]["losses"]
    assert len(reference) == 6 and reference[1] != runs["plain"][0]["losses"][1]  # the schedule differs from HF's
    for r in runs["template"]:
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], reference)) < 1e-5, (r["losses"], reference)


@pytest.mark.timeout(900)
def test_trainer_losses_equal_the_plain_trainer(runs):
    plain = runs["plain"][0]["losses"]
    for r in runs["no_scheduler"]:
        assert r["partitioned_at_load"] and r["wrapped"] == "ZeroSpeedEngine"
        assert len(r["losses"]) == len(plain) == 6
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], plain)) < 1e-5, (r["losses"], plain)
    assert torch.tensor(plain).std() > 0  # the model trained: the losses move


@pytest.mark.timeout(900)
def test_trainer_with_gradient_accumulation_equals_the_plain_trainer(runs):
    """--gradient_accumulation_steps 2: the Trainer declares each micro-batch's boundary to the engine through
    Accelerate (engine.set_gradient_accumulation_boundary) and steps it at each sync only; every logged loss (the mean
    over a window) equals the plain Trainer's with the same flag to 1e-5 relative."""
    plain = runs["plain_gas2"][0]["losses"]
    assert len(plain) == 6 and plain != runs["plain"][0]["losses"]  # 6 optimizer steps of 2 micro-batches each
    for r in runs["no_scheduler_gas2"]:
        assert r["wrapped"] == "ZeroSpeedEngine" and len(r["losses"]) == 6
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], plain)) < 1e-5, (r["losses"], plain)
