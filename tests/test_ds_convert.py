"""zerospeed-convert (issue #26): to DeepSpeed's layout and back, to HF safetensors and PyTorch DCP.

Without DeepSpeed: a DeepSpeed fixture rewritten by ``--to deepspeed`` at its own size and stage holds the
same tensors as the files DeepSpeed wrote (every fp32 partition, padded moment, module weight and
counter), and ``--from deepspeed`` gives a zerospeed checkpoint that resumes as the folder itself does.
The round trip (zerospeed saves, converts, DeepSpeed resumes, losses equal zerospeed's own resume, fp32 1e-6)
runs two ways: everywhere against ``fixtures/deepspeed/round_trip`` (made by ``make_round_trip.py``: a zerospeed
checkpoint, its converted folders and the losses DeepSpeed 0.19.8 recorded resuming them), where converting the
committed checkpoint again must give those folders tensor for tensor and zerospeed's own resume DeepSpeed's
recorded losses; and live with the bench venv's DeepSpeed (.venv-bench) from a fresh save.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_cases import merge
from ds_checkpoint_cases import FIXTURES, fsdp2_load_dcp, make_model, resave_case, resume_case, zs_config
from zerospeed.checkpoint.convert import main
from zerospeed.checkpoint.deepspeed import load_pickle
from zerospeed.checkpoint.deepspeed.writer import write_deepspeed
from zerospeed.testing import run_distributed
# tests/fixtures/deepspeed is on the path through ds_checkpoint_cases
from make_round_trip import FOLDERS, convert  # noqa: E402
from make_round_trip import deepspeed_resume as _deepspeed_resume  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_DEEPSPEED = os.path.isfile(os.path.join(ROOT, ".venv-bench", ".installed"))
#: entries DeepSpeed falls back to its own configuration for when a file lacks them (not written)
NOT_WRITTEN = {"loss_scaler", "dynamic_loss_scale", "clip_grad", "param_slice_mappings", "ds_config", "zero_stage"}


def _same(a, b, where: str) -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        for k in a:
            if k not in NOT_WRITTEN:
                assert k in b, f"{where}: {k!r} not written"
                _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


@pytest.mark.parametrize("case,stage", [("zero1_fp32", 1), ("zero2_bf16", 2), ("zero2_fp32", 2),
                                        ("zero2_fp32_groups", 2)])
def test_rewritten_deepspeed_folder_equals_deepspeeds_own(tmp_path, case: str, stage: int) -> None:
    out = write_deepspeed(os.path.join(FIXTURES, case, "ckpt"), str(tmp_path), 2, stage)
    orig = os.path.join(FIXTURES, case, "ckpt", "global_step3")
    assert sorted(os.listdir(out)) == sorted(os.listdir(orig))
    for name in os.listdir(orig):
        _same(load_pickle(os.path.join(orig, name)), load_pickle(os.path.join(out, name)), name)
    with open(os.path.join(tmp_path, "latest")) as f:
        assert f.read() == "global_step3"


@pytest.mark.parametrize("case", ["zero3_fp32", "zero3_bf16", "zero3_fp32_groups"])
def test_rewritten_zero3_folder(tmp_path, case: str) -> None:
    out = write_deepspeed(os.path.join(FIXTURES, case, "ckpt"), str(tmp_path), 2, 3)
    orig = os.path.join(FIXTURES, case, "ckpt", "global_step3")
    assert sorted(os.listdir(out)) == sorted(os.listdir(orig))
    prefix = "bf16_" if case.endswith("bf16") else ""
    groups = [[s.numel() for s in g.values()] for g in
              load_pickle(os.path.join(out, "zero_pp_rank_0_mp_rank_00_model_states.pt"))["param_shapes"]]
    for rank in (0, 1):
        name = f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        a, b = (load_pickle(os.path.join(d, name))["optimizer_state_dict"] for d in (orig, out))
        assert b["loss_scaler"].as_dict() == {"cur_scale": 1.0, "dynamic": False}  # DeepSpeed's class, read back
        flats_a, flats_b = a.pop("fp32_flat_groups"), b.pop("fp32_flat_groups")
        assert len(flats_a) == len(flats_b) == len(groups)
        for numels, fa, fb in zip(groups, flats_a, flats_b):
            # DeepSpeed leaves the padding of a rank's last partial part of each parameter uninitialised
            keep = torch.cat([torch.arange(math.ceil(n / 2)) < n - rank * math.ceil(n / 2) for n in numels])
            assert torch.equal(fa[keep], fb[keep]) and not fb[~keep].any(), name
        a.pop("loss_scaler"), b.pop("loss_scaler")
        _same(a, b, name)
        model = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        _same(load_pickle(os.path.join(orig, model)), load_pickle(os.path.join(out, model)), model)


def test_rewritten_zero0_folder(tmp_path) -> None:
    out = write_deepspeed(os.path.join(FIXTURES, "zero0_fp32", "ckpt"), str(tmp_path), 2, 0)
    a = load_pickle(os.path.join(FIXTURES, "zero0_fp32", "ckpt", "global_step3", "mp_rank_00_model_states.pt"))
    b = load_pickle(os.path.join(out, "mp_rank_00_model_states.pt"))
    # DeepSpeed's FusedAdam keeps the group's step on its last parameter only; zerospeed writes it on all
    last = max(a["optimizer"]["state"])
    assert b["optimizer"]["state"][last]["step"] == a["optimizer"]["state"][last]["step"] == 3
    for st in (a, b):
        for s in st["optimizer"]["state"].values():
            s.pop("step")
    _same(a, b, "mp_rank_00_model_states.pt")


@pytest.mark.parametrize("case", ["zero3_fp32", "zero2_fp32"])
def test_to_universal_equals_ds_to_universal(tmp_path, case: str) -> None:
    """DeepSpeed's own ds_to_universal of the zero3_fp32 fixture is zero3_fp32_universal: --to universal of the
    same run (as DeepSpeed saved it at ZeRO 3, or at ZeRO 2) writes the same tensors and records."""
    assert main(["--to", "universal", os.path.join(FIXTURES, case, "ckpt"), str(tmp_path), "--world-size", "2"]) == 0
    with open(os.path.join(tmp_path, "latest_universal")) as f:
        assert f.read() == "global_step3_universal"
    out = os.path.join(tmp_path, "global_step3_universal")
    orig = os.path.join(FIXTURES, "zero3_fp32_universal", "ckpt", "global_step3_universal")
    assert sorted(os.listdir(out)) == sorted(os.listdir(orig)) and not [n for n in os.listdir(tmp_path)
                                                                          if n.startswith(".")]
    assert sorted(os.listdir(os.path.join(out, "zero"))) == sorted(os.listdir(os.path.join(orig, "zero")))
    if case == "zero3_fp32":  # the same run: DeepSpeed's files hold the same values
        for name in os.listdir(os.path.join(orig, "zero")):
            if name.endswith(".pt"):
                continue
            for f in os.listdir(os.path.join(orig, "zero", name)):
                a, b = (load_pickle(os.path.join(d, "zero", name, f)) for d in (orig, out))
                assert a.shape == b.shape and torch.equal(a, b), (name, f)
        a, b = (load_pickle(os.path.join(d, "zero", "optimizer_state.pt")) for d in (orig, out))
        assert b["loss_scaler"].as_dict() == a["loss_scaler"].as_dict()
        a.pop("loss_scaler"), b.pop("loss_scaler")
        for flat_a, flat_b in zip(a.pop("fp32_flat_groups"), b.pop("fp32_flat_groups")):
            assert torch.equal(flat_a[:flat_b.numel()], flat_b)  # DeepSpeed's tail padding is uninitialised
        pad = a["optimizer_state_dict"]["state"][0], b["optimizer_state_dict"]["state"][0]
        for k in ("exp_avg", "exp_avg_sq"):
            n = pad[1][k].numel()
            assert torch.equal(pad[0][k][:n], pad[1][k]), k
            pad[0][k], pad[1][k] = pad[0][k][:0], pad[1][k][:0]
        for d in (a, b):
            for g in d["param_groups"] + d["optimizer_state_dict"]["param_groups"]:
                g["betas"] = list(g["betas"])
        _same(a, b, "optimizer_state.pt")
    # and zerospeed reads its own universal output back: every master and moment as DeepSpeed held them
    ref = load_file(os.path.join(FIXTURES, case, "expected.safetensors"))
    from zerospeed.checkpoint.full_tensors import FullTensors

    with FullTensors(str(tmp_path), None) as ft:
        for key, want in ref.items():
            name, kind = key.rsplit(".", 1)
            got = ft.tensor(name, torch.float32, kind=None if kind == "master" else f"optim.{kind}").reshape(-1)
            assert torch.equal(got, want.reshape(-1)), key


def test_refusals_are_one_line(tmp_path, capsys) -> None:
    src = os.path.join(FIXTURES, "zero3_bf16", "ckpt")
    with pytest.raises(SystemExit) as e:
        main(["--to", "deepspeed", src, str(tmp_path / "a"), "--zero-stage", "4"])
    assert e.value.code == 2 and "invalid choice: 4" in capsys.readouterr().err
    assert main(["--to", "deepspeed", src, str(tmp_path / "b"), "--zero-stage", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("zerospeed-convert: error: zero_stage 0 with bf16") and "\n" not in err
    assert main(["--to", "universal", src, str(tmp_path / "u"), "--zero-stage", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("zerospeed-convert: error: --zero-stage does not apply to --to universal") and "\n" not in err
    assert main(["--from", "dcp", str(tmp_path / "none"), str(tmp_path / "c")]) == 1
    assert f"DCP folder {tmp_path / 'none'} does not exist" in capsys.readouterr().err
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]


@pytest.mark.timeout(200)
def test_from_deepspeed_and_dcp_resume_in_zerospeed(tmp_path) -> None:
    zs, dcp_dir, from_dcp = str(tmp_path / "zs"), str(tmp_path / "dcp"), str(tmp_path / "from_dcp")
    assert main(["--from", "deepspeed", os.path.join(FIXTURES, "zero3_fp32", "ckpt"), zs]) == 0
    assert main(["--to", "dcp", os.path.join(FIXTURES, "zero1_bf16", "ckpt"), dcp_dir]) == 0
    assert main(["--from", "dcp", dcp_dir, from_dcp]) == 0
    cfg = zs_config(2, "fp32", 2)
    per_rank = run_distributed(_two, 2, cfg, zs, from_dcp, timeout=180)
    exp = json.load(open(os.path.join(FIXTURES, "zero3_fp32", "expected.json")))
    first = per_rank[0][0]
    assert first["losses"] == pytest.approx(exp["losses_after_resume"], rel=1e-6)
    assert first["global_steps"] == 3 and first["client"] == exp["client_state"]
    ref = load_file(os.path.join(FIXTURES, "zero3_fp32", "expected.safetensors"))
    full = merge([r[0]["state"] for r in per_rank])["full"]
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        for name, t in full[kind].items():
            assert torch.equal(t, ref[f"{name}.{kind}"].reshape(-1)), (kind, name)
    ref_bf16 = load_file(os.path.join(FIXTURES, "zero1_bf16", "expected.safetensors"))
    weights = merge([r[1]["state"] for r in per_rank])["full"]["master"]
    for name, t in weights.items():
        assert torch.equal(t, ref_bf16[f"{name}.master"].reshape(-1)), name
    # the DCP folder also loads with DCP itself into a plain model's state dict
    import torch.distributed.checkpoint as dcp

    sd = make_model(3).state_dict()
    dcp.load(sd, checkpoint_id=dcp_dir, no_dist=True)
    assert all(torch.equal(sd[n].reshape(-1), ref_bf16[f"{n}.master"].reshape(-1)) for n in weights)


@pytest.mark.timeout(300)
def test_dcp_folder_loads_into_an_fsdp2_model(tmp_path) -> None:
    """--to dcp of a DeepSpeed ZeRO-3 folder: torch.distributed.checkpoint.load fills an FSDP2 (fully_shard) model's
    sharded state dict on 2 ranks with DeepSpeed's fp32 masters, bit for bit, and the buffer."""
    dcp_dir = str(tmp_path / "dcp")
    assert main(["--to", "dcp", os.path.join(FIXTURES, "zero3_fp32", "ckpt"), dcp_dir]) == 0
    per_rank = run_distributed(fsdp2_load_dcp, 2, dcp_dir, timeout=240)
    ref = load_file(os.path.join(FIXTURES, "zero3_fp32", "expected.safetensors"))
    for full in per_rank:
        assert torch.equal(full.pop("offset"), torch.tensor([0.1, -0.2, 0.3]))
        assert sorted(full) == sorted(k[:-len(".master")] for k in ref if k.endswith(".master"))
        for name, t in full.items():
            assert torch.equal(t, ref[f"{name}.master"]), name


