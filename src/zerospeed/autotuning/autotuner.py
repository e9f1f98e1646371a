"""The tuning loop: model info, memory pruning, micro-batch bisection, search, results.

1. **Model info.** One experiment (the first stage searched, the smallest micro-batch) measures the
   number of parameters, the saved-activation bytes and FLOPs per sample, and the process' peak
   memory; ``autotuning.model_info`` (``num_params`` + ``activation_mem_per_sample``) skips it.
   If it fails, the script is not runnable as given, and the error shows its last stderr lines.
2. **Pruning.** Every candidate is validated as a zerospeed config and its per-rank bytes are
   predicted (:mod:`zerospeed.autotuning.memory_model`); a candidate over the memory budget is
   skipped and its predicted bytes are logged. The budget is ``memory_budget``, or else the memory
   this machine has per local process (host RAM available on CPU, device memory on GPU).
3. **Micro-batch sizes.** Where the user gave none (or ``"auto"``), the largest runnable size per
   stage is found by bisection between ``min_train_micro_batch_size_per_gpu`` and the smallest of
   ``max_train_micro_batch_size_per_gpu``, the memory bound and ``max_train_batch_size``; the
   sizes tuned are it and its halves (``num_tuning_micro_batch_sizes`` of them). What stopped it is
   logged and kept (``mbs_limits``): an upper bound, the first size that failed and why, and in
   particular a size at which the script's data ran out before ``end_profile_step`` (``ended_early``),
   which is a dataset limit, not a memory one.
4. **Search** with the configured tuner, early stopping and trial cap; every experiment that ran
   (bisection probes included) is a measured config, and the best of them wins.
5. **Results** (``results_dir``): ``summary.txt``, ``results.json``, ``ds_config_optimal.json``,
   ``cmd_optimal.txt`` and ``metric.png``, rewritten after every experiment.

A re-run with ``overwrite: false`` reads finished experiments back instead of running them.

**Cost.** Once the model is known, one line estimates the work: at most how many experiments (bisection
probes plus candidates, capped by ``tuner_num_trials``) and, from the model-info run's duration, how long.
``autotuning.max_seconds`` bounds it: no experiment starts once the time used plus the median duration of the
experiments run so far would pass the budget; the tuning then ends with the best config measured (or, with none,
one error line). The bound can be passed by at most one experiment that runs longer than the median.
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from zerospeed.autotuning.experiment import ExperimentRunner, Result
from zerospeed.autotuning.memory_model import ModelInfo, max_mbs_within, predict_bytes
from zerospeed.autotuning.report import write_results
from zerospeed.autotuning.space import GAS, MBS, STAGE, Space, candidate_name, candidates, materialize
from zerospeed.autotuning.tuners import make_tuner
from zerospeed.config.autotuning import AutotuningConfig

MAXIMIZE = {"throughput": True, "flops": True, "latency": False}
MODEL_INFO_EXP = "profile_model_info"


class AutotuneError(RuntimeError):
    """The tuning cannot go on; the message is one line saying why."""


class OutOfTime(Exception):
    """``autotuning.max_seconds`` leaves no time for another experiment."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass
