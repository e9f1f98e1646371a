"""TRL and PEFT under zerospeed-as-deepspeed (issue 27): unchanged TRL scripts with ``--deepspeed``, 2 CPU ranks.

tests/hf_scripts/trl_run.py is a plain TRL script (the trainer's config parsed from the command line): SFTTrainer with
a PEFT LoRA config (q_proj, v_proj), or DPOTrainer on full fine-tuning, whose reference model TRL loads itself and
wraps with ``deepspeed.initialize`` without an optimizer. The model is a saved random-init tiny Llama with a local
word-level tokenizer; fp32 (``--bf16 False``), 4 steps, lr 1e-2. DeepSpeed configs: HF's ZeRO-3 template (``"auto"``
values, CPU offload) without its scheduler section (so the Trainer's own linear schedule runs in every run), and the
same at stage 0. The DeepSpeed runs pin zerospeed's Adam kernel to torch's fused one (``ZEROSPEED_FAST_PATHS``),
the kernel the plain Trainer uses, since zerospeed otherwise picks the fastest by timing.

* SFT + LoRA: every loss at ZeRO-0 and ZeRO-3 equals the plain Trainer's (DDP) to 1e-5 relative, and the ZeRO-3
  losses equal the ZeRO-0 ones bit for bit; the saved adapter files of the ZeRO-0 and the ZeRO-3 runs are both
  byte-identical to the plain run's. This holds because every operation on the trainable LoRA parameters is the same:
  the autograd graph is the model's own at ZeRO-3 (the frozen base's buckets are released through gradient hooks on
  module inputs, not through an inserted autograd node, which changed the order autograd sums an activation's
  gradient contributions: up to 1.1e-8 off on one rank before), the two-rank gradient average is exact in both
  (a sum of two then a halving), clipping is the same norm of the same values, and the Adam kernel is pinned to
  torch's fused one (the plain Trainer's). ``merge_and_unload`` on the live model (under ``GatheredParameters`` at
  ZeRO-3) gives the plain merged model's logits to 1e-5 of their scale.
* DPO: the reference model is a partitioned ``ZeroSpeedEngine`` at ZeRO-3; every loss equals the plain Trainer's
  to 1e-5 relative. TRL's fused LM head reads ``lm_head.weight`` in the model's forward (gathered with
  ``GatheredParameters``) and its gradient reaches the partitioned parameter in backward: this is the path that
  needs zerospeed's automatic external-parameter registration.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hf_cases import make_llama

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "hf_scripts", "trl_run.py")
TEMPLATE = os.path.join(HERE, "hf_scripts", "ds_config_zero3.json")
BIN = os.path.dirname(sys.executable)
FLAGS = ["--ddp_backend", "gloo", "--use_cpu", "--per_device_train_batch_size", "2", "--max_steps", "4",
         "--logging_steps", "1", "--learning_rate", "1e-2", "--bf16", "False", "--report_to", "none",
         "--save_strategy", "no", "--seed", "0", "--max_length", "16"]
REL = 1e-5


def _save_model_and_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    make_llama(0).save_pretrained(path)
    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(60)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "pad_token": "<pad>", "unk_token": "<unk>"}, f)


def _run(tmp, mode, name, deepspeed=None):
    cmd = [os.path.join(BIN, "torchrun"), "--nproc-per-node", "2", SCRIPT, mode, str(tmp / "model"),
           str(tmp / name), "--output_dir", str(tmp / f"out-{name}")] + FLAGS
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if deepspeed is not None:
        cmd = [os.path.join(BIN, "zerospeed-as-deepspeed")] + cmd + ["--deepspeed", str(deepspeed)]
        env["ZEROSPEED_FAST_PATHS"] = "adam_kernel=fused"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    out = []
    for rank in range(2):
        with open(tmp / f"{name}.rank{rank}") as f:
            out.append(json.load(f))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl")
    _save_model_and_tokenizer(tmp / "model")
    with open(TEMPLATE) as f:
        zero3 = {k: v for k, v in json.load(f).items() if k != "scheduler"}
    zero0 = {**zero3, "zero_optimization": {"stage": 0}}
    for name, cfg in (("zero3", zero3), ("zero0", zero0)):
        with open(tmp / f"{name}.json", "w") as f:
            json.dump(cfg, f)
    return tmp, {"sft_plain": _run(tmp, "sft", "sft_plain"),
                 "sft_zero0": _run(tmp, "sft", "sft_zero0", tmp / "zero0.json"),
                 "sft_zero3": _run(tmp, "sft", "sft_zero3", tmp / "zero3.json"),
                 "dpo_plain": _run(tmp, "dpo", "dpo_plain"),
                 "dpo_zero3": _run(tmp, "dpo", "dpo_zero3", tmp / "zero3.json")}


def _close(got, want):
    return len(got) == len(want) and max(abs(a - b) / abs(b) for a, b in zip(got, want)) < REL


@pytest.mark.timeout(900)
def test_sft_with_lora_at_zero3_equals_the_plain_trainer(runs):
    tmp, r = runs
    plain = r["sft_plain"][0]
    assert plain["wrapped"] == "DistributedDataParallel" and len(plain["losses"]) == 4
    assert torch.tensor(plain["losses"]).std() > 0  # it trained
    for name, partitioned in (("sft_zero0", False), ("sft_zero3", True)):
        for rank in r[name]:
            assert rank["wrapped"] == "ZeroSpeedEngine" and rank["partitioned"] is partitioned
            assert _close(rank["losses"], plain["losses"]), (name, rank["losses"], plain["losses"])
            logits, want = torch.tensor(rank["merged_logits"]), torch.tensor(plain["merged_logits"])
            assert (logits - want).abs().max() <= REL * want.abs().max(), name


@pytest.mark.timeout(900)
def test_sft_adapter_files_are_byte_identical(runs):
    from safetensors.torch import load_file

    tmp, r = runs
    files = {n: tmp / f"sft_{n}_adapter" / "adapter_model.safetensors" for n in ("plain", "zero0", "zero3")}
    plain = load_file(files["plain"])
    assert len(plain) == 8  # lora_A, lora_B of q_proj, v_proj in 2 layers
    assert all(t.abs().max() > 0 for t in plain.values())  # lora_B moved off its zero init: it trained
    assert files["zero0"].read_bytes() == files["plain"].read_bytes()
    assert files["zero3"].read_bytes() == files["plain"].read_bytes()
    assert [rank["losses"] for rank in r["sft_zero3"]] == [rank["losses"] for rank in r["sft_zero0"]]


@pytest.mark.timeout(900)
def test_dpo_at_zero3_shards_the_reference_model_and_equals_the_plain_trainer(runs):
    _, r = runs
    plain = r["dpo_plain"][0]
    assert plain["ref_wrapped"] == "LlamaForCausalLM" and not plain["ref_partitioned"]
    assert torch.tensor(plain["losses"]).std() > 0
    for rank in r["dpo_zero3"]:
        assert rank["wrapped"] == "ZeroSpeedEngine" and rank["partitioned"]
        assert rank["ref_wrapped"] == "ZeroSpeedEngine" and rank["ref_partitioned"]
        assert _close(rank["losses"], plain["losses"]), (rank["losses"], plain["losses"])
