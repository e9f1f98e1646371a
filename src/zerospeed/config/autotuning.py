"""The ``autotuning`` section: DeepSpeed's autotuner keys plus two of zerospeed's own.

DeepSpeed's keys and defaults (``deepspeed/autotuning/constants.py``, documented on
deepspeed.ai/docs/config-json "Autotuning"): ``enabled``, ``fast`` (true), ``metric``
(throughput), ``tuner_type`` (gridsearch), ``tuner_early_stopping`` (5), ``tuner_num_trials``
(50), ``start_profile_step`` (3), ``end_profile_step`` (5), ``results_dir``
("autotuning_results"), ``exps_dir`` ("autotuning_exps"), ``overwrite``, ``metric_path``,
``model_info_path``, ``max_train_batch_size``, ``min_train_batch_size``,
``max_train_micro_batch_size_per_gpu`` (1024), ``min_train_micro_batch_size_per_gpu`` (1),
``num_tuning_micro_batch_sizes`` (3), ``arg_mappings``, ``model_info``, ``mp_size`` (1).

Decisions:

* ``overwrite`` defaults to **false** (DeepSpeed: true), so re-running an interrupted tuning
  resumes: experiments that already finished are read back, not run again. ``true`` starts over.
* zerospeed keys: ``memory_budget`` (bytes per rank a candidate may use: host RAM on CPU runs,
  device memory on GPU; 0 = no budget, candidates are only bounded by what runs),
  ``exp_timeout`` (seconds an experiment may take before it is killed and recorded as failed) and
  ``max_seconds`` (the whole tuning's time budget, 0 = none: no experiment starts once the time used plus a
  typical experiment's duration would pass it, and the best config measured so far wins; issue #33).
* ``arg_mappings`` keys are DeepSpeed config keys; stray whitespace is stripped (a published
  DeepSpeed example writes ``"gradient_accumulation_steps "``).
* ``metric_path`` / ``model_info_path`` are written by the tuner into each experiment's config;
  when set, the engine measures steps ``start_profile_step..end_profile_step``, writes the file
  and ends the process (see :mod:`zerospeed.runtime.autotuning_probe`).
"""

from __future__ import annotations

import threading

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, model_validator

from .fields import Bool, NonNegInt, PosInt, Section, Str, bounded, fail, one_of

METRICS = ("throughput", "latency", "flops")
TUNERS = ("gridsearch", "random", "model_based", "cost_model")


def _arg_mappings(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise fail(f"{value!r} is not a JSON object mapping config keys to script arguments")
    out: dict[str, str] = {}
    for key, arg in value.items():
        if not isinstance(arg, str) or not arg.startswith("-"):
            raise fail(f"{arg!r} for {key.strip()!r} is not a command-line flag (e.g. '--per_device_train_batch_size')")
        out[str(key).strip()] = arg
    return out


def _model_info(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise fail(f"{value!r} is not a JSON object (e.g. {{\"num_params\": 1.2e8}})")
    allowed = {"num_params", "hidden_size", "num_layers", "activation_mem_per_sample", "flops_per_sample",
               "profile"}
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise fail(f"unknown key {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}")
    return dict(value)


class AutotuningConfig(Section):
    """``autotuning``: the search zerospeed's ``--autotuning tune|run`` performs."""

    enabled: Bool = False
    fast: Bool = True
    metric: Annotated[Literal["throughput", "latency", "flops"], one_of(*METRICS, case_insensitive=True)] = "throughput"
    tuner_type: Annotated[Literal["gridsearch", "random", "model_based", "cost_model"],
                          one_of(*TUNERS, case_insensitive=True)] = "gridsearch"
    tuner_early_stopping: PosInt = 5
    tuner_num_trials: PosInt = 50
    start_profile_step: NonNegInt = 3
    end_profile_step: PosInt = 5
    results_dir: Str = "autotuning_results"
    exps_dir: Str = "autotuning_exps"
    overwrite: Bool = False
    metric_path: Str | None = None
    model_info_path: Str | None = None
    max_train_batch_size: PosInt | None = None
    min_train_batch_size: PosInt = 1
    max_train_micro_batch_size_per_gpu: PosInt = 1024
    min_train_micro_batch_size_per_gpu: PosInt = 1
    num_tuning_micro_batch_sizes: PosInt = 3
    arg_mappings: Annotated[dict[str, str], BeforeValidator(_arg_mappings)] = {}
    model_info: Annotated[dict[str, Any], BeforeValidator(_model_info)] = {}
    mp_size: PosInt = 1
    memory_budget: NonNegInt = 0
    exp_timeout: Annotated[float, bounded(float, 0.0, threading.TIMEOUT_MAX, "the longest wait the platform can "
                                                                            "time", low_open=True)] = 600.0
    max_seconds: Annotated[float, bounded(float, 0.0, threading.TIMEOUT_MAX, "seconds (0 = no time budget)")] = 0.0

    @model_validator(mode="after")
    def _ranges(self) -> AutotuningConfig:
        if self.end_profile_step <= self.start_profile_step:
            raise fail(f"{self.end_profile_step} must be greater than start_profile_step "
                       f"({self.start_profile_step}): the steps between them are measured", key="end_profile_step")
        if self.max_train_micro_batch_size_per_gpu < self.min_train_micro_batch_size_per_gpu:
            raise fail(f"{self.max_train_micro_batch_size_per_gpu} is below min_train_micro_batch_size_per_gpu "
                       f"({self.min_train_micro_batch_size_per_gpu})", key="max_train_micro_batch_size_per_gpu")
        if self.max_train_batch_size is not None and self.max_train_batch_size < self.min_train_batch_size:
            raise fail(f"{self.max_train_batch_size} is below min_train_batch_size ({self.min_train_batch_size})",
                       key="max_train_batch_size")
        return self
