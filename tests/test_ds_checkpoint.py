"""DeepSpeed 0.19.8 checkpoint folders resume in zerospeed (issue #26).

The folders under tests/fixtures/deepspeed/ were written by real DeepSpeed (``make_fixtures.py``:
2 ranks, ZeRO 0-3, fp32 / bf16 / fp16) together with what DeepSpeed's *own* resume from them gave:
the losses of the next steps, and the fp32 masters and Adam moments DeepSpeed held right after its
load. zerospeed loads the same folders at world sizes 1, 2 and 4, at other stages and with the
optimizer offloaded, and must hold bit-identical masters and moments (a load copies, it computes
nothing), the same step / scheduler / counters / loss scale / client state, and (fp32) the same
next losses to 1e-6 relative: both libraries then run the same fp32 Adam on the same weights, so
they differ only by the order of a few float sums (~1e-7 here).

16-bit runs: masters and moments are checked bit for bit as well; the first loss after the resume
(a forward pass from identical weights) must agree within 28 units of roundoff of the 16-bit format
(the model is a chain of dot products of lengths 7, 13 and 5 plus a LayerNorm of 13: the classical
bound n*u per dot product sums to 25u, plus the loss's own roundings). Later 16-bit losses are not
compared: DeepSpeed runs the whole module in 16 bits and zerospeed computes some of it in fp32, and
Adam's normalised update turns a rounding difference in a small gradient into a full-size step.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_cases import merge
from ds_checkpoint_cases import FIXTURES, error_case, mismatch_case, resume_many, zs_config
from zerospeed.checkpoint.deepspeed import (DeepSpeedFileMissingError, DeepSpeedLayoutError, UnsafePickleError,
                                            load_pickle, open_folder)
from zerospeed.testing import run_distributed

#: the data-parallel folders (pipeline / tensor-parallel ones, pipe* / tp*: test_ds_checkpoint_parallel.py;
#: round_trip: test_ds_convert.py)
CASES = sorted(n for n in os.listdir(FIXTURES) if os.path.isfile(os.path.join(FIXTURES, n, "expected.json"))
               and not n.startswith(("pipe", "tp", "round_trip")))
UNIT_ROUNDOFF = {"fp32": 2.0 ** -24, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
STEPS = 4


def expected(case: str) -> dict:
    with open(os.path.join(FIXTURES, case, "expected.json")) as f:
        return json.load(f)


def check_resume(case: str, per_rank: list[dict], stage: int) -> None:
    exp = expected(case)
    out = per_rank[0]
    where = f"{case} -> zerospeed world {len(per_rank)} stage {stage}"
    # the state right after the load: bit-exact against what DeepSpeed held after its own load
    ref = load_file(os.path.join(FIXTURES, case, "expected.safetensors"))
    full = merge([o["state"] for o in per_rank])
    names = sorted({k.rsplit(".", 1)[0] for k in ref})
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        for name in names:
            got = full["full"][kind][name]
            want = ref[f"{name}.{kind}"].reshape(-1)
            assert torch.equal(got, want), f"{where}: {kind} of {name} differs (max {(got - want).abs().max()})"
    steps = {sc["step"] for sc in full["scalars"].values()}
    assert len(steps) == 1, f"{where}: Adam steps differ between parameters: {steps}"
    assert out["global_steps"] == exp["global_steps"] and out["global_samples"] == exp["global_samples"], where
    assert out["skipped_steps"] == exp["skipped_steps"], where
    assert out["lr_scheduler"] == exp["lr_scheduler"], where
    if exp["loss_scale_loaded"] is not None and exp["precision"] == "fp16":
        assert out["loss_scale"] == exp["loss_scale_loaded"], where
    assert out["client_keys"] == exp["client_state_keys"], where
    assert out["client"] == exp["client_state"] and out["client_weights"] == exp["client_weights"], where
    assert out["path"] == os.path.join(FIXTURES, case, "ckpt", exp["load_path"].split("/")[1]), where  # tag folder
    # the next steps
    got, want = out["losses"], exp["losses_after_resume"][:STEPS]
    if exp["precision"] == "fp32":
        assert got == pytest.approx(want, rel=1e-6), f"{where}: losses {got} vs DeepSpeed's own resume {want}"
    else:
        bound = 28 * UNIT_ROUNDOFF[exp["precision"]]
        assert got[0] == pytest.approx(want[0], rel=bound), f"{where}: first loss {got[0]} vs DeepSpeed's {want[0]}"


@pytest.mark.timeout(300)
def test_every_fixture_resumes_at_its_stage_on_two_ranks() -> None:
    items = []
    for case in CASES:
        exp = expected(case)
        items.append((case, zs_config(exp["stage"], exp["precision"], 2), STEPS, {}))
    per_rank = run_distributed(resume_many, 2, items, timeout=280)
    for i, (case, _, _, _) in enumerate(items):
        check_resume(case, [r[i] for r in per_rank], expected(case)["stage"])


#: (fixture, zerospeed stage, optimizer offloaded) per zerospeed world size
RESHARD = {
    1: [("zero2_fp32", 0, False), ("zero3_fp32", 2, False), ("zero0_fp32", 1, True), ("zero1_bf16", 3, False)],
    4: [("zero2_fp32", 3, False), ("zero3_fp32", 1, False), ("zero0_fp32", 2, True), ("zero3_bf16", 2, False),
        ("zero3_fp32_universal", 1, False), ("zero3_fp32_groups", 2, False), ("zero2_fp32_groups", 3, False)],
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", sorted(RESHARD))
def test_resume_at_other_world_size_stage_and_offload(world: int) -> None:
    items = [(case, zs_config(stage, expected(case)["precision"], world, offload), STEPS, {})
             for case, stage, offload in RESHARD[world]]
    per_rank = run_distributed(resume_many, world, items, timeout=220)
    for i, (case, stage, _) in enumerate(RESHARD[world]):
        check_resume(case, [r[i] for r in per_rank], stage)


@pytest.mark.timeout(200)
def test_load_options_behave_as_deepspeed() -> None:
    cfg = zs_config(2, "fp32", 2)
    items = [("zero2_fp32", cfg, 0, {"load_module_only": True}),
             ("zero3_fp32", cfg, 0, {"load_optimizer_states": False, "load_lr_scheduler_states": False}),
             ("zero0_fp32", cfg, 0, {"load_optimizer_states": False})]
    per_rank = run_distributed(resume_many, 2, items, timeout=180)
    ref = load_file(os.path.join(FIXTURES, "zero2_fp32", "expected.safetensors"))
    only = merge([r[0]["state"] for r in per_rank])
    for name, t in only["full"]["master"].items():  # weights (and so masters) from the folder...
        assert torch.equal(t, ref[f"{name}.master"].reshape(-1)), name
    assert "exp_avg" not in only["full"] and only["scalars"] == {}  # ...but no optimizer state
    first = per_rank[0][0]
    assert first["global_steps"] == 0 and first["lr_scheduler"] == {"last_batch_iteration": -1}
    # under load_module_only DeepSpeed returns its counters as client state too (the scheduler and optimizer
    # entries stay out while load_lr_scheduler_states / load_optimizer_states keep their default True)
    assert {"global_steps", "skipped_steps", "dp_world_size"} <= set(first["client_keys"])
    assert not {"module", "lr_scheduler", "optimizer"} & set(first["client_keys"])
    no_opt = per_rank[0][1]
    assert no_opt["global_steps"] == 3 and no_opt["lr_scheduler"] == {"last_batch_iteration": -1}
    assert "exp_avg" not in merge([r[1]["state"] for r in per_rank])["full"]
    assert {"lr_scheduler", "optimizer"} <= set(no_opt["client_keys"]) and "global_steps" not in no_opt["client_keys"]
    plain = per_rank[0][2]
    assert "optimizer" in plain["client_keys"] and "lr_scheduler" not in plain["client_keys"]


# -- safe loading ------------------------------------------------------------------------------------

class _Payload:
    """Unpickling this would call ``exec`` (torch.save writes its __reduce__ as a GLOBAL + REDUCE)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _copy(case: str, tmp_path) -> str:
    dst = os.path.join(tmp_path, case)
    shutil.copytree(os.path.join(FIXTURES, case, "ckpt"), dst)
    return dst


