"""Autotuning without processes: search space, batch arithmetic, memory pruning, tuners, bisection,
and the command's bad-input lines. (The subprocess experiments are in test_autotuning_runs.py.)"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from zerospeed.autotuning import cli
from zerospeed.autotuning.autotuner import Autotuner, AutotuneError
from zerospeed.autotuning.experiment import ExperimentRunner, Result, apply_arg_mappings, replace_config_arg
from zerospeed.autotuning.memory_model import ModelInfo, predict_bytes
from zerospeed.autotuning.space import (
    GAS, MBS, OFFLOAD_OPT, OFFLOAD_PARAM, STAGE, SpaceError, candidate_name, candidates, materialize, split_space,
)
from zerospeed.autotuning.tuners import CostModelTuner, GridSearchTuner, ModelBasedTuner, RandomTuner
from zerospeed.config import ConfigError, load_config
from zerospeed.config.autotuning import AutotuningConfig

BASE = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}}}


def at_config(**kw: Any) -> AutotuningConfig:
    return load_config({"train_batch_size": 1, "autotuning": {"enabled": True, **kw}}).autotuning


# ------------------------------------------------------------------------------------------ config
def test_autotuning_section_parses_with_deepspeed_defaults() -> None:
    at = at_config()
    assert (at.fast, at.metric, at.tuner_type, at.start_profile_step, at.end_profile_step) == (
        True, "throughput", "gridsearch", 3, 5)
    assert at.overwrite is False  # resume by default (DeepSpeed: true)
    at = at_config(arg_mappings={"gradient_accumulation_steps ": "--gas"}, tuner_type="Model_Based")
    assert at.arg_mappings == {"gradient_accumulation_steps": "--gas"} and at.tuner_type == "model_based"


@pytest.mark.parametrize("section,key,words", [
    ({"metric": "speed"}, "autotuning.metric", "not one of"),
    ({"tuner_type": "bayes"}, "autotuning.tuner_type", "not one of"),
    ({"tuner_num_trails": 3}, "autotuning.tuner_num_trails", "did you mean 'tuner_num_trials'"),
    ({"start_profile_step": 5, "end_profile_step": 5}, "autotuning.end_profile_step", "greater than"),
    ({"arg_mappings": {"train_micro_batch_size_per_gpu": "mbs"}}, "autotuning.arg_mappings", "command-line flag"),
    ({"model_info": {"params": 3}}, "autotuning.model_info", "unknown key 'params'"),
    ({"max_train_micro_batch_size_per_gpu": 2, "min_train_micro_batch_size_per_gpu": 4},
     "autotuning.max_train_micro_batch_size_per_gpu", "below"),
])
def test_bad_autotuning_keys_are_one_line(section: dict[str, Any], key: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        at_config(**section)
    assert info.value.key_path == key and words in str(info.value) and "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------ space
def test_space_from_lists_all_and_auto() -> None:
    raw = {**BASE, "train_micro_batch_size_per_gpu": "auto",
           "zero_optimization": {"stage": "all", "reduce_bucket_size": [1000, 2000]}}
    space = split_space(raw, fast=True)
    assert space.stages == (0, 1, 2, 3) and space.mbs_values is None
    assert space.knobs[2]["zero_optimization.reduce_bucket_size"] == (1000, 2000)
    assert "zero_optimization" in space.base and "stage" not in space.base["zero_optimization"]
    assert space.base["optimizer"]["params"]["betas"] == [0.9, 0.95]  # a list by nature, not searched
    full = split_space({**BASE, "zero_optimization": {"stage": [1, 3]}, MBS: [2, 4]}, fast=False)
    assert full.mbs_values == (2, 4) and full.stages == (1, 3)
    assert OFFLOAD_OPT in full.knobs[1] and OFFLOAD_PARAM not in full.knobs[1] and OFFLOAD_PARAM in full.knobs[3]
    with pytest.raises(SpaceError, match="zero_optimization.stage: 5"):
        split_space({"zero_optimization": {"stage": [1, 5]}}, fast=True)


def test_candidates_keep_batch_arithmetic_and_materialize_valid_configs() -> None:
    space = split_space({**BASE, "train_batch_size": 16, "zero_optimization": {"stage": 2}}, fast=False)
    cands = candidates(space, 2, (1, 2, 3, 4), dp_world_size=2)
    assert {c[MBS] for c in cands} == {1, 2, 4}  # 16 is not divisible by 3 x 2
    assert all(c[MBS] * c[GAS] * 2 == 16 for c in cands)
    assert len(cands) == 3 * 2 * 2 * 2  # mbs x overlap_comm x reduce_bucket_size x offload_optimizer
    names = {candidate_name(c) for c in cands}
    assert len(names) == len(cands)
    for cand in cands:
        cfg = load_config(materialize(space, cand, 2), dp_world_size=2)
        assert cfg.train_batch_size == 16 and cfg.zero_optimization.stage == 2
    capped = candidates(split_space({**BASE}, fast=True), 1, (2, 8), dp_world_size=2, max_train_batch_size=8)
    assert [c[MBS] for c in capped] == [2]


def test_a_searched_key_that_does_not_apply_to_a_stage_leaves_the_default() -> None:
    # offload is searched for stages 1-3; stage 0's candidates must not keep the list in their config
    space = split_space({**BASE, MBS: [2], "zero_optimization": {
        "stage": [0, 1], "offload_optimizer": {"device": ["none", "cpu"]}}}, fast=True)
    assert OFFLOAD_OPT not in space.knobs[0] and space.knobs[1][OFFLOAD_OPT] == ("none", "cpu")
    zero = candidates(space, 0, (2,), dp_world_size=2)
    assert len(zero) == 1
    cfg = load_config(materialize(space, zero[0], 2), dp_world_size=2)
    assert cfg.zero_optimization.stage == 0 and cfg.zero_optimization.offload_optimizer.device == "none"
    ones = [load_config(materialize(space, c, 2), dp_world_size=2) for c in candidates(space, 1, (2,), 2)]
    assert sorted(c.zero_optimization.offload_optimizer.device for c in ones) == ["cpu", "none"]


def test_config_and_mapping_arguments_are_rewritten() -> None:
    assert replace_config_arg(["--x", "1", "--deepspeed_config", "a.json"], "b.json") == [
        "--x", "1", "--deepspeed_config", "b.json"]
    assert replace_config_arg(["--deepspeed=a.json"], "b.json") == ["--deepspeed=b.json"]
    assert replace_config_arg(["--lr", "3"], "b.json") == ["--lr", "3", "--deepspeed_config", "b.json"]
    mapped = apply_arg_mappings(["--per_device_train_batch_size", "1"],
                                {MBS: "--per_device_train_batch_size", GAS: "--gas"}, {MBS: 8, GAS: 2})
    assert mapped == ["--per_device_train_batch_size", "8", "--gas", "2"]


# ------------------------------------------------------------------------------------------ memory
def test_memory_prediction_follows_the_zero_formulas() -> None:
    info = ModelInfo(num_params=1_000_000, activation_mem_per_sample=1e6)
    raw = {"bf16": {"enabled": True}}
    z0 = predict_bytes(info, {STAGE: 0, MBS: 2}, raw, 4)
    z3 = predict_bytes(info, {STAGE: 3, MBS: 2}, raw, 4)
    assert z0["budgeted"] == pytest.approx(16e6 + 2e6)  # (2 + 2 + 12) bytes x Psi + activations
    assert z3["budgeted"] == pytest.approx(16e6 / 4 + 2e6)
    off = predict_bytes(info, {STAGE: 2, MBS: 1, OFFLOAD_OPT: "nvme"}, raw, 4)
    assert off["nvme"] == pytest.approx(12e6 / 4) and off["budgeted"] == pytest.approx(2e6 + 2e6 / 4 + 1e6)


class FakeRunner(ExperimentRunner):
    """Measures nothing: a candidate's throughput is a formula; some candidates crash."""

    def __init__(self, tmp: Path, throughput: Any, fails: Any = lambda c: False) -> None:
        super().__init__(exps_dir=tmp / "exps", launcher_args=["--num_procs", "2"], script="train.py",
                         user_args=["--deepspeed_config", "ds.json"], arg_mappings={}, timeout=10.0)
        self.throughput, self.fails, self.ran = throughput, fails, []

    def run(self, name: str, config: dict[str, Any], values: dict[str, Any]) -> Result:
        self.ran.append(name)
        if self.fails(values):
            result = Result(name, "failed", {}, 0.1, "exit status 1", values)
        else:
            result = Result(name, "ok", {"throughput": self.throughput(values), "peak_memory_bytes": 1}, 0.1, "",
                            values)
        (self.exps_dir / name).mkdir(parents=True, exist_ok=True)
        (self.exps_dir / name / "result.json").write_text(json.dumps(result.to_json()))
        return result


