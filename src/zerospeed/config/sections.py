"""Top-level config sections other than ZeRO: precision, optimizer, scheduler, monitors, pipeline.

Defaults are DeepSpeed's (``deepspeed/runtime/precision_config.py``, ``runtime/constants.py``,
``monitor/config.py``, ``comm/constants.py``, ``activation_checkpointing/config.py``), except where
a docstring below says otherwise.

Decisions:

* ``optimizer.params`` / ``scheduler.params`` stay a plain dict here; the optimizer and schedule
  builders own their validation.  ``type`` is checked against :mod:`zerospeed.config.names` and
  stored in its canonical spelling.
* ``pipeline`` carries zerospeed's own keys next to DeepSpeed's (``schedule``, ``virtual_stages``).
  ``partition`` defaults to ``"parameters"``, the default of DeepSpeed's ``PipelineModule``
  (DeepSpeed's config dict says ``"best"``, which its module never implemented).
* ``checkpoint.async_save`` is a zerospeed key (asynchronous torch.distributed.checkpoint save).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from .fields import (
    Bool,
    DType,
    NonNegFloat,
    NonNegInt,
    PosInt,
    Section,
    FP32_MAX,
    Str,
    bounded,
    to_int,
    fail,
    one_of,
)
from .names import NameProblem, canonical_optimizer_name, canonical_scheduler_name


class FP16Config(Section):
    """``fp16``: float16 mixed precision with (by default dynamic) loss scaling."""

    enabled: Bool = False
    auto_cast: Bool = False
    loss_scale: Annotated[float, bounded(float, 0.0, FP32_MAX, "a larger scale is infinite in fp32")] = 0.0
    """Static loss scale; 0 means dynamic loss scaling."""
    initial_scale_power: Annotated[int, bounded(int, 0, 127, "2**128 and above overflow fp32: every step would "
                                                              "overflow")] = 16
    loss_scale_window: PosInt = 1000
    hysteresis: PosInt = 2
    consecutive_hysteresis: Bool = False
    min_loss_scale: Annotated[float, bounded(float, 0.0, FP32_MAX, "a scale of 0 zeroes every gradient; a larger "
                                                                   "one is infinite in fp32", low_open=True)] = 1.0
    fp16_master_weights_and_grads: Bool = False

    @model_validator(mode="after")
    def _min_below_initial(self) -> FP16Config:
        if self.loss_scale == 0 and self.min_loss_scale > 2.0 ** self.initial_scale_power:
            raise fail(f"{self.min_loss_scale:g} is above the initial dynamic scale 2**initial_scale_power = "
                       f"{2.0 ** self.initial_scale_power:g}; lower it or raise initial_scale_power",
                       key="min_loss_scale")
        return self


class BF16Config(Section):
    """``bf16`` (alias ``bfloat16``): bfloat16 mixed precision; no loss scaling needed."""

    enabled: Bool = False
    immediate_grad_update: Bool = False
    check_grad_overflow: Bool = True  # DeepSpeed 0.19.8's default (precision_config.py); see NO_OP_FIELDS
    bf16_master_weights_and_grads: Bool = False
    bf16_optimizer_states: Bool = False

    @model_validator(mode="after")
    def _states_need_master(self) -> BF16Config:
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise fail(
                "bf16_optimizer_states: true requires bf16_master_weights_and_grads: true "
                "(DeepSpeed rule)",
                key="bf16_optimizer_states",
            )
        return self


def _params_dict(value: Any) -> Any:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise fail(f"{value!r} is not a JSON object of parameters")
    return value


Params = Annotated[dict[str, Any], BeforeValidator(_params_dict)]


class OptimizerConfig(Section):
    """``optimizer``: which optimizer the engine builds; ``params`` are passed to its builder."""

    type: str
    params: Params = Field(default_factory=dict)
    legacy_fusion: Bool = False

    @field_validator("type", mode="before")
    @classmethod
    def _canonical_type(cls, value: Any) -> str:
        try:
            return canonical_optimizer_name(value)
        except NameProblem as problem:
            raise fail(str(problem)) from None


class SchedulerConfig(Section):
    """``scheduler``: which LR schedule the engine builds; ``params`` go to its builder."""

    type: str
    params: Params = Field(default_factory=dict)

    @field_validator("type", mode="before")
    @classmethod
    def _canonical_type(cls, value: Any) -> str:
        try:
            return canonical_scheduler_name(value)
        except NameProblem as problem:
            raise fail(str(problem)) from None


class TensorBoardConfig(Section):
    """``tensorboard`` monitor."""

    enabled: Bool = False
    output_path: Str = ""
    job_name: Str = "DeepSpeedJobName"


class WandbConfig(Section):
    """``wandb`` monitor."""

    enabled: Bool = False
    group: Str | None = None
    team: Str | None = None
    project: Str = "deepspeed"


class CSVMonitorConfig(Section):
    """``csv_monitor``: metrics written as CSV files."""

    enabled: Bool = False
    output_path: Str = ""
    job_name: Str = "DeepSpeedJobName"


class CommsLoggerConfig(Section):
    """``comms_logger``: count/time collectives (``prof_all`` or only the ops in ``prof_ops``)."""

    enabled: Bool = False
    verbose: Bool = False
    prof_all: Bool = True
    debug: Bool = False
    prof_ops: tuple[Str, ...] = ()


def _selective_policy(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, str) and value in ("save_matmuls", "save_attention"):
        return value
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise fail(f"{value!r} is not one of 'save_matmuls', 'save_attention' or a list of aten operator names")


class ActivationCheckpointingConfig(Section):
    """``activation_checkpointing`` (read by ``zerospeed.checkpointing.configure``).

    ``selective_policy`` is a zerospeed key: which operators' outputs a checkpoint saves (see
    :mod:`zerospeed.checkpointing.selective`); absent, checkpoints recompute everything.
    """

    partition_activations: Bool = False
    cpu_checkpointing: Bool = False
    contiguous_memory_optimization: Bool = False
    number_checkpoints: PosInt | None = None
    synchronize_checkpoint_boundary: Bool = False
    profile: Bool = False
    selective_policy: Annotated[Any, BeforeValidator(_selective_policy)] = None


def _stages(value: Any) -> Any:
    if isinstance(value, str) and value.lower() == "auto":
        return "auto"
    try:
        stages = to_int(value)
    except PydanticCustomError:
        stages = 0
    if stages < 1:
        raise fail(f"{value!r} is not allowed; expected a positive integer or 'auto'")
    return stages


def _partition(value: Any) -> Any:
    if isinstance(value, str) and value.startswith("type:"):
        return value
    if isinstance(value, str) and value.lower() in ("parameters", "uniform"):
        return value.lower()
    raise fail(f"{value!r} is not one of 'parameters', 'uniform', 'type:<regex>'")


class PipelineConfig(Section):
    """``pipeline``: pipeline-parallel engine settings."""

    stages: Annotated[int | Literal["auto"], BeforeValidator(_stages)] = "auto"
    partition: Annotated[str, BeforeValidator(_partition)] = "parameters"
    seed_layers: Bool = False
    activation_checkpoint_interval: NonNegInt = 0
    schedule: Annotated[
        Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"],
        one_of("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", case_insensitive=True),
    ] = "1f1b"
    virtual_stages: PosInt = 1
    pipe_partitioned: Bool = True
    grad_partitioned: Bool = True

    @model_validator(mode="after")
    def _interleaving(self) -> PipelineConfig:
        if self.schedule == "interleaved_1f1b" and self.virtual_stages < 2:
            raise fail(
                "schedule 'interleaved_1f1b' needs virtual_stages >= 2", key="virtual_stages"
            )
        return self


class ParallelWriteConfig(Section):
    """``checkpoint.parallel_write``."""

    pipeline_stage: Bool = False


class CheckpointConfig(Section):
    """``checkpoint``: tag validation, universal loading, storage options."""

    tag_validation: Annotated[
        Literal["Warn", "Ignore", "Fail"], one_of("Warn", "Ignore", "Fail", case_insensitive=True)
    ] = "Warn"
    load_universal: Bool = False
    use_node_local_storage: Bool = False
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    async_save: Bool = False


class DataTypesConfig(Section):
    """``data_types``: dtype overrides (``grad_accum_dtype``: dtype of accumulated gradients)."""

    grad_accum_dtype: DType | None = None
    param_dtype: DType | None = None
    buffer_dtype: DType | None = None