def _two(cfg: dict, zs: str, from_dcp: str) -> list[dict]:
    return [resume_case(cfg, zs, 4), resume_case(cfg, from_dcp, 0)]


# -- the round trip against the committed fixture (no DeepSpeed needed) -----------------------------------------
ROUND_TRIP = os.path.join(FIXTURES, "round_trip")


def _files(d: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs)


def _identical(a, b, where: str) -> None:
    """Equal as DeepSpeed reads them: same keys, same tensors (dtype, shape, bits), same values."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            _identical(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _identical(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a) is type(b), where
        _identical(vars(a), vars(b), f"{where}({type(a).__name__})")
    else:
        assert a == b and type(a) is type(b), f"{where}: {a!r} vs {b!r}"


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_round_trip_conversion_equals_the_folder_deepspeed_resumed(tmp_path, name: str) -> None:
    """Converting the committed zerospeed checkpoint again gives, file for file and tensor for tensor, the folder
    DeepSpeed 0.19.8 resumed when the fixture was made (with the losses of the test below)."""
    want = os.path.join(ROUND_TRIP, name)
    got = convert(os.path.join(ROUND_TRIP, "zs"), str(tmp_path), name)
    assert _files(got) == _files(want), name
    for rel in _files(want):
        if rel.endswith(".pt"):
            _identical(load_pickle(os.path.join(got, rel)), load_pickle(os.path.join(want, rel)), f"{name}/{rel}")
        else:
            with open(os.path.join(got, rel), "rb") as f, open(os.path.join(want, rel), "rb") as g:
                assert f.read() == g.read(), f"{name}/{rel}"


@pytest.mark.timeout(300)
def test_round_trip_zerospeed_resume_equals_deepspeeds_recorded_resumes() -> None:
    with open(os.path.join(ROUND_TRIP, "expected.json")) as f:
        exp = json.load(f)
    own = run_distributed(_own_resume, 2, os.path.join(ROUND_TRIP, "zs"), timeout=200)[0]
    assert exp["deepspeed_version"] == "0.19.8" and sorted(exp["resumes"]) == sorted(FOLDERS)
    for name, rec in exp["resumes"].items():
        assert rec["losses"] == pytest.approx(own, rel=1e-6), (name, rec["losses"], own)
        assert rec["global_steps"] == 5 + exp["steps"] and "epoch" in rec["client_keys"], name


# -- the round trip with DeepSpeed itself (.venv-bench) ------------------------------------------------------------
@pytest.mark.timeout(900)  # four DeepSpeed launches: 346 s at load ~18 on 2 cores
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs DeepSpeed 0.19.8 in .venv-bench (make bench-env); the "
                    "fixture comparisons above run without it")
def test_round_trip_deepspeed_resumes_a_zerospeed_checkpoint(tmp_path) -> None:
    zs = str(tmp_path / "zs")
    # zerospeed picks the DeepSpeed run up at ZeRO 3, trains 2 steps and saves...
    run_distributed(resave_case, 2, zs_config(3, "fp32", 2), os.path.join(FIXTURES, "zero2_fp32", "ckpt"), zs, 2,
                    timeout=120)
    # ...zerospeed's own resume from that save...
    own = run_distributed(_own_resume, 2, zs, timeout=120)
    # ...and DeepSpeed's from the converted folder, at 1 rank ZeRO 1 and 2 ranks ZeRO 3
    for world, stage in ((1, 1), (2, 3)):  # ZeRO 2 at 2 ranks: rewritten fixtures equal DeepSpeed's own files
        ds_dir = str(tmp_path / f"ds{world}")
        assert main(["--to", "deepspeed", zs, ds_dir, "--world-size", str(world), "--zero-stage", str(stage)]) == 0
        got = _deepspeed_resume(ds_dir, stage, world, 3)
        assert got["losses"] == pytest.approx(own[0], rel=1e-6), (world, stage, got["losses"], own[0])
        assert got["global_steps"] == 5 + 3 and "epoch" in got["client_keys"]
    # ...and DeepSpeed's universal load (checkpoint.load_universal) of --to universal's folder at 2 ranks, ZeRO 3
    u_dir = str(tmp_path / "universal")
    assert main(["--to", "universal", zs, u_dir, "--world-size", "2"]) == 0
    got = _deepspeed_resume(u_dir, 3, 2, 3, universal=True)
    assert got["losses"] == pytest.approx(own[0], rel=1e-6), ("universal", got["losses"], own[0])
    assert got["global_steps"] == 5 + 3


def _own_resume(zs: str) -> list[float]:
    return resume_case(zs_config(3, "fp32", 2), zs, 3)["losses"]
