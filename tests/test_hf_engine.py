"""HF models through the engine: attribute passthrough, bf16 casting, 16-bit saves and save_pretrained.

Tolerances: generation is compared token for token; logits of a folder written by save_pretrained
and loaded by ``from_pretrained`` must equal the engine's logits exactly (same weights, same dtype,
same kernels); the bf16 engine's logits must equal HF's own bf16 model's exactly (same weights and
computation), while the naive ``model.to(bf16)`` is shown to differ (inv_freq rounded).
"""

import pytest
import torch

from hf_cases import batch, passthrough_body, save_body, world1_body
from zerospeed.testing import run_distributed


@pytest.mark.timeout(120)
def test_engine_forwards_unknown_attributes_to_the_module():
    for r in (rank[stage] for rank in run_distributed(passthrough_body, 2, [0, 3], timeout=100) for stage in (0, 3)):
        assert torch.equal(r["generate"], r["ref_generate"])
        assert r["engine_config_type"] == "ZeroSpeedConfig"  # the engine's own config, as in DeepSpeed
        assert r["model_config_vocab"] == 96
        assert r["device"] == "cpu"
        assert r["gc_on"]
        assert r["own_names"] == (True, True, True)
        assert "no_such_attribute_xyz" in r["missing"] and "LlamaForCausalLM" in r["missing"]
        assert r["loss"] > 0


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    """One world-1 launch for the bf16 and the bad-input checks (starting ranks is the slow part)."""
    save_dir, bad_dir = tmp_path_factory.mktemp("bf16"), tmp_path_factory.mktemp("bad")
    (bad_dir / "file").write_text("x")
    (r,) = run_distributed(world1_body, 1, str(save_dir), str(bad_dir), timeout=80)
    return r


@pytest.mark.timeout(90)
def test_bf16_casts_parameters_and_keeps_rope_tables_fp32(world1):
    r = world1["bf16"]
    assert r["param_dtypes"] == {torch.bfloat16}
    assert r["inv_freq"] and set(r["inv_freq"].values()) == {torch.float32}
    assert r["max_diff"] == 0.0
    assert r["naive_diff"] > 0.0  # what model.to(bf16) (DeepSpeed's cast) gives: not HF's bf16 model


def _load_logits(folder, probe):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        return model(input_ids=probe).logits.float(), model


SAVE_CASES = [(0, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")]


@pytest.mark.timeout(150)
def test_save_16bit_model_and_save_pretrained(tmp_path):
    from safetensors.torch import load_file

    results = run_distributed(save_body, 2, str(tmp_path), SAVE_CASES, timeout=140)
    for stage, precision in SAVE_CASES:
        folder = tmp_path / f"{stage}-{precision}"
        r0 = results[0][(stage, precision)]
        cons = r0["consolidated"]
        assert r0["saved_bin"] and r0["saved_st"]
        for sd in (torch.load(folder / "pytorch_model.bin"), load_file(folder / "model16.safetensors")):
            assert set(sd) == set(cons)
            for k, v in cons.items():
                assert v.numel() > 0 and torch.equal(sd[k], v), (stage, precision, k)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        assert cons["model.embed_tokens.weight"].dtype == dtype
        logits, model = _load_logits(folder / "hf", batch(9, n=2))
        if precision == "fp32":
            assert torch.equal(logits, r0["logits"])
        else:  # from_pretrained upcasts the bf16 file to fp32: same weights, different compute dtype
            for n, p in model.to(torch.bfloat16).named_parameters():
                assert torch.equal(p, cons[n]), n
        if stage == 3:
            for rank in results:
                err = rank[(stage, precision)]["state_dict_error"]
                assert "save_pretrained(engine" in err and "partitioned" in err
            assert "zero" in r0["naive_error"].lower()
            assert not (folder / "naive" / "model.safetensors").exists()
        else:
            assert r0["naive_error"] is None and r0["state_dict_error"] is None
    # stage 3 without stage3_gather_16bit_weights_on_model_save: nothing written, False (DeepSpeed's contract)
    assert [r["no_gather"] for r in results] == [False, False]
    assert not (tmp_path / "no_gather").exists()


@pytest.mark.timeout(90)
def test_save_entry_points_refuse_bad_input(world1):
    errors = world1["bad_input"]
    assert "save_filename" in errors[0]
    assert "not a directory" in errors[1]
    assert "state_dict=" in errors[2]
    assert "zerospeed engine" in errors[3]