def test_planted_code_is_refused_and_never_runs(tmp_path) -> None:
    marker = os.path.join(tmp_path, "ran")
    d = _copy("zero2_fp32", tmp_path)
    target = os.path.join(d, "global_step3", "mp_rank_00_model_states.pt")
    state = torch.load(target, weights_only=False)  # the fixture is ours: build the tampered file from it
    state["note"] = _Payload(marker)
    torch.save(state, target)
    with pytest.raises(UnsafePickleError) as err:
        load_pickle(target)
    msg = str(err.value)
    assert target in msg and "builtins.exec" in msg and "\n" not in msg
    with pytest.raises(UnsafePickleError):
        open_folder(os.path.dirname(target))
    assert not os.path.exists(marker)


@pytest.mark.timeout(120)
def test_planted_code_refused_by_load_checkpoint_on_every_rank(tmp_path) -> None:
    marker = os.path.join(tmp_path, "ran")
    d = _copy("zero3_fp32", tmp_path)
    target = os.path.join(d, "global_step3", "zero_pp_rank_0_mp_rank_00_model_states.pt")
    state = torch.load(target, weights_only=False)
    state["ds_version"] = _Payload(marker)
    torch.save(state, target)
    errors = run_distributed(error_case, 2, zs_config(3, "fp32", 2), d, timeout=100)
    for e in errors:
        assert e.startswith("UnsafePickleError") and target in e and "builtins.exec" in e, e
    assert not os.path.exists(marker)


