"""The top-level resolved configuration object, :class:`ZeroSpeedConfig`.

Attribute names are DeepSpeed's key names, so code and users read ``cfg.zero_optimization.stage``
exactly as they wrote it in JSON.  Build it with :func:`zerospeed.config.load_config`; constructing
it directly skips the removed/unsupported/``"auto"`` passes.

Decisions:

* The batch triple is resolved while validating (DeepSpeed rules, see
  :mod:`zerospeed.config.batch`) for the ``dp_world_size`` passed in the validation context, so the
  three attributes are always consistent ints.  The original user dict is kept (private) so
  ``load_config(cfg, dp_world_size=n)`` can re-resolve for another world size.
* Cross-section rules DeepSpeed enforces are enforced here: fp16 and bf16 are exclusive; bf16/fp16
  master-weight options need ZeRO stage 1-3.
* ``seed``, ``checkpoint.async_save`` and ``fast_paths`` are zerospeed additions (DeepSpeed has no
  such keys).
"""

from __future__ import annotations

import copy
import json
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, PrivateAttr, ValidationInfo, model_validator

from .batch import GAS, MBS, TBS, resolve_batch
from .fields import (
    FP32_MAX,
    Bool,
    DType,
    bounded,
    NonNegFloat,
    NonNegInt,
    PosInt,
    Section,
    fail,
    one_of,
)
from .sections import (
    ActivationCheckpointingConfig,
    BF16Config,
    CheckpointConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    DataTypesConfig,
    FP16Config,
    OptimizerConfig,
    PipelineConfig,
    SchedulerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from .tensor_parallel import TensorParallelConfig
from .expert_parallel import ExpertParallelConfig
from .compression import CompressionConfig
from .autotuning import AutotuningConfig
from .zero import AioConfig, ZeroConfig
from .flops_profiler import FlopsProfilerConfig
from .torch_autocast import TorchAutocastConfig
from .compile import CompileConfig
from .fast_paths import FastPathsConfig
from .hybrid_engine import HybridEngineConfig

Precision = Literal["fp32", "fp16", "bf16"]


def _positive_or_none(data: dict[str, Any], key: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(f"{value!r} is not a positive integer", key=key)
    if isinstance(value, float) and not value.is_integer():
        raise fail(f"{value!r} is not a positive integer", key=key)
    if value < 1:
        raise fail(f"{value!r} is not allowed; must be a positive integer", key=key)
    return int(value)


class ZeroSpeedConfig(Section):
    """A validated, resolved DeepSpeed-format configuration (frozen)."""

    train_batch_size: PosInt
    train_micro_batch_size_per_gpu: PosInt
    gradient_accumulation_steps: PosInt
    gradient_clipping: NonNegFloat = 1.0
    """Max global gradient norm; 0 disables clipping. Default 1.0, as DeepSpeed 0.19.8
    (``GRADIENT_CLIPPING_DEFAULT`` in ``deepspeed/runtime/constants.py``): a config without the key clips."""
    steps_per_print: NonNegInt = 10
    wall_clock_breakdown: Bool = False
    memory_breakdown: Bool = False
    seed: Annotated[int, bounded(int, -(2 ** 63), 2 ** 64 - 1, "the range torch.manual_seed accepts")] | None = None
    prescale_gradients: Bool = False
    gradient_predivide_factor: Annotated[float, bounded(float, 1.0 / FP32_MAX, FP32_MAX, "gradients are scaled by "
                                                        "its reciprocal, which must be finite in fp32")] = 1.0
    gradient_allreduce_op: Annotated[
        Literal["mean", "sum"], one_of("mean", "sum", case_insensitive=True)
    ] = "mean"
    communication_data_type: DType | None = None
    sequence_parallel_size: PosInt = 1
    """Ulysses sequence-parallel degree: the sp axis of the (pp, dp, sp, tp) mesh (zerospeed.sequence)."""
    seq_parallel_comm_data_type: DType = "fp32"
    zero_allow_untested_optimizer: Bool = False
    zero_force_ds_cpu_optimizer: Bool = True
    dataloader_drop_last: Bool = False
    disable_allgather: Bool = False
    dump_state: Bool = False
    vocabulary_size: PosInt | None = None
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(
        default_factory=BF16Config, validation_alias=AliasChoices("bf16", "bfloat16")
    )
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    aio: AioConfig = Field(default_factory=AioConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    compression_training: CompressionConfig | None = None
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    fast_paths: FastPathsConfig = Field(default_factory=FastPathsConfig)
    """zerospeed addition: switches of the hardware-specific fast paths (see config/fast_paths.py)."""
    hybrid_engine: HybridEngineConfig = Field(default_factory=HybridEngineConfig)
    """Rollouts on the live training weights (config/hybrid_engine.py, zerospeed.rl)."""

    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)
    _dp_world_size: int = PrivateAttr(default=1)

    @model_validator(mode="before")
    @classmethod
    def _resolve_batch(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict):
            return data
        context = info.context or {}
        sizes = resolve_batch(
            _positive_or_none(data, TBS),
            _positive_or_none(data, MBS),
            _positive_or_none(data, GAS),
            dp_world_size=context.get("dp_world_size", 1),
            auto_keys=context.get("auto_keys", ()),
        )
        return {**data, TBS: sizes.train_batch_size, MBS: sizes.train_micro_batch_size_per_gpu,
                GAS: sizes.gradient_accumulation_steps}  # fmt: skip

    @model_validator(mode="after")
    def _cross_section_rules(self) -> ZeroSpeedConfig:
        if self.fp16.enabled and self.bf16.enabled:
            raise fail(
                "true conflicts with bf16.enabled: true; enable at most one of fp16 and bf16",
                key="fp16.enabled",
            )
        stage = self.zero_optimization.stage
        for section, flag in (
            ("bf16", "bf16_master_weights_and_grads"),
            ("bf16", "bf16_optimizer_states"),
            ("fp16", "fp16_master_weights_and_grads"),
        ):
            if getattr(getattr(self, section), flag) and stage == 0:
                raise fail(
                    f"true requires zero_optimization.stage 1, 2 or 3 (got {stage})",
                    key=f"{section}.{flag}",
                )
        return self

    @property
    def precision(self) -> Precision:
        """The training precision: ``"fp16"``, ``"bf16"`` or ``"fp32"`` (neither enabled)."""
        if self.fp16.enabled:
            return "fp16"
        if self.bf16.enabled:
            return "bf16"
        return "fp32"

    @property
    def dp_world_size(self) -> int:
        """The data-parallel world size the batch triple was resolved for."""
        return self._dp_world_size

    @property
    def raw(self) -> dict[str, Any]:
        """A copy of the dict the user gave (before aliases, ``"auto"`` and defaults)."""
        return copy.deepcopy(self._raw)

    def get(self, key: str, default: Any = None) -> Any:
        """DeepSpeed's ``engine.config`` is the dict the user passed, and libraries read it as one (transformers'
        ``Trainer.save_model``: ``engine.config.get("zero_optimization", {}).get("stage")``): a copy of the
        top-level value the user gave for ``key`` (before aliases, ``"auto"`` and defaults), else ``default``."""
        return copy.deepcopy(self._raw.get(key, default))

    def given(self, key: str) -> bool:
        """Whether the user's config names the top-level ``key`` (a section left out keeps its defaults, and some
        callers act only on a section the user wrote, e.g. activation checkpointing's ``configure``)."""
        return key in self._raw

    def json_record(self) -> Any:
        """The dict the user gave as JSON data (values JSON cannot hold written as their ``repr``): what a
        checkpoint records of its config, as DeepSpeed records ``ds_config``."""
        return json.loads(json.dumps(self._raw, default=repr))
