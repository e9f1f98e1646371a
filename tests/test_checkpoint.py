"""Engine checkpoints: resharding across world sizes and stages, exact resume, crash safety,
integrity checks, consolidation, failures agreed by every rank, async save.

The shared checkpoint (fixture ``saved``) is written at world size 2, ZeRO stage 2, fp32, after 4
AdamW steps with a WarmupLR schedule, by a model with odd parameter sizes, a tied weight, a frozen
parameter and a buffer. Equality below is exact (``torch.equal``): a load copies bits.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import time

import pytest
import safetensors.torch
import torch

from checkpoint_cases import (async_case, bad_inputs_case, config, failing_rank_case, kill_save_target, load_case,
                              make_model, merge, readonly_case, resume_case, save_case, stage3_case)
from zerospeed.checkpoint import consolidate, consolidated_state_dict, main as consolidate_main
from zerospeed.testing import run_distributed


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ckpt") / "run")
    results = run_distributed(save_case, 2, config(2), d, 4, timeout=120)
    return d, results


def assert_same_state(ref: dict, got: dict) -> None:
    for kind, by_name in ref["full"].items():
        for name, t in by_name.items():
            assert torch.equal(t, got["full"][kind][name]), f"{kind} of {name} differs"
    assert ref["scalars"] == got["scalars"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,stage", [(1, 0), (4, 2), (2, 1)])
def test_reshard_loads_equal_state(saved, world, stage):
    d, src = saved
    ref = merge([r["state"] for r in src])
    out = run_distributed(load_case, world, config(stage), d, timeout=120)
    assert_same_state(ref, merge([r["state"] for r in out]))
    for r in out:
        assert r["path"] == os.path.join(d, "global_step4")
        assert all(torch.equal(src[0]["weights"][k], r["weights"][k]) for k in src[0]["weights"])
        assert r["lr"] == src[0]["lr"] and r["sched"] == src[0]["sched"] and r["counters"] == src[0]["counters"]
        assert r["groups"] == src[0]["groups"]
        assert r["client"]["tup"] == (1, "a") and torch.equal(r["client"]["nested"]["t"], torch.arange(5.0))
        assert r["client"]["arr"].tolist() == [0, 1, 2, 3] and r["client"]["epoch"] == 3
        # training continues identically on every replica
        assert r["next_losses"] == out[0]["next_losses"]
        assert all(torch.equal(r["after"][k], out[0]["after"][k]) for k in r["after"])


@pytest.mark.timeout(120)
def test_bf16_masters_reshard_to_stage0(tmp_path):
    d = str(tmp_path / "bf16")
    src = run_distributed(save_case, 2, config(1, "bf16"), d, 3, timeout=120)
    out = run_distributed(load_case, 1, config(0, "bf16"), d, timeout=120)
    ref = merge([r["state"] for r in src])
    assert "master" in ref["full"] and ref["full"]["master"]["mid.weight"].dtype == torch.float32
    assert_same_state(ref, merge([r["state"] for r in out]))
    # consolidation prefers the fp32 masters; bf16 output equals the bf16 weights
    _, sd32 = consolidated_state_dict(d, dtype="fp32")
    assert torch.equal(sd32["mid.weight"].reshape(-1), ref["full"]["master"]["mid.weight"])
    _, sd16 = consolidated_state_dict(d, dtype="bf16")
    assert sd16["mid.weight"].dtype == torch.bfloat16
    assert torch.equal(sd16["mid.weight"].float(), src[0]["weights"]["mid.weight"])


@pytest.mark.timeout(120)
def test_stage0_save_is_split_across_ranks_and_loads_sharded(tmp_path):
    """Stage 0 (every rank holds everything; per-parameter optimizer state) writes half the
    elements from each rank, and loads into stage 2's flat shards."""
    d = str(tmp_path / "s0")
    src = run_distributed(save_case, 2, config(0), d, 3, timeout=120)
    files = {f: safetensors.torch.load_file(os.path.join(d, "global_step3", f))
             for f in ("rank00000.safetensors", "rank00001.safetensors")}
    sizes = [sum(t.numel() for k, t in f.items() if k.startswith("b")) for f in files.values()]
    assert min(sizes) > 0 and abs(sizes[0] - sizes[1]) <= 3 * 4  # balanced up to padding, 3 kinds per bucket
    out = run_distributed(load_case, 2, config(2), d, timeout=120)
    assert_same_state(merge([src[0]["state"]]), merge([r["state"] for r in out]))


