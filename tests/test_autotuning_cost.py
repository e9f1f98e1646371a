"""Issue #33: autotuning's cost is bounded and its reports say why.

* ``autotuning.max_seconds``: no experiment starts once the time used plus a typical experiment would pass it;
  the best config measured so far wins (a fake clock: each fake experiment takes 10 s);
* the estimate line printed before the search;
* the largest micro-batch tells the dataset running out (``ended_early``) apart from a failure;
* a failed experiment's reason is the script's exception (through the launcher's summary), and a script that
  ends before ``end_profile_step`` is ``ended_early`` (real launcher runs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from test_autotuning import BASE, FakeRunner, make_tuner
from zerospeed.autotuning.autotuner import AutotuneError
from zerospeed.autotuning.experiment import ExperimentRunner, Result, launcher_summary
from zerospeed.autotuning.space import MBS, STAGE


class ClockedRunner(FakeRunner):
    """Each experiment takes ``seconds`` on a fake clock; candidates in ``ended`` run out of data."""

    def __init__(self, tmp: Path, throughput: Any, seconds: float = 10.0, ended: Any = lambda c: False,
                 fails: Any = lambda c: False) -> None:
        super().__init__(tmp, throughput, fails)
        self.now, self.seconds, self.ended = 0.0, seconds, ended

    def run(self, name: str, config: dict[str, Any], values: dict[str, Any]) -> Result:
        self.now += self.seconds
        if self.ended(values):
            self.ran.append(name)
            return Result(name, "ended_early", {}, self.seconds, "the script ended before end_profile_step", values)
        result = super().run(name, config, values)
        result.elapsed = self.seconds
        return result


def test_max_seconds_stops_starting_experiments_and_keeps_the_best(tmp_path: Path) -> None:
    runner = ClockedRunner(tmp_path, throughput=lambda c: float(c[MBS]))
    lines: list[str] = []
    tuner = make_tuner(tmp_path, {**BASE, "zero_optimization": {"stage": 1}, MBS: [1, 2, 3, 4, 5, 6]}, runner,
                       max_seconds=35)
    tuner.clock, tuner.log = (lambda: runner.now), lines.append
    best = tuner.tune()
    assert len(runner.ran) == 3  # at 0, 10 and 20 s; at 30 s a 10 s experiment would end past 35 s
    assert best.candidate[MBS] == max(tuner.results[n].candidate[MBS] for n in runner.ran)
    assert any(line.startswith("[autotuning] stopped: autotuning.max_seconds 35 s: 30 s used") for line in lines)
    assert json.loads((tmp_path / "results" / "results.json").read_text())["best"] == best.name
    estimate = next(line for line in lines if line.startswith("[autotuning] estimate: "))
    assert "up to 6 experiments (0 micro-batch probes + 6 candidates" in estimate
    assert "autotuning.max_seconds 35 s" in estimate


def test_max_seconds_with_nothing_measured_is_one_error(tmp_path: Path) -> None:
    runner = ClockedRunner(tmp_path, throughput=lambda c: 1.0, fails=lambda c: True)
    tuner = make_tuner(tmp_path, {**BASE, "zero_optimization": {"stage": 1}, MBS: [1, 2, 3, 4]}, runner,
                       max_seconds=15)
    tuner.clock = lambda: runner.now
    with pytest.raises(AutotuneError, match=r"max_seconds 15 s: 10 s used .* no experiment succeeded before that "
                                            r"\(1 measured\)"):
        tuner.tune()


def test_largest_micro_batch_says_when_the_data_ran_out(tmp_path: Path) -> None:
    runner = ClockedRunner(tmp_path, throughput=lambda c: float(c[MBS]), ended=lambda c: c[MBS] > 11)
    lines: list[str] = []
    tuner = make_tuner(tmp_path, {**BASE, "zero_optimization": {"stage": 1}}, runner,
                       max_train_micro_batch_size_per_gpu=64, num_tuning_micro_batch_sizes=2)
    tuner.log = lines.append
    tuner.tune()
    assert tuner.mbs_limits[1] == ("micro-batch 12: the script's data ran out before end_profile_step 5 "
                                   "(a dataset limit, not memory)")
    assert any("largest runnable micro-batch 11 (limit: micro-batch 12: the script's data ran out" in line
               for line in lines)
    failing = ClockedRunner(tmp_path / "b", throughput=lambda c: 1.0, fails=lambda c: c[MBS] > 5)
    other = make_tuner(tmp_path / "b", {**BASE, "zero_optimization": {"stage": 1}}, failing,
                       max_train_micro_batch_size_per_gpu=8)
    other.model_info()  # given in the config: no run
    assert other.largest_runnable_mbs(1) == 5 and other.mbs_limits[1] == "micro-batch 6: failed: exit status 1"
    roomy = make_tuner(tmp_path / "c", {**BASE, "zero_optimization": {"stage": 1}},
                       ClockedRunner(tmp_path / "c", throughput=lambda c: 1.0), max_train_micro_batch_size_per_gpu=8)
    roomy.model_info()
    assert roomy.largest_runnable_mbs(1) == 8
    assert roomy.mbs_limits[1] == "the upper bound 8 (max_train_micro_batch_size_per_gpu)"


def test_launcher_summary_is_read_from_stderr(tmp_path: Path) -> None:
    log = tmp_path / "stderr.log"
    log.write_text("noise\nzerospeed: train.py failed on ranks 0-1 of the 2 that ran\n"
                   "  ConfigError: zerospeed config: zero_optimization.stage: 7 is not one of 0, 1, 2, 3\n"
                   "    at train.py:5 in main\n  full tracebacks: /tmp/x/failures.log\n")
    assert launcher_summary(log) == ("ConfigError: zerospeed config: zero_optimization.stage: 7 is not one of "
                                     "0, 1, 2, 3 at train.py:5 in main")
    log.write_text("Traceback ...\nRuntimeError: x\n")
    assert launcher_summary(log) == ""


SCRIPT = """\
import sys
import zerospeed


