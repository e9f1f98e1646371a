"""Sharded ``from_pretrained`` at ZeRO-3 under zerospeed-as-deepspeed (issue 27): per-rank peak memory asserted.

tests/hf_scripts/load_sharded.py builds ``TrainingArguments(deepspeed=HF's ZeRO-3 template)`` (so
``is_deepspeed_zero3_enabled()`` routes loading through ``zero.Init``, "auto" values unresolved) and then calls
``AutoModelForCausalLM.from_pretrained`` on a saved 164 MiB Llama (12 layers of 512 x 1536, no tensor above 4 MiB), on
2 ranks under ``torchrun``.

The bound is the issue's: each rank's peak anonymous memory while loading is at most the model's bytes / world size
+ the largest tensor + a constant. The constant, 32 MiB, covers what does not scale with the model (the gloo and
Python allocations of the loading code, transformers' meta state dict); measured 18.6 MiB over model/2 for this model
and 19.6 MiB for the same model with 24 layers (328 MiB), so it does not grow with the model. A rank that ever held
the whole model would exceed the bound by about 60 MiB. The safetensors file's pages that rank 0 reads (through
mmap, page cache) are not counted: they are the file, not the process's tensors (load_sharded.py's docstring).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hf_cases import make_llama

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "hf_scripts", "load_sharded.py")
TEMPLATE = os.path.join(HERE, "hf_scripts", "ds_config_zero3.json")
BIN = os.path.dirname(sys.executable)
MIB = 2**20
CONSTANT_BYTES = 32 * MIB


@pytest.mark.timeout(300)
def test_from_pretrained_under_zero3_holds_one_shard_per_rank(tmp_path):
    model = make_llama(0, hidden_size=512, intermediate_size=1536, num_hidden_layers=12, vocab_size=2048,
                       num_attention_heads=8, num_key_value_heads=8)
    full_numel = sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp_path / "model")
    del model
    cmd = [os.path.join(BIN, "zerospeed-as-deepspeed"), os.path.join(BIN, "torchrun"), "--nproc-per-node", "2",
           SCRIPT, str(tmp_path / "model"), TEMPLATE, str(tmp_path / "load")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    for rank in range(2):
        with open(tmp_path / f"load.rank{rank}") as f:
            r = json.load(f)
        assert r["partitioned"] and r["world"] == 2
        assert r["full_numel"] == full_numel and r["local_numel"] == full_numel // 2
        bound = 4 * full_numel // 2 + 4 * r["largest_numel"] + CONSTANT_BYTES
        assert r["peak_anon_bytes"] <= bound, (rank, r["peak_anon_bytes"] / MIB, bound / MIB)
        assert bound < 4 * full_numel  # the bound is below the whole model: holding it would fail