@pytest.mark.timeout(150)
def test_exact_resume_in_new_processes(tmp_path):
    """10 steps straight == 5 steps, save, new processes, load, 5 steps: losses and fp32 weights bit-identical."""
    d = str(tmp_path / "resume")
    cfg = config(2)
    straight = run_distributed(resume_case, 2, cfg, d, "straight", timeout=120)
    first = run_distributed(resume_case, 2, cfg, d, "first", timeout=120)
    second = run_distributed(resume_case, 2, cfg, d, "second", timeout=120)
    assert first[0]["losses"] + second[0]["losses"] == straight[0]["losses"]
    for a, b in zip(straight, second):
        assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
        assert a["lr"] == b["lr"]
    assert_same_state(merge([r["state"] for r in straight]), merge([r["state"] for r in second]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", ["shards", "latest", "swap"])
def test_sigkill_during_save_leaves_previous_checkpoint(tmp_path, point):
    """A save killed (SIGKILL) after writing its shards / after publishing the directory but before
    'latest' / between the two renames of a re-saved tag: 'latest' still names a complete checkpoint."""
    d, marker = str(tmp_path / "kill"), str(tmp_path / "paused")
    proc = multiprocessing.get_context("forkserver").Process(target=kill_save_target, args=(d, point, marker))
    proc.start()
    try:
        deadline = time.monotonic() + 90
        while not os.path.exists(marker) and proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(marker), f"the save never reached {point!r} (exit code {proc.exitcode})"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == -signal.SIGKILL
    assert open(os.path.join(d, "latest")).read() == "a"
    path, state = consolidated_state_dict(d)  # reads every weight, checking sizes and CRCs
    assert os.path.basename(path).startswith(".old-a-" if point == "swap" else "a")
    assert set(state) >= {"inp.weight", "aux.weight", "offset", "scale"}
    if point == "latest":  # the new directory was complete; only 'latest' had not moved yet
        consolidated_state_dict(d, tag="b")
    if point == "shards":
        assert not os.path.exists(os.path.join(d, "b"))


@pytest.mark.timeout(120)
def test_bad_inputs_give_clear_errors(saved, tmp_path):
    d, src = saved
    out = run_distributed(bad_inputs_case, 1, config(0), d, str(tmp_path), timeout=120)[0]
    def check(case, *needles):
        cls, msg, ours = out[case]
        assert ours, (case, cls, msg)
        for n in needles:
            assert n in msg, (case, msg)

    check("missing_dir", "does not exist", str(tmp_path / "nope"))
    check("unknown_tag", "global_step999", "global_step4")  # names the tags that exist
    check("latest_missing_tag", "latest", "global_step42")
    check("truncated", "rank00001.safetensors", "truncated")
    check("bitflip", "rank00000.safetensors", "CRC-32")
    check("bad_index", "index.json")
    check("missing_file", "rank00001.safetensors", "missing")
    check("bad_client_state", "client_state['f']", "builtin_function_or_method", "without pickle")
    assert out["bad_tag"][0] == "ValueError" and "../escape" in out["bad_tag"][1]
    assert out["no_latest_result"] == (None, None)  # DeepSpeed: no 'latest' -> nothing loaded, no error
    assert out["missing_dir_no_tag"] == (None, None)  # DeepSpeed too: a first attempt's directory is not there yet
    assert out["unchanged_after_failures"]
    assert out["missing_dir"][0] == "CheckpointNotFoundError"
    mo = out["module_only"]
    assert all(torch.equal(mo["weights"][k], src[0]["weights"][k]) for k in src[0]["weights"])
    assert mo["global_steps"] == 0 and mo["optimizer_state"] == 0 and mo["client"]["epoch"] == 3


@pytest.mark.timeout(60)
def test_consolidation_equals_gathered_weights(saved, tmp_path, capsys):
    d, src = saved
    out = str(tmp_path / "model.safetensors")
    assert consolidate(d, out) == out
    loaded = safetensors.torch.load_file(out)
    full = src[0]["weights"]  # every rank holds the full parameters after the stage-2 all-gather
    assert set(loaded) == set(full)  # both tied names, the frozen parameter and the buffer
    assert all(torch.equal(loaded[k], full[k]) for k in full)
    model = make_model(seed=5)
    model.load_state_dict(loaded)  # strict
    assert torch.equal(model.aux.weight, full["aux.weight"]) and model.aux.weight is model.inp.weight
    assert consolidate_main([d, str(tmp_path / "cli.safetensors"), "--dtype", "fp16", "--tag", "global_step4"]) == 0
    half = safetensors.torch.load_file(str(tmp_path / "cli.safetensors"))
    assert half["mid.weight"].dtype == torch.float16 and torch.equal(half["mid.weight"], full["mid.weight"].half())
    assert consolidate_main([str(tmp_path / "nope"), str(tmp_path / "x.safetensors")]) == 1
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_failing_rank_makes_every_rank_raise_and_publishes_nothing(tmp_path):
    d = str(tmp_path / "fail")
    out = run_distributed(failing_rank_case, 2, config(2), d, timeout=120)
    for r in out:
        assert r["raised"] and "rank 1" in r["raised"] and "No space left" in r["raised"]
        assert "rank00001.safetensors" in r["raised"] and "nothing was published" in r["raised"]
        assert r["listing"] == ["good", "latest"]  # no temporary directory left behind
        assert r["latest"] == "good"
    assert sorted(os.listdir(d)) == ["after", "good", "latest"]


@pytest.mark.timeout(60)
def test_read_only_directory_is_a_clear_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    immutable = False
    if os.geteuid() == 0:  # root ignores permission bits; an immutable directory refuses root too
        immutable = subprocess.run(["chattr", "+i", str(ro)], capture_output=True).returncode == 0
        if not immutable:
            pytest.skip("running as root without chattr: cannot make a directory read-only")
    else:
        ro.chmod(0o555)
    try:
        cls, msg = run_distributed(readonly_case, 1, config(0), str(ro), timeout=120)[0]
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(ro)])
        ro.chmod(0o755)
    assert cls == "CheckpointSaveError"
    assert str(ro) in msg and "not writable" in msg
    assert os.listdir(ro) == []