def make_tuner(tmp: Path, raw: dict[str, Any], runner: FakeRunner, budget: float = 0, **at: Any) -> Autotuner:
    cfg = at_config(model_info={"num_params": 1_000_000, "activation_mem_per_sample": 1e6}, **at)
    return Autotuner(space=split_space(raw, cfg.fast), at=cfg, runner=runner, world_size=2,
                     results_dir=tmp / "results", memory_budget=budget, log=lambda line: None)


def test_memory_pruning_skips_candidates_over_budget_and_logs_the_prediction(tmp_path: Path) -> None:
    runner = FakeRunner(tmp_path, throughput=lambda c: 10.0 * c[MBS])
    lines: list[str] = []
    # fp32 Adam: 16 B/param at stage 0 = 16 MB, stage 3 = 8 MB (2 ranks); budget 12 MB + 1 MB/sample
    tuner = make_tuner(tmp_path, {**BASE, "zero_optimization": {"stage": [0, 3]}, MBS: [1, 2]}, runner, budget=12e6)
    tuner.log = lines.append
    best = tuner.tune()
    assert all(r.candidate[STAGE] == 3 for r in tuner.results.values())
    assert best.candidate == {STAGE: 3, MBS: 2, GAS: 1}
    skipped = [line for line in lines if "skip z0_" in line]
    assert len(skipped) == 2 and "predicted 0.02 GiB per rank > memory budget 0.01 GiB" in skipped[0]
    summary = (tmp_path / "results" / "summary.txt").read_text()
    assert "skipped before running (2)" in summary