def test_deepspeed_types_map_to_plain_stand_ins() -> None:
    osd = load_pickle(os.path.join(FIXTURES, "zero2_fp32", "ckpt", "global_step3",
                                   "zero_pp_rank_0_mp_rank_00_optim_states.pt"))["optimizer_state_dict"]
    assert osd["zero_stage"] == 2 and type(osd["zero_stage"]) is int
    assert osd["loss_scaler"].as_dict() == {"cur_scale": 1.0, "dynamic": False}
    assert type(osd["loss_scaler"]).__module__.startswith("zerospeed.")


# -- bad input -------------------------------------------------------------------------------------

def test_truncated_shard(tmp_path) -> None:
    d = os.path.join(_copy("zero2_fp32", tmp_path), "global_step3")
    path = os.path.join(d, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(DeepSpeedLayoutError) as err:
        open_folder(d)
    msg = str(err.value)
    assert msg.startswith(path + ":") and "truncated" in msg and "\n" not in msg


def test_missing_rank_file(tmp_path) -> None:
    d = os.path.join(_copy("zero3_bf16", tmp_path), "global_step3")
    path = os.path.join(d, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    os.remove(path)
    with pytest.raises(DeepSpeedFileMissingError) as err:
        open_folder(d)
    msg = str(err.value)
    assert msg.startswith(f"{path} is missing") and "rank 1" in msg and "data-parallel size 2" in msg
    assert "\n" not in msg


def test_universal_folder_missing_a_parameter(tmp_path) -> None:
    d = os.path.join(_copy("zero3_fp32_universal", tmp_path), "global_step3_universal")
    shutil.rmtree(os.path.join(d, "zero", "mid.bias"))
    with pytest.raises(DeepSpeedFileMissingError) as err:
        open_folder(d)
    msg = str(err.value)
    assert msg.startswith(os.path.join(d, "zero", "mid.bias", "fp32.pt") + " is missing") and "\n" not in msg


def test_shard_of_another_world_size(tmp_path) -> None:
    d = os.path.join(_copy("zero1_fp32", tmp_path), "global_step3")
    shutil.copy(os.path.join(d, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                os.path.join(d, "zero_pp_rank_2_mp_rank_00_optim_states.pt"))
    with pytest.raises(DeepSpeedLayoutError, match="zero_pp_rank_2_mp_rank_00_optim_states.pt: a rank file beyond"):
        open_folder(d)


@pytest.mark.timeout(120)
def test_model_names_do_not_match() -> None:
    d = os.path.join(FIXTURES, "zero1_fp32", "ckpt")
    errors = run_distributed(mismatch_case, 2, zs_config(1, "fp32", 2), d, timeout=100)
    model_file = os.path.join(d, "global_step3", "mp_rank_00_model_states.pt")
    for e in errors:
        assert e.startswith("CheckpointMismatchError") and model_file in e, e
        assert "missing from the checkpoint: net.inp.bias" in e and "not in the model: inp.bias" in e, e


def test_latest_names_a_missing_tag(tmp_path) -> None:
    d = _copy("zero0_fp32", tmp_path)
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("global_step9")
    from zerospeed.checkpoint.loader import resolve
    from zerospeed.checkpoint.errors import CheckpointNotFoundError

    with pytest.raises(CheckpointNotFoundError, match="global_step9"):
        resolve(d, None)


@pytest.mark.parametrize("extra,what", [
    ("layer_01-model_00-model_states.pt", "entry 'module' is a OrderedDict, not the tensor a layer's state_dict holds"),
    ("mp_rank_01_model_states.pt", "a model-parallel rank beyond mp_world_size 1: files of two saves mixed")])
def test_stray_model_parallel_files_are_named(tmp_path, extra: str, what: str) -> None:
    """Pipeline and tensor-parallel folders are read (test_ds_checkpoint_parallel.py); a file of that kind that does
    not belong to the folder is named with what is wrong with it."""
    d = os.path.join(_copy("zero0_fp32", tmp_path), "global_step3")
    shutil.copy(os.path.join(d, "mp_rank_00_model_states.pt"), os.path.join(d, extra))
    with pytest.raises(DeepSpeedLayoutError) as err:
        open_folder(d)
    assert str(err.value) == f"{os.path.join(d, extra)}: {what}"
