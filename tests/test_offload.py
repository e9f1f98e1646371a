"""Optimizer offload (``zero_optimization.offload_optimizer``) for ZeRO stages 1, 2 and 3.

Parity: every offloaded run (CPU or NVMe, ``ratio`` 1.0 or 0.5) matches the same run without
offload in losses and final weights within 1e-5 relative (fp32; observed: bit-identical, because
the CPU Adam kernel is torch's fused arithmetic), at world sizes 1 and 2; stages 1-2 also match
the single-process PyTorch reference. Then checkpoints across offload settings, the resident
memory bound with NVMe, and the failures an NVMe user meets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import offload_cases
from engine_cases import max_rel_err, reference_run
from zerospeed.testing import run_distributed

FP32_TOL = 1e-5
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def rel_losses(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_matches_run_without_offload(stage, world, tmp_path):
    results = run_distributed(offload_cases.parity_case, world, stage, str(tmp_path), timeout=220)
    ref = reference_run(2) if stage < 3 else None
    for rank, res in enumerate(results):
        base = res["none"]
        for device, ratio in offload_cases.VARIANTS:
            got = res[f"{device}-{ratio}"]
            what = f"rank {rank} {device} ratio {ratio}"
            assert rel_losses(got["losses"], base["losses"]) < FP32_TOL, what
            if got["weights"]:  # stage 3: consolidated on rank 0 only
                assert max_rel_err(got["weights"], base["weights"]) < FP32_TOL, what
            if ref is not None:
                assert rel_losses(got["losses"], ref[0]) < FP32_TOL, what
                assert max_rel_err(got["weights"], ref[1]) < FP32_TOL, what
            # the ratio really splits: all buckets at 1.0, some but not all at 0.5
            assert got["buckets"] == base["buckets"] >= 3, what
            if ratio == 1.0:
                assert got["offloaded"] == got["buckets"], what
            else:
                assert 0 < got["offloaded"] < got["buckets"], what
            mem = got["memory"]
            if device == "nvme":
                assert got["swap_files"] == ["exp_avg.swp", "exp_avg_sq.swp"], what
                assert mem["optimizer_states_nvme"] > 0 and mem["offload_buffers"] > 0, what
                if ratio == 1.0:  # nothing element-wise stays in memory
                    assert mem["optimizer_states"] == 0, what
                else:
                    assert 0 < mem["optimizer_states"] < base["memory"]["optimizer_states"], what
            else:  # host memory: the same bytes as without offload, updated by CPU Adam
                assert mem["optimizer_states"] == base["memory"]["optimizer_states"], what
                assert got["swap_folder"] is None, what
            assert not got["swap_left_after_destroy"], what
    assert os.listdir(tmp_path) == []  # every rank's swap folder (and the shared parent) removed


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_offload_matches_bf16_without(stage, tmp_path):
    """bf16 has a separate fp32 master: in host memory with cpu offload, swapped to NVMe with nvme."""
    variants = [("cpu", 1.0), ("nvme", 1.0), ("nvme", 0.5)]
    results = run_distributed(offload_cases.parity_case, 2, stage, str(tmp_path), "bf16", variants, timeout=160)
    for res in results:
        full_masters = res["none"]["memory"]["master_params"]
        assert full_masters > 0
        for device, ratio in variants:
            got = res[f"{device}-{ratio}"]
            assert rel_losses(got["losses"], res["none"]["losses"]) < FP32_TOL
            if got["weights"]:
                assert max_rel_err(got["weights"], res["none"]["weights"]) < FP32_TOL
            masters = got["memory"]["master_params"]
            if device == "cpu":
                assert masters == full_masters
            elif ratio == 1.0:
                assert masters == 0 and got["swap_files"] == ["exp_avg.swp", "exp_avg_sq.swp", "master.swp"]
            else:
                assert 0 < masters < full_masters  # the buckets left on the device optimizer keep theirs


@pytest.mark.timeout(120)
def test_gathered_parameters_edit_reaches_a_master_swapped_to_nvme(tmp_path):
    results = run_distributed(_edits, 2, str(tmp_path), timeout=100)
    for res in results:
        plain, swapped = res
        assert swapped["master_params"] == 0 < plain["master_params"]
        assert rel_losses(swapped["losses"], plain["losses"]) < FP32_TOL
        if plain["weights"]:
            assert max_rel_err(swapped["weights"], plain["weights"]) < FP32_TOL
            assert (plain["weights"]["mid.weight"] - 0.25).abs().max() < 0.05  # the edit stuck (2 small steps)


def _edits(nvme_root: str) -> list[dict]:
    return [offload_cases.gathered_edit_case(nvme_root, False), offload_cases.gathered_edit_case(nvme_root, True)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("opt_device,precision", [("cpu", "fp32"), ("nvme", "fp32"), ("nvme", "bf16")])
def test_stage3_with_parameter_and_optimizer_offload(opt_device, precision, tmp_path):
    """ZeRO-Infinity: both tiers on. The optimizer step swaps parameter shards in one bucket at a
    time (the one updated, the next one read ahead, one idle), never the whole model; under bf16
    the fp32 masters are on NVMe too."""
    results = run_distributed(offload_cases.both_offloads_case, 2, str(tmp_path), opt_device, precision,
                              timeout=160)
    for res in results:
        if precision == "bf16":
            assert res["master_params"] == 0 < res["plain"]["memory"]["master_params"]
        assert rel_losses(res["losses"], res["plain"]["losses"]) < FP32_TOL
        if res["weights"]:
            assert max_rel_err(res["weights"], res["plain"]["weights"]) < FP32_TOL
        assert res["num_shards"] >= 5 and res["reads"] > 0
        assert res["step_peak"] <= 3 * res["largest"] < res["total"], res
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage,save,loads,precision", [(2, "nvme", ["nvme", "none", "cpu"], "fp32"),
                                                        (2, "none", ["nvme"], "fp32"),
                                                        (3, "nvme", ["nvme", "none"], "fp32"),
                                                        (2, "nvme", ["nvme", "none"], "bf16"),
                                                        (3, "none", ["nvme"], "bf16")])
def test_checkpoint_round_trip_across_offload_settings(stage, save, loads, precision, tmp_path):
    (tmp_path / "nvme").mkdir()
    results = run_distributed(offload_cases.checkpoint_case, 2, stage, str(tmp_path / "nvme"),
                              str(tmp_path / "ckpt"), save, loads, precision, timeout=160)
    for res in results:
        for kind in loads:
            got = res["loaded"][kind]
            assert got["global_steps"] == 4, kind
            assert rel_losses(got["losses"], res["truth"]) < FP32_TOL, kind
            if got["weights"]:
                assert max_rel_err(got["weights"], res["truth_weights"]) < FP32_TOL, kind
    assert os.listdir(tmp_path / "nvme") == []


@pytest.mark.timeout(120)
def test_resident_memory_bound_with_nvme(tmp_path):
    """The fp32 Adam moments (134 MB) exceed the 48 MB state budget; with NVMe offload the run keeps
    only its swap buffers in memory and its peak RSS growth drops by at least the excess."""
    out = {}
    for mode in ("none", "nvme"):
        proc = subprocess.run([sys.executable, os.path.join(TESTS_DIR, "offload_cases.py"), mode, str(tmp_path)],
                              capture_output=True, text=True, timeout=100, cwd=TESTS_DIR)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    none, nvme = out["none"], out["nvme"]
    states = 8 * nvme["numel"]  # exp_avg + exp_avg_sq, fp32
    budget = offload_cases.STATE_BUDGET_BYTES
    assert states > budget
    assert none["memory"]["optimizer_states"] == states
    assert nvme["memory"]["optimizer_states"] == 0
    assert nvme["memory"]["optimizer_states_nvme"] == states
    assert nvme["memory"]["offload_buffers"] <= budget
    assert none["peak_growth"] >= states  # without offload the states are really resident
    assert nvme["peak_growth"] <= none["peak_growth"] - (states - budget), (none["peak_growth"], nvme["peak_growth"])
    assert nvme["losses"] == none["losses"]
    assert os.listdir(tmp_path) == []


# -- errors ----------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_bad_nvme_paths_and_full_disk_name_the_path(tmp_path):
    missing = str(tmp_path / "does" / "not" / "exist")
    read_only = offload_cases.read_only_dir(tmp_path)
    msgs = run_distributed(_bad_path_errors, 1, missing, read_only, str(tmp_path), timeout=50)[0]
    assert "zero_optimization.offload_optimizer.nvme_path" in msgs["missing"] and missing in msgs["missing"]
    assert "does not exist" in msgs["missing"]
    assert "zero_optimization.offload_optimizer.nvme_path" in msgs["read_only"] and read_only in msgs["read_only"]
    assert "not writable" in msgs["read_only"]
    assert "zero_optimization.offload_param.nvme_path" in msgs["param_missing"]
    full = msgs["full"]
    assert full is not None and "disk is full" in full and str(tmp_path) in full and "bytes" in full
    assert os.listdir(tmp_path) == [] or set(os.listdir(tmp_path)) == {"ro"}  # nothing half-made is left


def _bad_path_errors(missing: str, read_only: str, root: str) -> dict:
    make = offload_cases.make_config
    block = offload_cases.offload_block
    param_cfg = make(3, None)
    param_cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": missing}
    return {"missing": offload_cases.error_of(make(2, block("nvme", 1.0, missing))),
            "read_only": offload_cases.error_of(make(2, block("nvme", 1.0, read_only))),
            "param_missing": offload_cases.error_of(param_cfg),
            "full": offload_cases.full_disk_error(root)}


@pytest.mark.timeout(60)
def test_config_combinations_that_cannot_work_are_named(tmp_path):
    msgs = run_distributed(_combination_errors, 1, str(tmp_path), timeout=50)[0]
    assert "zero_optimization.offload_optimizer" in msgs["stage0"] and "stage 1, 2 or 3" in msgs["stage0"]
    assert "zero_optimization.offload_optimizer" in msgs["lamb"] and "Lamb" in msgs["lamb"]
    # SGD, Lion, Muon...: host-held, with NVMe their states are swapped (tests/test_optimizer_nvme.py): accepted
    assert msgs["sgd_nvme"] is None
    assert msgs["param_stage2"] is None  # ignored below stage 3 with a warning, as DeepSpeed (test_deepspeed_behaviours)
    assert "zero_optimization.offload_optimizer.buffer_count" in msgs["buffers"]


def _combination_errors(root: str) -> dict:
    make, block = offload_cases.make_config, offload_cases.offload_block
    stage0 = make(1, block("cpu"))
    stage0["zero_optimization"]["stage"] = 0
    lamb = make(2, block("cpu"))
    lamb["optimizer"] = {"type": "Lamb", "params": {"lr": 0.1}}
    lamb["zero_allow_untested_optimizer"] = True
    sgd = make(2, block("nvme", 1.0, root))
    sgd["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    param2 = make(2, None)
    param2["zero_optimization"]["offload_param"] = {"device": "cpu"}
    return {"stage0": offload_cases.error_of(stage0), "lamb": offload_cases.error_of(lamb),
            "sgd_nvme": offload_cases.error_of(sgd),
            "param_stage2": offload_cases.error_of(param2),
            "buffers": offload_cases.error_of(make(2, block("nvme", 1.0, root, buffer_count=0)))}


@pytest.mark.timeout(120)
def test_vanished_swap_file_fails_every_rank_and_keeps_the_checkpoint(tmp_path):
    (tmp_path / "nvme").mkdir()
    results = run_distributed(offload_cases.vanished_swap_file_case, 2, str(tmp_path / "nvme"),
                              str(tmp_path / "ckpt"), timeout=100)
    victim = results[0]["victim"]
    assert victim and victim in results[0]["error"] and "disappeared" in results[0]["error"]
    assert "rank(s) [0]" in results[1]["error"]
    for res in results:
        assert res["digest_same"] and res["loaded_matches"]
    assert os.listdir(tmp_path / "nvme") == []


@pytest.mark.timeout(60)
def test_swap_files_removed_when_the_process_exits_without_destroy(tmp_path):
    script = (
        "import sys; sys.path.insert(0, {tests!r})\n"
        "import offload_cases as oc\n"
        "engine, batch = oc.build(oc.make_config(2, oc.offload_block('nvme', 1.0, {root!r})))\n"
        "import zero3_cases; zero3_cases._train(engine, batch, 1)\n"
        "import os; print(os.listdir(engine.strategy.state.offload.swap_folder))\n"
    ).format(tests=TESTS_DIR, root=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exp_avg.swp" in proc.stdout  # the files existed while it ran
    assert os.listdir(tmp_path) == []


def test_choose_offloaded_takes_buckets_in_order_up_to_the_ratio():
    from zerospeed.zero.offload.tier import choose_offloaded

    assert choose_offloaded([10, 10, 10, 10], 1.0) == [0, 1, 2, 3]
    assert choose_offloaded([10, 10, 10, 10], 0.5) == [0, 1]
    assert choose_offloaded([10, 10, 10, 10], 0.3) == [0]  # 10 is closer to 12 than 20
    assert choose_offloaded([10, 10, 10, 10], 0.01) == [0]  # at least one
    assert choose_offloaded([], 0.5) == []
    assert choose_offloaded([100, 1, 1], 0.5) == [0]


def test_hyper_params_follow_the_optimizer_class():
    from zerospeed.ops.adam import CPUAdam
    from zerospeed.zero.offload.tier import hyper_params_of

    p = [torch.nn.Parameter(torch.zeros(3))]
    adamw = torch.optim.AdamW(p, lr=0.1, weight_decay=0.2)
    adam = torch.optim.Adam(p, lr=0.1, weight_decay=0.2)
    cpu = CPUAdam(p, lr=0.1, weight_decay=0.2, adamw_mode=False, bias_correction=False)
    assert hyper_params_of(adamw, adamw.param_groups[0]).adamw_mode is True
    assert hyper_params_of(adam, adam.param_groups[0]).adamw_mode is False
    hp = hyper_params_of(cpu, cpu.param_groups[0])
    assert (hp.adamw_mode, hp.bias_correction, hp.lr, hp.weight_decay) == (False, False, 0.1, 0.2)


def test_swap_groups_are_consecutive_sub_groups_up_to_sub_group_size():
    from zerospeed.zero.offload.swap import plan_groups

    assert plan_groups([1024, 1024, 1024, 4096, 1024], 2048) == [[0, 1], [2], [3], [4]]
    assert plan_groups([1024, 1024, 1024], 10**9) == [[0, 1, 2]]  # DeepSpeed's default: one tile
    assert plan_groups([1024, 1024], 1) == [[0], [1]]
    assert plan_groups([], 5) == []
