"""Search strategies over a list of candidates: grid, random, model-based (Optuna's TPE) and a
cost model (scikit-learn random forest).

A tuner only chooses *which candidate to measure next*; measuring is a callable the tuner is
given (``evaluate(candidate) -> value or None``), so every tuner is unit-tested without
processes. ``None`` is a failed experiment (crashed, hung, over budget).

Decisions:

* ``gridsearch`` measures candidates in the order given (stage, then micro-batch size, ...);
  ``random`` in a seeded random order.
* ``model_based`` asks Optuna's TPE sampler (a well-kept library) for the next point in the
  categorical space spanned by the candidates' keys; a point that is not a candidate (pruned by
  memory, or an inconsistent batch) is told to Optuna as failed without running anything, and a
  point already measured is told its known value. TPE starts from ``n_startup`` random points.
* ``cost_model`` (a zerospeed extension of ``tuner_type``; DeepSpeed's own model-based tuner fits
  an XGBoost cost model): after ``n_startup`` seeded random candidates, a scikit-learn random
  forest is fitted on the one-hot candidates measured so far and the unmeasured candidate with
  the highest upper bound (mean + spread over the trees) is measured next. A failed experiment
  counts as half the worst value seen, so the model learns to avoid its neighbourhood.
  ``bench/autotune_bench.py`` measures which of the two finds the grid's best in fewer trials.
* Early stopping (``tuner_early_stopping``): stop after that many consecutive measured
  candidates without a new best; ``tuner_num_trials`` caps how many candidates are measured.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zerospeed.config import extras

Evaluate = Callable[[dict[str, Any]], float | None]


def _key(candidate: dict[str, Any]) -> str:
    return json.dumps(candidate, sort_keys=True, default=str)


@dataclass
class SearchOutcome:
    best: dict[str, Any] | None
    best_value: float | None
    num_measured: int
    stopped_early: bool


class Tuner:
    """Base: measure candidates in :meth:`order`, keep the best, stop early."""

    def __init__(self, candidates: list[dict[str, Any]], maximize: bool = True, num_trials: int = 50,
                 early_stopping: int = 5, seed: int = 0) -> None:
        self.candidates = list(candidates)
        self.maximize = maximize
        self.num_trials = num_trials
        self.early_stopping = early_stopping
        self.seed = seed

    def better(self, value: float, best: float | None) -> bool:
        return best is None or (value > best if self.maximize else value < best)

    def order(self) -> list[dict[str, Any]]:
        return list(self.candidates)

    def search(self, evaluate: Evaluate) -> SearchOutcome:
        best, best_value, measured, since_best = None, None, 0, 0
        for cand in self.order():
            if measured >= self.num_trials:
                break
            value = evaluate(cand)
            measured += 1
            if value is not None and self.better(value, best_value):
                best, best_value, since_best = cand, value, 0
            else:
                since_best += 1
            if best is not None and since_best >= self.early_stopping:
                return SearchOutcome(best, best_value, measured, True)
        return SearchOutcome(best, best_value, measured, False)


class GridSearchTuner(Tuner):
    pass


class RandomTuner(Tuner):
    def order(self) -> list[dict[str, Any]]:
        shuffled = list(self.candidates)
        random.Random(self.seed).shuffle(shuffled)
        return shuffled


class ModelBasedTuner(Tuner):
    """Optuna TPE over the candidates' categorical space (see the module docstring)."""

    n_startup = 3

    def search(self, evaluate: Evaluate) -> SearchOutcome:
        optuna = extras.require("optuna", feature="autotuning.tuner_type 'model_based'")

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        logging.getLogger("optuna").setLevel(logging.WARNING)
        keys = sorted({k for c in self.candidates for k in c})
        choices = {k: sorted({_key(c.get(k)) for c in self.candidates}) for k in keys}
        by_key = {_key(c): c for c in self.candidates}
        sampler = optuna.samplers.TPESampler(seed=self.seed, n_startup_trials=self.n_startup)
        study = optuna.create_study(direction="maximize" if self.maximize else "minimize", sampler=sampler)
        dists = {k: optuna.distributions.CategoricalDistribution(v) for k, v in choices.items()}
        known: dict[str, float | None] = {}
        best, best_value, measured, since_best = None, None, 0, 0
        asks = misses = 0
        while measured < min(self.num_trials, len(self.candidates)) and asks < 20 * len(self.candidates) + 50:
            asks += 1
            trial = study.ask(dists)
            point = {k: json.loads(trial.params[k]) for k in keys}
            point = {k: v for k, v in point.items() if v is not None}
            cand = by_key.get(_key(point))
            if cand is None:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                misses += 1
                if misses >= len(self.candidates):  # TPE keeps proposing non-candidates: queue the next one
                    fallback = self._unmeasured(known)
                    if fallback is None:
                        break
                    study.enqueue_trial({k: _key(fallback.get(k)) for k in keys})
                    misses = 0
                continue
            misses = 0
            key = _key(cand)
            if key in known:
                value = known[key]
                study.tell(trial, value) if value is not None else study.tell(
                    trial, state=optuna.trial.TrialState.FAIL)
                if len(known) == len(self.candidates):
                    break
                continue
            value = evaluate(cand)
            known[key] = value
            measured += 1
            if value is None:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                since_best += 1
            else:
                study.tell(trial, value)
                if self.better(value, best_value):
                    best, best_value, since_best = cand, value, 0
                else:
                    since_best += 1
            if best is not None and since_best >= self.early_stopping:
                return SearchOutcome(best, best_value, measured, True)
        return SearchOutcome(best, best_value, measured, False)

    def _unmeasured(self, known: dict[str, float | None]) -> dict[str, Any] | None:
        return next((c for c in self.candidates if _key(c) not in known), None)