class Autotuner:
    space: Space
    at: AutotuningConfig
    runner: ExperimentRunner
    world_size: int
    results_dir: Path
    memory_budget: float
    on_gpu: bool = False
    log: Callable[[str], None] = print
    results: dict[str, Result] = field(default_factory=dict)
    info: ModelInfo | None = None
    num_run: int = 0
    num_reused: int = 0
    skipped: list[dict[str, Any]] = field(default_factory=list)
    #: stage -> what bounded its largest runnable micro-batch (see the module docstring)
    mbs_limits: dict[int, str] = field(default_factory=dict)
    started: float | None = None
    model_info_seconds: float | None = None  # the model-info run's duration: the estimate's time per experiment
    durations: list[float] = field(default_factory=list)  # of the experiments run (not read back) so far
    clock: Callable[[], float] = time.perf_counter

    # -- helpers ----------------------------------------------------------------------------------
    @property
    def maximize(self) -> bool:
        return MAXIMIZE[self.at.metric]

    def dp_size(self, cand: dict[str, Any]) -> int:
        mp = int(cand.get("tensor_parallel.autotp_size", 1) or 1) * int(cand.get("pipeline.stages", 1) or 1)
        return self.world_size // mp if self.world_size % mp == 0 else 0

    def config_for(self, name: str, cand: dict[str, Any], **autotuning: Any) -> dict[str, Any]:
        raw = materialize(self.space, cand, max(1, self.dp_size(cand)))
        folder = self.runner.exps_dir / name
        raw["autotuning"] = {"enabled": True, "metric_path": str(folder / "metrics.json"),
                             "start_profile_step": self.at.start_profile_step,
                             "end_profile_step": self.at.end_profile_step, **autotuning}
        return raw

    def best(self) -> Result | None:
        ok = [r for r in self.results.values() if r.metric(self.at.metric) is not None]
        if not ok:
            return None
        key = lambda r: r.metric(self.at.metric)  # noqa: E731
        return max(ok, key=key) if self.maximize else min(ok, key=key)

    def measure(self, cand: dict[str, Any]) -> Result:
        """Run (or read back) one candidate's experiment and log a progress line."""
        name = candidate_name(cand)
        if name in self.results:
            return self.results[name]
        result = None if self.at.overwrite else self.runner.finished(name)
        if result is not None:
            self.num_reused += 1
            how = "finished earlier"
        else:
            self.check_time()
            result = self.runner.run(name, self.config_for(name, cand), cand)
            self.durations.append(result.elapsed)
            self.num_run += 1
            how = "ran"
        self.results[name] = result
        best = self.best()
        value = result.metric(self.at.metric)
        shown = f"{self.at.metric}={value:.4g}" if value is not None else f"{result.status}: {result.reason[:300]}"
        best_txt = f"{best.name} {best.metric(self.at.metric):.4g}" if best else "none yet"
        self.log(f"[autotuning] {len(self.results):3d} {name}: {shown} ({how}, {result.elapsed:.1f} s) | "
                 f"best: {best_txt}")
        self.write()
        return result

    def check_time(self) -> None:
        """Raise :class:`OutOfTime` when the next experiment would not end within ``max_seconds``."""
        if not self.at.max_seconds or self.started is None:
            return
        used = self.clock() - self.started
        typical = statistics.median(self.durations) if self.durations else 0.0
        if used + typical > self.at.max_seconds:
            raise OutOfTime(f"autotuning.max_seconds {self.at.max_seconds:g} s: {used:.0f} s used and an experiment "
                            f"takes about {typical:.0f} s")

    def estimate(self, seconds_each: float | None) -> tuple[int, str]:
        """(at most how many experiments the search runs, the line that says so and how long they take)."""
        probes = 0
        num_cands = 0
        n = self.at.num_tuning_micro_batch_sizes
        for stage in self.space.stages:
            if self.space.mbs_values is None:
                span = self.at.max_train_micro_batch_size_per_gpu - self.at.min_train_micro_batch_size_per_gpu
                probes += 2 + math.ceil(math.log2(max(1, span)))
                mbs = tuple(2 ** i for i in range(n))
            else:
                mbs = self.space.mbs_values
            num_cands += len(candidates(self.space, stage, mbs, max(1, self.world_size), self.at.max_train_batch_size,
                                        self.at.min_train_batch_size))
        num_cands = min(num_cands, self.at.tuner_num_trials)
        total = probes + num_cands
        budget = f"autotuning.max_seconds {self.at.max_seconds:g} s" if self.at.max_seconds else \
            "no autotuning.max_seconds"
        if seconds_each is None:
            when = "time per experiment unknown until the first runs (model_info was given)"
        else:
            when = (f"~{seconds_each:.0f} s each (the model-info run) = ~{total * seconds_each / 60:.1f} min "
                    "at most")
        return total, (f"[autotuning] estimate: up to {total} experiments ({probes} micro-batch probes + "
                       f"{num_cands} candidates, tuner_num_trials {self.at.tuner_num_trials}), {when}; {budget}")

    def write(self) -> None:
        write_results(self.results_dir, self.results, self.best(), self.at.metric, self.skipped,
                      self.optimal_config(), self.optimal_command())

    def optimal_config(self) -> dict[str, Any] | None:
        best = self.best()
        if best is None:
            return None
        raw = materialize(self.space, best.candidate, max(1, self.dp_size(best.candidate)))
        raw.pop("autotuning", None)
        return raw

    def optimal_command(self) -> str | None:
        if self.best() is None:
            return None
        path = self.results_dir / "ds_config_optimal.json"
        return shlex.join(["zerospeed", *self.runner.launcher_args, self.runner.script,
                           *self.runner.script_args(path, self.best().candidate)])

    # -- the loop ---------------------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        given = self.at.model_info
        if "num_params" in given and "activation_mem_per_sample" in given:
            self.info = ModelInfo.from_dict(given)
            return self.info
        stage = self.space.stages[0]
        cand = {STAGE: stage, MBS: self.at.min_train_micro_batch_size_per_gpu,
                GAS: self.space.dims.get(GAS, (1,))[0]}
        if self.space.fixed_train_batch_size is not None:
            cand[GAS] = max(1, self.space.fixed_train_batch_size // (cand[MBS] * self.world_size))
        folder = self.runner.exps_dir / MODEL_INFO_EXP
        info_path = folder / "model_info.json"
        done = None if self.at.overwrite else self.runner.finished(MODEL_INFO_EXP)
        if done is None or done.status != "ok" or not info_path.is_file():
            config = self.config_for(MODEL_INFO_EXP, cand, model_info_path=str(info_path))
            self.log(f"[autotuning] model-info run: ZeRO stage {stage}, micro-batch {cand[MBS]}")
            self.check_time()
            done = self.runner.run(MODEL_INFO_EXP, config, cand)
            self.durations.append(done.elapsed)
            self.num_run += 1
        else:
            self.num_reused += 1
        if done.status != "ok" or not info_path.is_file():
            raise AutotuneError(f"the model-info run failed, so the script is not runnable as given "
                                f"({self.runner.exps_dir / MODEL_INFO_EXP}): {done.status}: {done.reason}")
        self.model_info_seconds = done.elapsed
        data = json.loads(info_path.read_text())
        info = ModelInfo.from_dict(data)
        predicted = predict_bytes(info, cand, self.space.base, self.world_size, self.on_gpu)["budgeted"]
        overhead = max(0.0, float(data.get("peak_memory_bytes", 0)) - predicted) if not self.on_gpu else 0.0
        self.info = ModelInfo(info.num_params, info.activation_mem_per_sample, info.flops_per_sample, overhead)
        self.log(f"[autotuning] model info: {info.num_params:,} parameters, "
                 f"{info.activation_mem_per_sample / 2**20:.2f} MiB of activations per sample, "
                 f"{overhead / 2**20:.0f} MiB process overhead")
        return self.info

    def prune(self, cands: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Drop invalid candidates and those predicted over the memory budget (logged)."""
        from zerospeed.config import ConfigError, load_config

        assert self.info is not None
        kept = []
        for cand in cands:
            name = candidate_name(cand)
            dp = self.dp_size(cand)
            if dp == 0:
                self._skip(name, cand, f"world size {self.world_size} is not divisible by the model-parallel degree")
                continue
            raw = materialize(self.space, cand, dp)
            try:
                load_config(raw, dp_world_size=dp)
            except ConfigError as err:
                self._skip(name, cand, f"invalid config: {err}")
                continue
            predicted = predict_bytes(self.info, cand, raw, dp, self.on_gpu)
            if self.memory_budget and predicted["budgeted"] > self.memory_budget:
                self._skip(name, cand, f"predicted {_gib(predicted['budgeted'])} per rank > memory budget "
                                       f"{_gib(self.memory_budget)} (device {_gib(predicted['device'])}, host "
                                       f"{_gib(predicted['host'])}, nvme {_gib(predicted['nvme'])})",
                           predicted=predicted)
                continue
            kept.append(cand)
        return kept

    def _skip(self, name: str, cand: dict[str, Any], reason: str, predicted: dict[str, float] | None = None) -> None:
        self.skipped.append({"name": name, "candidate": cand, "reason": reason, "predicted": predicted})
        self.log(f"[autotuning] skip {name}: {reason}")

    def largest_runnable_mbs(self, stage: int) -> int:
        """Bisection for the largest micro-batch size that runs (0 when even the smallest fails)."""
        assert self.info is not None
        probe = {STAGE: stage, MBS: 1, GAS: self.space.dims.get(GAS, (1,))[0]}
        for path, values in self.space.knobs[stage].items():
            if path != GAS:
                probe[path] = values[0]
        dp = max(1, self.dp_size(probe))
        upper = self.at.max_train_micro_batch_size_per_gpu
        if self.at.max_train_batch_size is not None:
            upper = min(upper, self.at.max_train_batch_size // (dp * int(probe[GAS])))
        budget_bound = max_mbs_within(self.info, probe, self.space.base, dp, self.memory_budget, upper, self.on_gpu)
        low, high = self.at.min_train_micro_batch_size_per_gpu, min(upper, budget_bound)
        if high < low:
            self.log(f"[autotuning] stage {stage}: no micro-batch size fits (bound {high} < minimum {low})")
            self.mbs_limits[stage] = f"no size fits: bound {high} < minimum {low}"
            return 0
        why_not: dict[int, str] = {}

        def runs(mbs: int) -> bool:
            cand = dict(probe, **{MBS: mbs})
            if self.space.fixed_train_batch_size is not None:
                if self.space.fixed_train_batch_size % (mbs * dp):
                    why_not[mbs] = f"train_batch_size {self.space.fixed_train_batch_size} is not a multiple of it"
                    return False
                cand[GAS] = self.space.fixed_train_batch_size // (mbs * dp)
            if not self.prune([cand]):
                why_not[mbs] = self.skipped[-1]["reason"]
                return False
            result = self.measure(cand)
            if result.status == "ended_early":
                why_not[mbs] = (f"the script's data ran out before end_profile_step {self.at.end_profile_step} "
                                "(a dataset limit, not memory)")
            elif result.status != "ok":
                why_not[mbs] = f"{result.status}: {result.reason[:200]}"
            return result.status == "ok"

        if runs(high):
            bound = ("max_train_micro_batch_size_per_gpu" if high == self.at.max_train_micro_batch_size_per_gpu
                     else "max_train_batch_size" if high == upper else "the memory budget's prediction")
            self.mbs_limits[stage] = f"the upper bound {high} ({bound})"
            return high
        if not runs(low):
            self.mbs_limits[stage] = f"micro-batch {low}: {why_not.get(low, 'did not run')}"
            return 0
        while high - low > 1:  # invariant: low runs, high does not
            mid = (low + high) // 2
            if runs(mid):
                low = mid
            else:
                high = mid
        self.mbs_limits[stage] = f"micro-batch {high}: {why_not.get(high, 'did not run')}"
        return low

    def mbs_values(self, stage: int) -> tuple[int, ...]:
        if self.space.mbs_values is not None:
            lo, hi = self.at.min_train_micro_batch_size_per_gpu, self.at.max_train_micro_batch_size_per_gpu
            return tuple(m for m in self.space.mbs_values if lo <= m <= hi)
        top = self.largest_runnable_mbs(stage)
        values: list[int] = []
        m = top
        while m >= self.at.min_train_micro_batch_size_per_gpu and len(values) < self.at.num_tuning_micro_batch_sizes:
            values.append(m)
            m //= 2
        self.log(f"[autotuning] stage {stage}: largest runnable micro-batch {top} (limit: "
                 f"{self.mbs_limits.get(stage, '?')}); tuning {sorted(values)}")
        return tuple(sorted(values))

    def tune(self) -> Result:
        start = self.started = self.clock()
        try:
            return self._tune(start)
        except OutOfTime as stop:
            best = self.best()
            self.write()
            if best is None:
                raise AutotuneError(f"{stop}; no experiment succeeded before that ({len(self.results)} measured)") \
                    from None
            self.log(f"[autotuning] stopped: {stop}; {self.num_run} experiments run, {self.num_reused} read back; "
                     f"best so far {best.name} {self.at.metric}={best.metric(self.at.metric):.4g}; "
                     f"{self.results_dir / 'ds_config_optimal.json'}")
            return best

    def _tune(self, start: float) -> Result:
        self.model_info()
        self.log(self.estimate(self.model_info_seconds)[1])
        all_cands: list[dict[str, Any]] = []
        for stage in self.space.stages:
            mbs = self.mbs_values(stage)
            if not mbs:
                continue
            cands = candidates(self.space, stage, mbs, max(1, self.world_size), self.at.max_train_batch_size,
                               self.at.min_train_batch_size)
            all_cands += self.prune(cands)
        if not all_cands and self.best() is None:
            smallest = min((s for s in self.skipped if s.get("predicted")), default=None,
                           key=lambda s: s["predicted"]["budgeted"])
            hint = (f"; smallest prediction {_gib(smallest['predicted']['budgeted'])} for {smallest['name']}"
                    if smallest else "")
            raise AutotuneError(f"no candidate fits: {len(self.skipped)} skipped, memory budget "
                                f"{_gib(self.memory_budget)} per rank{hint}")
        tuner = make_tuner(self.at.tuner_type, all_cands, maximize=self.maximize,
                           num_trials=self.at.tuner_num_trials, early_stopping=self.at.tuner_early_stopping)
        tuner.search(lambda cand: self.measure(cand).metric(self.at.metric))
        best = self.best()
        self.write()
        if best is None:
            failures = [r for r in self.results.values() if r.status != "ok"]
            first = f"; first failure {failures[0].name}: {failures[0].reason[:500]}" if failures else ""
            raise AutotuneError(f"no experiment succeeded ({len(self.results)} measured){first}")
        self.log(f"[autotuning] done in {self.clock() - start:.0f} s: {self.num_run} experiments run, "
                 f"{self.num_reused} read back; best {best.name} {self.at.metric}={best.metric(self.at.metric):.4g}; "
                 f"{self.results_dir / 'ds_config_optimal.json'}")
        return best
