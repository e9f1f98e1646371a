"""Checkpoints across tensor-parallel degrees, in the name-and-offset format (full-tensor coordinates).

World 2: train tp2 (ZeRO-1) 2 steps and save; load at tp1 x dp2 (ZeRO-2) and check the weights and
the next step (loss and weights, so the Adam moments came along) against the run that went on
from the save; save there and load back at tp2 (ZeRO-3), whose next step must equal the tp1
engine's. ``zerospeed-consolidate`` turns the tp2 checkpoint into a safetensors file that
``LlamaForCausalLM.from_pretrained`` loads; ``engine.save_16bit_model`` writes the full weights. A model of other sizes gets an error naming a
parameter. fp32 tolerance: 1e-5 relative (losses; weights in Frobenius norm).
"""
import json
import os

import pytest
import torch

from tp_cases import checkpoint_round_trips, tiny_llama
from zerospeed.checkpoint import consolidate
from zerospeed.testing import run_distributed

TOL = 1e-5


def _same(a, b, where):
    assert set(a) == set(b), where
    for k in b:
        assert float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) < TOL, f"{where}: {k}"


@pytest.mark.timeout(150)
def test_tp_checkpoint_round_trips_and_consolidates(tmp_path):
    out = run_distributed(checkpoint_round_trips, 2, str(tmp_path), timeout=140)[0]
    _same(out["tp1_loaded"], out["saved"], "tp2 -> tp1xdp2 load")
    assert abs(out["tp1_next_loss"] - out["next_loss"]) < TOL * abs(out["next_loss"])
    _same(out["tp1_next_weights"], out["next_weights"], "step after the load")
    _same(out["tp2_loaded"], out["tp1_next_weights"], "tp1xdp2 -> tp2 load")
    assert abs(out["tp2_next_loss"] - out["tp1_next_next_loss"]) < TOL * abs(out["tp1_next_next_loss"])
    assert out["mismatch"].startswith("CheckpointMismatchError: "), out["mismatch"]
    assert "model.embed_tokens.weight: checkpoint shape (64, 32), model shape (64, 48)" in out["mismatch"]

    # offline: the tp2 checkpoint -> one safetensors state dict -> HF from_pretrained
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    consolidate(str(tmp_path / "tp2"), str(hf_dir / "model.safetensors"), tag="t")
    model = tiny_llama()
    model.config.save_pretrained(hf_dir)
    import transformers as tf

    loaded = tf.LlamaForCausalLM.from_pretrained(hf_dir)
    _same({k: v for k, v in loaded.state_dict().items()}, out["saved"], "consolidated -> from_pretrained")
    from safetensors.torch import load_file

    _same(load_file(str(tmp_path / "16bit" / "model.safetensors")), out["saved"], "engine.save_16bit_model under tp")
    index = json.loads((tmp_path / "tp2" / "t" / "index.json").read_text())
    assert index["params"]["model.layers.0.self_attn.o_proj.weight"]["shape"] == [32, 32]  # full shapes
    assert index["world_size"] == 2 and len(os.listdir(tmp_path / "tp2" / "t")) == 3  # 2 rank files + index
