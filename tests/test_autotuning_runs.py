"""Autotuning end to end: real experiments (subprocesses through the launcher) on a tiny GPT.

Kept small for the suite's time: one stage, micro-batch sizes up to 2, profile steps 1..3.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from zerospeed.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "autotune_script.py"
BASE = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _launch(tmp: Path, mode: str, config: dict[str, Any], num_procs: int, *extra: str,
            timeout: float = 240) -> subprocess.CompletedProcess[str]:
    (tmp / "ds.json").write_text(json.dumps(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "zerospeed.launcher.runner", "--autotuning", mode, "--num_procs", str(num_procs),
           str(SCRIPT), "--deepspeed_config", "ds.json", *extra]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)


def _results(tmp: Path) -> dict[str, Any]:
    return json.loads((tmp / "autotuning_results" / "results.json").read_text())


@pytest.mark.timeout(420)
def test_tune_resume_and_run_at_two_processes(tmp_path: Path) -> None:
    config = {**BASE, "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": [2]},
              "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 3, "exp_timeout": 120,
                             "max_train_micro_batch_size_per_gpu": 2, "num_tuning_micro_batch_sizes": 2}}
    tuned = _launch(tmp_path, "tune", config, 2)
    assert tuned.returncode == 0, tuned.stdout[-3000:] + tuned.stderr[-3000:]
    results = _results(tmp_path)
    ok = {e["name"]: e["metrics"]["throughput"] for e in results["experiments"] if e["status"] == "ok"}
    assert len(ok) == 2  # micro-batch 2 (the largest allowed, runnable) and 1
    assert results["best"] == max(ok, key=ok.get)  # the chosen config is the best measured
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    assert load_config(optimal, dp_world_size=2).zero_optimization.stage == 2
    for name in ("cmd_optimal.txt", "summary.txt", "metric.png"):
        assert (tmp_path / "autotuning_results" / name).stat().st_size > 0
    for exp in ok:
        folder = tmp_path / "autotuning_exps" / exp
        assert {"cmd.txt", "ds_config.json", "stdout.log", "stderr.log", "metrics.json"} <= set(os.listdir(folder))
        metrics = json.loads((folder / "metrics.json").read_text())
        steps = metrics["step_times"]  # steps 2 and 3 (start_profile_step 1 is excluded), slowest rank each
        assert len(steps) == 2 and all(t > 0 for t in steps)
        assert metrics["latency"] == pytest.approx(statistics.median(steps))
        assert metrics["throughput"] == pytest.approx(metrics["train_batch_size"] / statistics.median(steps))
        # the slowest rank's total over the steps never exceeds the sum of each step's slowest rank
        assert 0 < metrics["latency_mean"] <= sum(steps) / len(steps) * 1.0001
    # an interruption during one experiment: its record is missing, so only it runs again
    interrupted = sorted(ok)[0]
    (tmp_path / "autotuning_exps" / interrupted / "result.json").unlink()
    run = _launch(tmp_path, "run", config, 2, "--steps", "4")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"{interrupted}: throughput=" in run.stdout and "(ran," in run.stdout.split(interrupted)[1][:200]
    assert "1 experiments run, 2 read back" in run.stdout  # the model-info run and the other experiment
    assert "trained 4 steps, final loss" in run.stdout  # then it trained with the winner


@pytest.mark.timeout(300)
def test_crashing_and_hanging_experiments_fail_and_the_tuner_finishes(tmp_path: Path) -> None:
    config = {**BASE, "train_micro_batch_size_per_gpu": [1, 2, 3], "zero_optimization": {"stage": 0},
              "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 3, "exp_timeout": 40,
                             "model_info": {"num_params": 15328, "activation_mem_per_sample": 1e5}}}
    out = _launch(tmp_path, "tune", config, 1, "--crash_mbs", "2", "--hang_mbs", "3")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    by_mbs = {e["candidate"]["train_micro_batch_size_per_gpu"]: e for e in _results(tmp_path)["experiments"]}
    assert by_mbs[1]["status"] == "ok"
    assert by_mbs[2]["status"] == "failed" and "injected crash at micro-batch size 2" in by_mbs[2]["reason"]
    assert by_mbs[3]["status"] == "timeout" and "killed after 40 s" in by_mbs[3]["reason"]
    assert _results(tmp_path)["best"] == by_mbs[1]["name"]
    hung_config = str(tmp_path / "autotuning_exps" / by_mbs[3]["name"] / "ds_config.json")
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if hung_config in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []


@pytest.mark.timeout(120)
def test_unrunnable_script_is_reported_from_the_model_info_run(tmp_path: Path) -> None:
    config = {**BASE, "train_micro_batch_size_per_gpu": [1], "zero_optimization": {"stage": 0},
              "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 2, "exp_timeout": 60}}
    out = _launch(tmp_path, "tune", config, 1, "--crash_mbs", "1")
    assert out.returncode == 1
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("zerospeed: autotuning: the model-info run failed, so the script is not runnable")
    assert "injected crash at micro-batch size 1" in line
