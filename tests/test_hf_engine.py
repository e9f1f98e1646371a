"""HF models through the engine: attribute passthrough, bf16 casting, 16-bit saves and save_pretrained.

Tolerances: generation is compared token for token; logits of a folder written by save_pretrained
and loaded by ``from_pretrained`` must equal the engine's logits exactly (same weights, same dtype,
same kernels); the bf16 engine's logits must equal HF's own bf16 model's exactly (same weights and
computation), while the naive ``model.to(bf16)`` is shown to differ (inv_freq rounded).
"""

import os

import pytest
import torch

from hf_cases import batch, bf16_logits_body, passthrough_body, save_body
from zerospeed.testing import run_distributed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 3])
def test_engine_forwards_unknown_attributes_to_the_module(stage):
    for r in run_distributed(passthrough_body, 2, stage, timeout=100):
        assert torch.equal(r["generate"], r["ref_generate"])
        assert r["engine_config_type"] == "ZeroSpeedConfig"  # the engine's own config, as in DeepSpeed
        assert r["model_config_vocab"] == 96
        assert r["device"] == "cpu"
        assert r["gc_on"]
        assert r["own_names"] == (True, True, True)
        assert "no_such_attribute_xyz" in r["missing"] and "LlamaForCausalLM" in r["missing"]
        assert r["loss"] > 0


@pytest.mark.timeout(60)
def test_bf16_casts_parameters_and_keeps_rope_tables_fp32(tmp_path):
    (r,) = run_distributed(bf16_logits_body, 1, str(tmp_path), timeout=50)
    assert r["param_dtypes"] == {torch.bfloat16}
    assert r["inv_freq"] and set(r["inv_freq"].values()) == {torch.float32}
    assert r["max_diff"] == 0.0
    assert r["naive_diff"] > 0.0  # what model.to(bf16) (DeepSpeed's cast) gives: not HF's bf16 model


def _load_logits(folder, probe):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        return model(input_ids=probe).logits.float(), model


@pytest.mark.timeout(150)
@pytest.mark.parametrize("stage,precision", [(0, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")])
def test_save_16bit_model_and_save_pretrained(tmp_path, stage, precision):
    from safetensors.torch import load_file

    results = run_distributed(save_body, 2, stage, str(tmp_path), precision, timeout=130)
    r0 = results[0]
    cons = r0["consolidated"]
    assert r0["saved_bin"] and r0["saved_st"]
    for sd in (torch.load(tmp_path / "pytorch_model.bin"), load_file(tmp_path / "model16.safetensors")):
        assert set(sd) == set(cons)
        for k, v in cons.items():
            assert v.numel() > 0 and torch.equal(sd[k], v), k
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    assert cons["model.embed_tokens.weight"].dtype == dtype
    logits, model = _load_logits(tmp_path / "hf", batch(9, n=2))
    if precision == "fp32":
        assert torch.equal(logits, r0["logits"])
    else:  # from_pretrained upcasts bf16 weights to fp32: same weights, different compute dtype
        model = model.to(torch.bfloat16)
        model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.float()
        for n, p in model.named_parameters():
            assert torch.equal(p, cons[n]), n
    if stage == 3:
        for r in results:
            assert "save_pretrained(engine" in r["state_dict_error"] and "partitioned" in r["state_dict_error"]
        assert "zero" in r0["naive_error"].lower()
        assert not (tmp_path / "naive" / "model.safetensors").exists()
    else:
        assert r0["naive_error"] is None and r0["state_dict_error"] is None


def _no_gather_body(save_dir):
    import zerospeed
    from hf_cases import ds_config, make_llama

    engine, *_ = zerospeed.initialize(model=make_llama(), config=ds_config(3))
    return engine.save_16bit_model(save_dir)


@pytest.mark.timeout(60)
def test_stage3_save_16bit_model_needs_the_gather_key(tmp_path):
    assert run_distributed(_no_gather_body, 2, str(tmp_path), timeout=50) == [False, False]
    assert not list(tmp_path.iterdir())


def _bad_save_args_body(save_dir):
    import zerospeed
    from hf_cases import ds_config, make_llama
    from zerospeed.integrations.transformers import save_pretrained

    engine, *_ = zerospeed.initialize(model=make_llama(), config=ds_config(0))
    errors = []
    for call in (lambda: engine.save_16bit_model(save_dir, "a/b.bin"),
                 lambda: engine.save_16bit_model(os.path.join(save_dir, "file")),
                 lambda: save_pretrained(engine, save_dir, state_dict={}),
                 lambda: save_pretrained(object(), save_dir)):
        try:
            call()
            errors.append(None)
        except (ValueError, TypeError) as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.timeout(60)
def test_save_entry_points_refuse_bad_input(tmp_path):
    (tmp_path / "file").write_text("x")
    (errors,) = run_distributed(_bad_save_args_body, 1, str(tmp_path), timeout=50)
    assert "save_filename" in errors[0]
    assert "not a directory" in errors[1]
    assert "state_dict=" in errors[2]
    assert "zerospeed engine" in errors[3]