def test_impossible_space_is_one_clear_error(tmp_path: Path) -> None:
    tuner = make_tuner(tmp_path, {**BASE, "zero_optimization": {"stage": 0}, MBS: [1]},
                       FakeRunner(tmp_path, lambda c: 1.0), budget=1e6)
    with pytest.raises(AutotuneError, match="no candidate fits: 1 skipped, memory budget 0.00 GiB per rank; "
                                            "smallest prediction 0.02 GiB"):
        tuner.tune()


def test_bisection_finds_the_largest_runnable_micro_batch(tmp_path: Path) -> None:
    runner = FakeRunner(tmp_path, throughput=lambda c: float(c[MBS]), fails=lambda c: c[MBS] > 11)
    tuner = make_tuner(tmp_path, {**BASE, "zero_optimization": {"stage": 1}}, runner,
                       max_train_micro_batch_size_per_gpu=64, num_tuning_micro_batch_sizes=3)
    best = tuner.tune()
    assert tuner.largest_runnable_mbs(1) == 11
    assert best.candidate[MBS] == 11 and tuner.mbs_values(1) == (2, 5, 11)
    assert len(runner.ran) <= 2 + 6 + 2  # hi, lo, ~log2(64) probes, then the two untried sizes


def test_failed_experiments_are_recorded_and_the_search_goes_on(tmp_path: Path) -> None:
    runner = FakeRunner(tmp_path, throughput=lambda c: 100.0 - c[STAGE], fails=lambda c: c[STAGE] == 0)
    tuner = make_tuner(tmp_path, {**BASE, "zero_optimization": {"stage": [0, 1, 2]}, MBS: [4]}, runner)
    best = tuner.tune()
    statuses = {r.candidate[STAGE]: r.status for r in tuner.results.values()}
    assert statuses == {0: "failed", 1: "ok", 2: "ok"} and best.candidate[STAGE] == 1
    optimal = json.loads((tmp_path / "results" / "ds_config_optimal.json").read_text())
    assert load_config(optimal, dp_world_size=2).zero_optimization.stage == 1 and "autotuning" not in optimal
    assert (tmp_path / "results" / "metric.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rerun_reads_back_finished_experiments(tmp_path: Path) -> None:
    raw = {**BASE, "zero_optimization": {"stage": [1, 2]}, MBS: [2, 4]}
    first = FakeRunner(tmp_path, throughput=lambda c: float(c[MBS] + c[STAGE]))
    make_tuner(tmp_path, raw, first).tune()
    assert len(first.ran) == 4
    second = FakeRunner(tmp_path, throughput=lambda c: 0.0)
    tuner = make_tuner(tmp_path, raw, second)
    assert tuner.tune().candidate == {STAGE: 2, MBS: 4, GAS: 1} and second.ran == []
    third = FakeRunner(tmp_path, throughput=lambda c: float(c[MBS]))
    make_tuner(tmp_path, raw, third, overwrite=True).tune()
    assert len(third.ran) == 4


# ------------------------------------------------------------------------------------------ tuners
def _grid() -> list[dict[str, Any]]:
    return [{"a": a, "b": b, "c": c} for a in range(4) for b in range(4) for c in (0, 1)]


def _score(c: dict[str, Any]) -> float:
    return -((c["a"] - 3) ** 2) - (c["b"] - 2) ** 2 + c["c"]


@pytest.mark.parametrize("cls", [GridSearchTuner, RandomTuner, ModelBasedTuner, CostModelTuner])
def test_tuners_find_the_best_and_respect_the_trial_cap(cls: type) -> None:
    out = cls(_grid(), maximize=True, num_trials=100, early_stopping=100).search(_score)
    assert out.best == {"a": 3, "b": 2, "c": 1} and out.num_measured <= 32
    capped = cls(_grid(), maximize=True, num_trials=5, early_stopping=100).search(_score)
    assert capped.num_measured == 5


def test_early_stopping_and_minimisation() -> None:
    values = iter([5.0, 4.0, 6.0, 7.0, 8.0, 9.0])
    out = GridSearchTuner([{"i": i} for i in range(6)], maximize=False, early_stopping=2).search(
        lambda c: next(values))
    assert out.best == {"i": 1} and out.num_measured == 4 and out.stopped_early


def test_model_based_skips_non_candidates_and_failures() -> None:
    cands = [c for c in _grid() if c["a"] != 1]
    seen: list[dict[str, Any]] = []

    def evaluate(c: dict[str, Any]) -> float | None:
        seen.append(c)
        return None if c["b"] == 0 else _score(c)

    out = ModelBasedTuner(cands, maximize=True, num_trials=len(cands), early_stopping=100).search(evaluate)
    assert out.best == {"a": 3, "b": 2, "c": 1}
    assert all(c in cands for c in seen) and len(seen) == len({json.dumps(c, sort_keys=True) for c in seen})
    seen.clear()
    out = CostModelTuner(cands, maximize=True, num_trials=len(cands), early_stopping=100).search(evaluate)
    assert out.best == {"a": 3, "b": 2, "c": 1} and len(seen) == len({json.dumps(c, sort_keys=True) for c in seen})


def test_cost_model_needs_fewer_trials_than_random_order_on_a_smooth_landscape() -> None:
    # the measured, deterministic comparison: trials until the optimum is first measured, 5 seeds
    def trials_to_best(cls: type, seed: int) -> int:
        seen: list[dict[str, Any]] = []
        cls(_grid(), maximize=True, num_trials=32, early_stopping=100, seed=seed).search(
            lambda c: seen.append(c) or _score(c))
        return seen.index({"a": 3, "b": 2, "c": 1}) + 1

    cost = [trials_to_best(CostModelTuner, s) for s in range(5)]
    rand = [trials_to_best(RandomTuner, s) for s in range(5)]
    assert sum(cost) < sum(rand), (cost, rand)
    assert max(cost) <= 16, cost


# ------------------------------------------------------------------------------------------ command
def _cli(tmp_path: Path, config: Any, capsys: Any, extra: list[str] | None = None) -> tuple[int, str]:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config) if not isinstance(config, str) else config)
    script = tmp_path / "train.py"
    script.write_text("")
    argv = ["--autotuning", "tune", "--num_procs", "2", str(script), "--deepspeed_config", str(path), *(extra or [])]
    from zerospeed.launcher.runner import main

    code = main(argv)
    return code, capsys.readouterr().err


def test_command_bad_input_is_one_line(tmp_path: Path, capsys: Any) -> None:
    code, err = _cli(tmp_path, {**BASE, "autotuning": {"enabled": True, "metrics": "latency"}}, capsys)
    assert code == 2 and err.strip().count("\n") == 0
    assert "zerospeed: autotuning: zerospeed config: autotuning.metrics: unknown key; did you mean 'metric'" in err
    code, err = _cli(tmp_path, "{not json", capsys)
    assert code == 2 and "invalid JSON at line 1" in err
    code, err = _cli(tmp_path, {**BASE, "zero_optimization": {"stage": []}}, capsys)
    assert code == 2 and "zero_optimization.stage: an empty list" in err


def test_launcher_args_exclude_the_autotuning_flag() -> None:
    argv = ["--autotuning", "run", "--num_procs", "2", "train.py", "--deepspeed_config", "ds.json"]
    args = argparse.Namespace(user_args=["--deepspeed_config", "ds.json"])
    assert cli.launcher_args_of(argv, args) == ["--num_procs", "2"]
    with pytest.raises(cli.AutotuningUsageError, match="--deepspeed_config PATH"):
        cli.config_path_of(["--lr", "1"])
