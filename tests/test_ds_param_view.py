"""DeepSpeed's ZeRO-3 parameter attributes (issue 27): ``ds_id``, ``ds_numel``, ``ds_shape``, ``ds_status``,
``ds_tensor`` and ``ZeroParamStatus``, read from zerospeed's own bucket registry (2 ranks, one launch).

* A Llama built under ``zero.Init``: every parameter reports its whole size and shape (``.data`` is empty), the
  ranks' ``ds_tensor`` parts joined in rank order are the whole parameter bit for bit, ``ds_status`` is
  NOT_AVAILABLE before and after a ``GatheredParameters`` and AVAILABLE inside it; the ``ds_id`` numbers are
  unique and kept when the engine re-buckets the model; inside a module's forward its weight is AVAILABLE, after
  a training step every parameter is NOT_AVAILABLE again. A plain model's parameters have no ``ds_id``.
* PEFT: ``get_nb_trainable_parameters`` (what ``print_trainable_parameters`` prints) counts the zero.Init model
  as the plain one; ``merge_and_unload`` under ``GatheredParameters(modifier_rank=0)`` gives weights equal bit
  for bit to merging the plain model (the same arithmetic on the same values) and the same logits, and the
  merged weights stay partitioned. The merge changes the base weights (a LoRA with random B), so the test can
  fail; the logits before and after the merge agree to 1e-5 of their scale (rounding of W + BA).
"""

from __future__ import annotations

import pytest

from ds_view_cases import body, fused_head_body, outside_gather_body
from zerospeed.testing import run_distributed


@pytest.fixture(scope="module")
def launch():
    return run_distributed(body, 2, timeout=170)


@pytest.mark.timeout(180)
def test_attributes_report_full_sizes_and_status(launch):
    for r in (rank["attributes"] for rank in launch):
        assert not r["plain_has_ds_id"]
        assert r["is_parameter"] and r["class_names"] == ["Parameter"]
        for name, (ds_numel, ds_shape, numel, plain_numel, plain_shape) in r["sizes"].items():
            assert (ds_numel, ds_shape, numel) == (plain_numel, plain_shape, 0), name
        assert all(r["pieces_join"].values()), [n for n, ok in r["pieces_join"].items() if not ok]
        assert set(r["before"].values()) == {"NOT_AVAILABLE"}
        assert set(r["inside"].values()) == {"AVAILABLE"}
        assert r["inside_shapes"] == {n: s[1] for n, s in r["sizes"].items()}
        assert set(r["after"].values()) == {"NOT_AVAILABLE"}
        assert len(set(r["ids"])) == len(r["ids"]) and r["engine_ids"] == r["ids"]
        assert r["in_forward"] == "AVAILABLE" and r["after_step"] == {"NOT_AVAILABLE"}
        assert r["enum"] == (1, 2, 3)  # DeepSpeed's values
    assert launch[0]["attributes"]["ids"] == launch[1]["attributes"]["ids"]


@pytest.mark.timeout(180)
def test_peft_counts_and_merge_under_gathered_parameters(launch):
    for r in (rank["peft"] for rank in launch):
        assert r["counts"] == r["plain_counts"] and r["counts"][1] > r["counts"][0] > 0
        assert r["before_equal"], "the zero.Init PEFT model's logits differ from the plain one's"
        assert all(r["weights_equal"].values()), [n for n, ok in r["weights_equal"].items() if not ok]
        assert r["after_equal"] and r["partitioned_after"] and not r["lora_left"]
        assert r["weight_change"] > 1e-3  # the merge did change the base weights (random B), in the shards
        assert r["logit_change"] <= 1e-5 * r["scale"]  # and not the function (rounding of W + BA only)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2])
def test_parameter_gathered_inside_the_models_forward_trains_as_plain_torch(world):
    """TRL's fused LM head (issue 27): the model's forward reads ``head.weight`` under ``GatheredParameters`` without
    calling ``head``, and its autograd function gathers it again in backward. zerospeed registers it as an external
    parameter of the model (as ``GatheredParameters(fwd_module=model)`` would), so its full-size gradient lands on a
    gathered parameter and is reduce-scattered. Against plain torch on the whole batch (fp32 AdamW, no clipping):
    the mean of the ranks' losses and the final weights agree to 1e-5 relative (only the order of sums differs)."""
    for r in run_distributed(fused_head_body, world):
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], r["ref_losses"])
        assert r["max_weight_err"] < 1e-5, r["max_weight_err"]
        assert r["status_after_step"] == "NOT_AVAILABLE"


@pytest.mark.timeout(120)
def test_parameter_gathered_around_the_forward_is_named_when_backward_fails():
    """Issue 27: a parameter read outside its module's forward gets an error naming it and the fix in backward as
    well as in forward. Gathered by ``GatheredParameters`` around the engine call (so the forward succeeds) and
    released before the backward, the backward's error names it and ``register_external_parameter``; with that fix
    the same loop trains as plain torch on the whole batch (1e-5 relative, fp32 AdamW, only the order of sums
    differs)."""
    for r in run_distributed(outside_gather_body, 2, timeout=100):
        assert "GatheredParameters holding 'head.weight'" in r["error"], r["error"]
        assert "register_external_parameter(module, parameter)" in r["error"] and "original error" in r["error"]
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], r["ref_losses"])
        assert r["max_weight_err"] < 1e-5, r["max_weight_err"]