@pytest.mark.timeout(150)
def test_async_save_overlaps_training_and_loads_the_snapshot(tmp_path):
    d = str(tmp_path / "async")
    out = run_distributed(async_case, 2, config(2, async_save=True), d, timeout=120)
    for r in out:
        assert r["stats"]["path"] == os.path.join(d, "global_step3")
        assert r["overlapped"] and r["blocking_s"] < r["stats"]["total_s"]
    loaded = run_distributed(load_case, 2, config(2), d, timeout=120)
    assert_same_state(merge([r["at_save"]["state"] for r in out]), merge([r["state"] for r in loaded]))
    assert loaded[0]["client"] == {"k": 1}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("persistence", [0, 100_000], ids=["partitioned", "persistent"])
def test_stage3_save_reshards_to_every_stage_and_world(tmp_path, persistence):
    """Stage 3 through the same shard_views() interface (plus frozen_shard_views() for its sharded
    frozen parameters): saved at world 2 stage 3, loaded at world 1 stage 0, world 4 stage 2,
    world 2 stage 1 and world 2 stage 3 with no conversion step; weights, masters and optimizer
    states equal, and the loaded models then train alike (gathered / persistent parameters were
    refreshed)."""
    d = str(tmp_path / "s3")
    s3 = config(3, stage3_param_persistence_threshold=persistence)
    src = run_distributed(stage3_case, 2, s3, d, "save", timeout=120)
    ref = merge([r["state"] for r in src])
    outs = [run_distributed(stage3_case, world, cfg, d, "load", timeout=120)
            for world, cfg in ((1, config(0)), (4, config(2)), (2, config(1)), (2, s3))]
    for out in outs:
        assert_same_state(ref, merge([r["state"] for r in out]))
    out0 = outs[0]
    for out in outs[1:]:
        for a, b in zip(out0[0]["next_losses"], out[0]["next_losses"]):
            assert abs(a - b) <= 1e-5 * abs(a)
    _, sd = consolidated_state_dict(d)
    model = make_model(seed=5)
    model.load_state_dict(sd)
    assert torch.equal(model.scale, torch.linspace(0.5, 1.5, 3))  # the frozen parameter
    assert all(torch.equal(sd[k], out0[0]["weights"][k]) for k in sd)
