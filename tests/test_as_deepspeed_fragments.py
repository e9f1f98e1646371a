"""DeepSpeed's tensor-fragment API and ZeRO-3 leaf modules (``deepspeed.utils``), 2 gloo ranks (issue 27).

Bodies in tests/fragment_cases.py. At ZeRO stages 0-3 ``safe_get_full_grad`` equals the single-process reference
gradient (each rank's micro-batch on a plain copy, averaged: exact, so compared bit for bit); the fp32 master equals the
initial weights before the step and the live (gathered) weights after it, bit for bit; the AdamW moments after one step
equal (1 - b1) g and (1 - b2) g^2 to one rounding of the product each (rtol 2.5e-7 / 5e-7: the kernels may round
1 - b differently); every setter reads back exactly, a bad size is refused naming the parameter, and a master set takes
effect at the next step (lr 0 then leaves it bit for bit). The local API works at ZeRO-3 only: its fragments are
``ds_tensor``'s elements and join to the full value; elsewhere it raises DeepSpeed's AssertionError. A ZeRO-3 MoE block
whose experts run in a rank-dependent order, flagged with ``set_z3_leaf_modules``, is hooked only at the block and its
gradients equal the reference bit for bit (its buckets are reduce-scattered in bucket order at the end of backward,
since their gradients complete in a rank-dependent order); without the flag the ranks' divergence is reported naming
``set_z3_leaf_modules``.
"""

import pytest
import torch

from fragment_cases import (MoE, Net, Routed, fragments_body, generation_hooks_body, leaf_body, nested_init_body,
                            not_at_boundary_body)
from zerospeed.testing import DistributedTestError, run_distributed


@pytest.mark.timeout(300)
def test_fragment_api_at_every_stage_on_two_ranks():
    results = [run_distributed(fragments_body, 2, stage, timeout=240) for stage in (0, 1, 2, 3)]
    for per_rank in results:
        for r in per_rank:
            stage = r["stage"]
            assert r["frozen"] == [True, True, True], stage
            assert all(r["grad_equal"].values()), (stage, r["grad_equal"])
            assert all(r["param_equal"].values()), (stage, r["param_equal"])
            assert "exp_avg not found" in r["state_before_step"], (stage, r["state_before_step"])
            assert r["grad_set"], stage
            assert "TensorFragmentError" in r["bad_size"] and "'l2.weight'" in r["bad_size"], r["bad_size"]
            assert all(r["exp_avg_close"].values()) and all(r["exp_avg_sq_close"].values()), (stage, r)
            assert all(r["param_after_step"].values()), (stage, r["param_after_step"])
            assert r["state_set"], stage
            assert all(r["master_set_applied"].values()), (stage, r["master_set_applied"])
            if stage == 3:
                assert r["local"] == {"numel_is_ds_tensor": True, "parts_join": True, "local_set": True,
                                      "local_state_set": True, "local_grad_is_fragment": True}
            else:
                assert r["local"] == {"error": "This API is only defined for ZeRO-3 partitioned parameters"}


@pytest.mark.timeout(120)
def test_full_grad_between_micro_batches_at_zero1_is_refused():
    for msg in run_distributed(not_at_boundary_body, 2, timeout=100):
        assert "accumulation boundary" in msg and "engine.step()" in msg, msg


@pytest.mark.timeout(120)
def test_leaf_module_is_gathered_whole_and_matches_the_reference():
    results = run_distributed(leaf_body, 2, True, timeout=100)
    assert results[0]["expert_order"] != results[1]["expert_order"]  # the case leaf modules exist for
    for r in results:
        assert r["moe_hooked"] and not r["below_hooked"]
        assert r["leaves"] == ["MoE"] and r["leaves_after_unset"] == 0
        assert r["grad_equal"] and r["trained"]


@pytest.mark.timeout(120)
def test_without_the_leaf_flag_the_divergence_error_names_the_fix():
    with pytest.raises(DistributedTestError, match=r"diverged(.|\n)*set_z3_leaf_modules\(model, \[BlockClass\]\)"):
        run_distributed(leaf_body, 2, False, timeout=100)


def test_leaf_module_names():
    from zerospeed.utils import (get_z3_leaf_modules, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
                                 set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules, z3_leaf_module,
                                 z3_leaf_parameter)

    model = Routed()
    assert set_z3_leaf_modules(model, ["MoE"]) == [model.moe] and z3_leaf_module(model.moe)
    assert z3_leaf_parameter(model.moe.experts[0].w.weight) and not z3_leaf_parameter(model.inp.weight)
    assert not hasattr(model.moe, "_z3_leaf")  # kept in zerospeed's registry, not on the module
    unset_z3_leaf_modules(model, [MoE])
    assert get_z3_leaf_modules(model) == []
    found, missing = set_z3_leaf_modules_by_name(model, ["moe.experts.1", "nope"], raise_if_not_found=False)
    assert found == [model.moe.experts[1]] and missing == ["nope"]
    found, missing = set_z3_leaf_modules_by_suffix(model, ["w"])
    assert len(found) == 4 and missing == []
    with pytest.raises(ValueError, match="No modules of type"):
        set_z3_leaf_modules(Net(), [MoE])
    with pytest.raises(ValueError, match="list of types or names"):
        set_z3_leaf_modules(model, MoE)
    with pytest.raises(ValueError, match="No modules named"):
        set_z3_leaf_modules_by_name(model, ["nope"])


def test_unmanaged_parameters_read_as_deepspeed_does():
    from zerospeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_local_grad

    p = torch.nn.Parameter(torch.ones(3))
    assert safe_get_full_grad(p) is None and safe_get_full_fp32_param(p) is None
    p.grad = torch.full((3,), 2.0)
    assert safe_get_full_grad(p) is p.grad
    with pytest.raises(AssertionError, match="only defined for ZeRO-3"):
        safe_get_local_grad(p)


@pytest.mark.timeout(120)
def test_trl_generation_removes_and_restores_the_zero3_hooks():
    """trl.models.utils.remove_hooks / add_hooks (GRPO's and GKD's generation) on a zerospeed ZeRO-3 engine."""
    for r in run_distributed(generation_hooks_body, 2, timeout=100):
        assert r == {"removed": True, "reinstalled": True, "same": True, "optimizer_class": "AdamW"}, r


@pytest.mark.timeout(60)
def test_nested_zero_init_partitions_at_the_inner_exit():
    assert run_distributed(nested_init_body, 1, timeout=50) == [[True, True, True]]


def test_on_device_builds_on_the_device_and_dtype_and_restores():
    """DeepSpeed's OnDevice (its tests/unit/utils/test_init_on_device.py): parameters on 'meta' / cpu in fp16."""
    import zerospeed
    from zerospeed.utils import OnDevice

    assert zerospeed.OnDevice is OnDevice
    for device in ("meta", "cpu"):
        with OnDevice(dtype=torch.half, device=device):
            model = Net()
        assert all(p.device == torch.device(device) and p.dtype == torch.half for p in model.parameters())
    assert torch.get_default_dtype() == torch.float32 and torch.empty(1).device == torch.device("cpu")
    with OnDevice(dtype=torch.half, enabled=False):
        assert torch.empty(1).dtype == torch.float32
    with pytest.raises(ValueError, match="floating torch.dtype"):
        OnDevice(dtype=torch.int8)