def main():
    if "--bad" in sys.argv:
        zerospeed.load_config({"train_batch_size": 2, "zero_optimization": {"stage": 7}})


main()
"""


@pytest.mark.timeout(240)
def test_real_experiments_report_the_exception_and_an_early_end(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    runner = ExperimentRunner(exps_dir=tmp_path / "exps", launcher_args=["--num_procs", "1"], script=str(script),
                              user_args=["--bad"], arg_mappings={}, timeout=200.0)
    runner.env = {"OMP_NUM_THREADS": "1"}
    bad = runner.run("bad", {"train_batch_size": 1}, {})
    assert bad.status == "failed"
    assert bad.reason == (f"exit status 1: ConfigError: zerospeed config: zero_optimization.stage: 7 is not one of "
                          f"0, 1, 2, 3 at {script}:7 in main")
    runner.user_args = []
    ended = runner.run("ended", {"train_batch_size": 1}, {})
    assert ended.status == "ended_early" and "data or its loop ran out" in ended.reason
    assert sys.executable in (tmp_path / "exps" / "bad" / "cmd.txt").read_text()


CRASHING = """\
import os
import sys
from pathlib import Path

marker = Path(sys.argv[1])
if "--always" in sys.argv or not marker.exists():
    marker.touch()
    os.abort()  # a native crash: SIGABRT, no Python exception
"""


@pytest.mark.timeout(240)
def test_a_native_crash_is_run_once_more_and_a_second_one_is_recorded(tmp_path: Path) -> None:
    script = tmp_path / "crash.py"
    script.write_text(CRASHING)
    runner = ExperimentRunner(exps_dir=tmp_path / "exps", launcher_args=["--num_procs", "1"], script=str(script),
                              user_args=[str(tmp_path / "marker")], arg_mappings={}, timeout=200.0)
    runner.env = {"OMP_NUM_THREADS": "1"}
    once = runner.run("once", {"train_batch_size": 1}, {})  # aborts, then exits 0 (no metrics: ended early)
    assert once.status == "ended_early"
    assert once.reason.endswith("run twice (first run: killed by SIGABRT)")  # one rank: no "rank 0: "
    assert json.loads((tmp_path / "exps" / "once" / "result.json").read_text())["reason"] == once.reason
    runner.user_args = [str(tmp_path / "marker"), "--always"]
    twice = runner.run("twice", {"train_batch_size": 1}, {})
    assert twice.status == "failed" and "killed by SIGABRT" in twice.reason and "run twice" in twice.reason