class CostModelTuner(Tuner):
    """Random-forest cost model over one-hot candidates (see the module docstring)."""

    n_startup = 3

    def _features(self) -> list[list[float]]:
        keys = sorted({k for c in self.candidates for k in c})
        values = {k: sorted({_key(c.get(k)) for c in self.candidates}) for k in keys}
        return [[1.0 if _key(c.get(k)) == v else 0.0 for k in keys for v in values[k]] for c in self.candidates]

    def search(self, evaluate: Evaluate) -> SearchOutcome:
        RandomForestRegressor = extras.require("sklearn.ensemble", feature="autotuning.tuner_type 'cost_model'"  # noqa: N806
                                               ).RandomForestRegressor

        feats = self._features()
        order = list(range(len(self.candidates)))
        random.Random(self.seed).shuffle(order)
        measured: dict[int, float | None] = {}
        best, best_value, since_best = None, None, 0
        sign = 1.0 if self.maximize else -1.0
        while len(measured) < min(self.num_trials, len(self.candidates)):
            rest = [i for i in order if i not in measured]
            ok = [v for v in measured.values() if v is not None]
            if len(measured) < self.n_startup or not ok:
                pick = rest[0]
            else:
                worst = min(sign * v for v in ok)
                fail = worst - abs(worst) * 0.5
                xs = [feats[i] for i in measured]
                ys = [sign * v if v is not None else fail for v in measured.values()]
                forest = RandomForestRegressor(n_estimators=50, min_samples_leaf=1, random_state=self.seed)
                forest.fit(xs, ys)
                per_tree = [tree.predict([feats[i] for i in rest]) for tree in forest.estimators_]
                n = len(per_tree)
                scores = []
                for j in range(len(rest)):
                    vals = [float(t[j]) for t in per_tree]
                    mean = sum(vals) / n
                    spread = (sum((v - mean) ** 2 for v in vals) / n) ** 0.5
                    scores.append(mean + spread)
                pick = rest[max(range(len(rest)), key=scores.__getitem__)]
            value = evaluate(self.candidates[pick])
            measured[pick] = value
            if value is not None and self.better(value, best_value):
                best, best_value, since_best = self.candidates[pick], value, 0
            else:
                since_best += 1
            if best is not None and since_best >= self.early_stopping:
                return SearchOutcome(best, best_value, len(measured), True)
        return SearchOutcome(best, best_value, len(measured), False)


TUNERS: dict[str, type[Tuner]] = {"gridsearch": GridSearchTuner, "random": RandomTuner, "model_based": ModelBasedTuner,
                                  "cost_model": CostModelTuner}


#: the optional package each tuner needs (checked before any experiment runs: zerospeed.config.extras)
TUNER_PACKAGES: dict[str, tuple[str, ...]] = {"model_based": ("optuna",), "cost_model": ("sklearn",)}


def make_tuner(kind: str, candidates: list[dict[str, Any]], **kwargs: Any) -> Tuner:
    if kind not in TUNERS:
        raise ValueError(f"autotuning.tuner_type: {kind!r} is not one of {', '.join(TUNERS)}")
    return TUNERS[kind](candidates, **kwargs)
