"""DeepSpeed 0.19.8 folders of pipeline-parallel and tensor-parallel runs resume in zerospeed (issue #26).

The fixtures were written by real DeepSpeed (``tests/fixtures/deepspeed/make_parallel_fixtures.py``, 2 ranks):

* ``pipe2_zero1_fp32``: a ``PipelineModule`` of 2 stages (ZeRO 1, fp32, 2 micro-batches per step);
* ``pipe2_zero0_fp32``: the same at ZeRO 0 (each stage's optimizer state_dict in its model file, no names);
* ``pipe2_tied_zero1_fp32``: a ``TiedLayerSpec`` used on both stages (its own forward on stage 0, a
  ``forward_fn`` on stage 1), ZeRO 1;
* ``pipe2_tp2_zero1_fp32``: 2 stages x 2 tensor-parallel ranks (Megatron-style column/row layers, 4 DeepSpeed
  ranks, ``make_pipe_tp_fixture.py``), ZeRO 1, with ``universal_checkpoint_info``'s split patterns;
* ``tp2_zero1_fp32``: AutoTP training at ``autotp_size`` 2 (ZeRO 1, fp32), ``up`` column-, ``down`` row-parallel.

Each comes with what DeepSpeed's *own* resume from it gave: the losses of the next steps and the full fp32
masters and Adam moments right after its load. zerospeed loads the folders onto other meshes (pipeline 2
stages at data-parallel 1 and 2, one stage, no pipeline at all; tensor-parallel 2 and no tensor parallelism,
other ZeRO stages, the optimizer offloaded, 1, 2 and 4 ranks). A load copies and computes nothing, so masters
and moments must be bit-identical to DeepSpeed's; both libraries then run the same fp32 Adam on the same weights
and differ only by the order of a few float sums, so the next losses agree to 1e-6 relative (as in
test_ds_checkpoint.py).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_cases import merge
from ds_checkpoint_cases import FIXTURES, pipe_resume, tp_resume
from tiny_model import pipe_config, tp_config
from zerospeed.checkpoint.deepspeed import DeepSpeedFileMissingError, DeepSpeedUnsupportedError, open_folder
from zerospeed.testing import run_distributed

pytestmark = pytest.mark.numeric
STEPS = 4
KINDS = ("master", "exp_avg", "exp_avg_sq")
#: how TPNet's parameters are split over tensor-parallel ranks (the dim its slices concatenate on)
TP_DIMS = {"up.weight": 0, "up.bias": 0, "down.weight": 1}


def expected(case: str) -> tuple[dict, dict[str, torch.Tensor]]:
    with open(os.path.join(FIXTURES, case, "expected.json")) as f:
        exp = json.load(f)
    return exp, load_file(os.path.join(FIXTURES, case, "expected.safetensors"))


def check_common(case: str, out: dict, where: str) -> None:
    exp, _ = expected(case)
    assert out["global_steps"] == exp["global_steps"] and out["global_samples"] == exp["global_samples"], where
    assert out["lr_scheduler"] == exp["lr_scheduler"], where
    assert out["client"] == exp["client_state"], where
    assert out["path"] == os.path.join(FIXTURES, case, "ckpt", exp["load_path"].split("/")[1]), where
    want = exp["losses_after_resume"][:STEPS]
    assert out["losses"] == pytest.approx(want, rel=1e-6), f"{where}: losses {out['losses']} vs DeepSpeed's {want}"


def check_full_state(case: str, full: dict, where: str) -> None:
    _, ref = expected(case)
    names = sorted({k.rsplit(".", 1)[0] for k in ref})
    assert sorted(full["master"]) == names, where
    for kind in KINDS:
        for name in names:
            got, want = full[kind][name], ref[f"{name}.{kind}"].reshape(-1)
            assert torch.equal(got, want), f"{where}: {kind} of {name} differs (max {(got - want).abs().max()})"


# -- pipeline ---------------------------------------------------------------------------------------------------
#: zerospeed world size -> [(pipeline stages, 0: plain engine on an nn.Sequential; ZeRO stage)]
PIPE = {1: [(0, 0), (1, 1)], 2: [(2, 1), (0, 3)], 4: [(2, 1)]}
#: the tied-layer pipeline (no nn.Sequential: a TiedLayerSpec needs a PipelineModule, which takes ZeRO 0 or 1)
PIPE_TIED = {1: [(1, 0)], 2: [(2, 1), (1, 1)], 4: [(2, 0)]}
#: pipeline fixtures: ZeRO 1 (optimizer files per stage), ZeRO 0 (the optimizer in each stage's model file),
#: a tied layer (TiedLayerSpec) on both stages, at ZeRO 1, and 2 stages x tensor-parallel 2 at ZeRO 1
PIPE_CASES = {"pipe2_zero1_fp32": PIPE, "pipe2_zero0_fp32": PIPE, "pipe2_tied_zero1_fp32": PIPE_TIED,
              "pipe2_tp2_zero1_fp32": PIPE}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", sorted(PIPE))
@pytest.mark.parametrize("case", sorted(PIPE_CASES))
def test_pipeline_folder_resumes_on_other_meshes(case: str, world: int) -> None:
    load_dir = os.path.join(FIXTURES, case, "ckpt")
    kind = "tied" if "tied" in case else "tp" if "tp2" in case else "plain"
    for stages, zero in PIPE_CASES[case][world]:
        dp = world // max(stages, 1)
        cfg = pipe_config(zero, "fp32", dp)
        cfg["gradient_clipping"] = expected(case)[0]["config"].get("gradient_clipping", 1.0)  # as DeepSpeed trained
        per_rank = run_distributed(pipe_resume, world, cfg, load_dir, stages, STEPS, kind, timeout=250)
        where = f"{case} -> zerospeed world {world}, {stages or 'no'} pipeline stages, ZeRO {zero}"
        check_common(case, per_rank[0], where)
        check_full_state(case, merge([r["state"] for r in per_rank])["full"], where)
        steps = {sc["step"] for r in per_rank for sc in r["state"]["scalars"].values()}
        assert steps == {3.0}, f"{where}: Adam steps {steps}"


def test_pipeline_folder_layout() -> None:
    from zerospeed.checkpoint.deepspeed.layout import DeepSpeedFolder

    folder = DeepSpeedFolder(os.path.join(FIXTURES, "pipe2_zero1_fp32", "ckpt", "global_step3"))
    index = folder.index()
    assert sorted(index.params) == sorted(f"{i}.{k}" for i, ks in ((0, "wb"), (1, "wb"), (3, "wb"), (5, "wb"))
                                          for k in ("weight" if c == "w" else "bias" for c in ks))
    assert index.data["engine"]["global_steps"] == 3 and index.world_size == 1


def _pipe_copy(tmp_path) -> str:
    d = os.path.join(tmp_path, "pipe")
    shutil.copytree(os.path.join(FIXTURES, "pipe2_zero1_fp32", "ckpt", "global_step3"), d)
    return d


def test_pipeline_folder_missing_a_layer_file(tmp_path) -> None:
    d = _pipe_copy(tmp_path)
    os.remove(os.path.join(d, "layer_03-model_states.pt"))
    with pytest.raises(DeepSpeedFileMissingError) as err:
        open_folder(d)
    msg = str(err.value)
    assert "no layer_*-model_states.pt file holds '3.weight'" in msg and "stage 1" in msg and "\n" not in msg


def test_pipeline_folder_missing_a_stage(tmp_path) -> None:
    d = _pipe_copy(tmp_path)
    os.remove(os.path.join(d, "mp_rank_01_model_states.pt"))
    with pytest.raises(DeepSpeedFileMissingError, match=r"mp_rank_01_model_states.pt is missing: .* model-parallel "
                                                        r"size 2 and rank 1's"):
        open_folder(d)


def test_pipeline_folder_layouts_of_zero0_and_tied_layers() -> None:
    from zerospeed.checkpoint.deepspeed.layout import DeepSpeedFolder

    zero0 = DeepSpeedFolder(os.path.join(FIXTURES, "pipe2_zero0_fp32", "ckpt", "global_step3")).index()
    assert sorted(zero0.params) == sorted(f"{i}.{k}" for i in (0, 1, 3, 5) for k in ("weight", "bias"))
    tied = DeepSpeedFolder(os.path.join(FIXTURES, "pipe2_tied_zero1_fp32", "ckpt", "global_step3")).index()
    assert sorted(tied.params) == ["1.bias", "1.weight", "3.bias", "3.weight", "tied_modules.proj.weight"]
    # the tied weight's masters and moments come from stage 0's optimizer shard only
    assert {s for s, *_ in tied.params["tied_modules.proj.weight"]["pieces"]} == {0}


def test_pipeline_zero0_folder_with_a_layer_missing(tmp_path) -> None:
    """At ZeRO 0 the layers are dealt to the stages by their optimizers' parameter counts: a missing layer file
    shows as a shape that does not fit the moments, or as counts that do not add up."""
    from zerospeed.checkpoint.deepspeed import DeepSpeedLayoutError

    d = os.path.join(tmp_path, "pipe0")
    shutil.copytree(os.path.join(FIXTURES, "pipe2_zero0_fp32", "ckpt", "global_step3"), d)
    os.remove(os.path.join(d, "layer_03-model_states.pt"))
    with pytest.raises(DeepSpeedLayoutError) as err:
        open_folder(d)
    msg = str(err.value)
    assert msg.startswith(os.path.join(d, "layer_05-model_states.pt") + ": 5.weight has shape [3, 5] but the "
                          "optimizer state of parameter 0 of stage 1") and "\n" not in msg
    shutil.copy(os.path.join(FIXTURES, "pipe2_zero0_fp32", "ckpt", "global_step3", "layer_03-model_states.pt"), d)
    os.remove(os.path.join(d, "layer_05-model_states.pt"))
    with pytest.raises(DeepSpeedUnsupportedError) as err:
        open_folder(d)
    msg = str(err.value)
    assert "the stages' optimizers hold [4, 4] parameters" in msg and "give [4, 2]" in msg and "\n" not in msg


def test_pipeline_tied_folder_without_the_tied_layer_file(tmp_path) -> None:
    d = os.path.join(tmp_path, "tied")
    shutil.copytree(os.path.join(FIXTURES, "pipe2_tied_zero1_fp32", "ckpt", "global_step3"), d)
    os.remove(os.path.join(d, "layer_00-model_states.pt"))
    with pytest.raises(DeepSpeedFileMissingError, match="no layer_\\*-model_states.pt file holds tied parameter "
                                                        "'tied_modules.proj.weight'"):
        open_folder(d)


def test_pipeline_tp_folder_errors(tmp_path) -> None:
    """A pipeline x tensor-parallel folder needs every rank's layer files and the client's split patterns."""
    src = os.path.join(FIXTURES, "pipe2_tp2_zero1_fp32", "ckpt", "global_step3")
    d = os.path.join(tmp_path, "missing")
    shutil.copytree(src, d)
    os.remove(os.path.join(d, "layer_03-model_01-model_states.pt"))
    with pytest.raises(DeepSpeedFileMissingError, match=r"layer_03-model_01-model_states.pt is missing: the folder's "
                                                        r"layer files are split over 2 tensor-parallel ranks"):
        open_folder(d)
    d = os.path.join(tmp_path, "no_info")
    shutil.copytree(src, d)
    for m in range(4):
        path = os.path.join(d, f"mp_rank_0{m}_model_states.pt")
        state = torch.load(path, weights_only=False)
        del state["universal_checkpoint_info"]
        torch.save(state, path)
    with pytest.raises(DeepSpeedUnsupportedError) as err:
        open_folder(d)
    msg = str(err.value)
    assert msg.startswith(os.path.join(d, "mp_rank_00_model_states.pt") + ": a pipeline x tensor-parallel DeepSpeed "
                          "folder without universal_checkpoint_info") and "\n" not in msg


# -- tensor parallel --------------------------------------------------------------------------------------------
def _tp_slice(t: torch.Tensor, name: str, rank: int, tp: int) -> torch.Tensor:
    dim = TP_DIMS.get(name)
    return (t if dim is None or tp == 1 else t.chunk(tp, dim=dim)[rank]).reshape(-1)


#: zerospeed world size -> [(tensor-parallel size, ZeRO stage, optimizer offloaded to the CPU)]
TP = {1: [(1, 0, False)], 2: [(2, 1, False), (1, 2, True)], 4: [(2, 2, False), (1, 3, False)]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", sorted(TP))
def test_tensor_parallel_folder_resumes_on_other_meshes(world: int) -> None:
    case = "tp2_zero1_fp32"
    _, ref = expected(case)
    load_dir = os.path.join(FIXTURES, case, "ckpt")
    for tp, zero, offload in TP[world]:
        dp = world // tp
        cfg = tp_config(zero, "fp32", tp, dp) if tp > 1 else pipe_config(zero, "fp32", dp)
        if tp == 1:
            cfg.update(train_micro_batch_size_per_gpu=8 // dp, gradient_accumulation_steps=1)
        if offload:
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        per_rank = run_distributed(tp_resume, world, cfg, load_dir, STEPS, timeout=250)
        where = f"{case} -> zerospeed world {world}, tensor-parallel {tp}, ZeRO {zero}, offload {offload}"
        check_common(case, per_rank[0], where)
        for t in range(tp):  # each tensor-parallel rank's slice, merged over its data-parallel replicas
            full = merge([r["state"] for r in per_rank if r["tp_rank"] == t])["full"]
            for kind in KINDS:
                for name, got in full[kind].items():
                    want = _tp_slice(ref[f"{name}.{kind}"], name, t, tp)
                    assert torch.equal(got, want), f"{where}: tp rank {t}'s {kind} of {name} differs"
            assert sorted(full["master"]) == sorted({k.rsplit(".", 1)[0] for k in ref}), where


def test_tensor_parallel_folder_needs_its_affine_map(tmp_path) -> None:
    d = os.path.join(tmp_path, "tp")
    shutil.copytree(os.path.join(FIXTURES, "tp2_zero1_fp32", "ckpt", "global_step3"), d)
    path = os.path.join(d, "mp_rank_01_model_states.pt")
    state = torch.load(path, weights_only=False)
    del state["universal_checkpoint_info"]
    torch.save(state, path)
    with pytest.raises(DeepSpeedUnsupportedError) as err:
        open_folder(d)
    msg = str(err.value)
    assert msg.startswith(path + ": a tensor-parallel DeepSpeed folder without universal_checkpoint_info.affine_map")


@pytest.mark.parametrize("case", ["pipe2_zero1_fp32", "pipe2_zero0_fp32", "pipe2_tied_zero1_fp32",
                                  "pipe2_tp2_zero1_fp32", "tp2_zero1_fp32"])
def test_zero_to_fp32_and_convert_read_the_parallel_folders(tmp_path, case: str) -> None:
    """DeepSpeed's helper names and zerospeed-convert see the full parameters of both layouts."""
    from zerospeed.checkpoint.convert import main
    from zerospeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    _, ref = expected(case)
    src = os.path.join(FIXTURES, case, "ckpt")
    sd = get_fp32_state_dict_from_zero_checkpoint(src)
    for key, want in ref.items():
        name, kind = key.rsplit(".", 1)
        if kind == "master":
            assert sd[name].shape == want.shape and torch.equal(sd[name], want), name
    # rewritten as a data-parallel DeepSpeed folder (no pipeline, no tp): the same masters
    assert main(["--to", "deepspeed", src, str(tmp_path / "ds"), "--world-size", "2", "--zero-stage", "2"]) == 0
    again = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ds"))
    assert sorted(again) == sorted(sd) and all(torch.equal(again[k], sd[k]) for k in sd)
