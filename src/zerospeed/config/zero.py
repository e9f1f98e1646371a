"""``zero_optimization`` (with its offload subsections) and ``aio``.

Defaults and key names follow DeepSpeed's ``deepspeed/runtime/zero/config.py``,
``zero/offload_config.py`` and ``runtime/swap_tensor/constants.py`` (read with the search tool):
bucket sizes 5e8, ``sub_group_size`` 1e9, ``stage3_prefetch_bucket_size`` 5e7,
``stage3_param_persistence_threshold`` 1e5, ``stage3_max_live_parameters`` and
``stage3_max_reuse_distance`` 1e9, offload ``buffer_count`` 4 (optimizer) / 5 (param),
``buffer_size`` 1e8, ``max_in_cpu`` 1e9; aio ``block_size`` 1048576, ``queue_depth`` 8,
``thread_count``/``intra_op_parallelism`` 1, ``single_submit`` false, ``overlap_events`` true.

Decisions:

* ``overlap_comm`` has a stage-dependent default, as in DeepSpeed (``overlap_comm_valid``
  validator: unset means ``stage == 3``): False for stages 0-2, True for stage 3.
* The ``stage3_*`` names are canonical attribute names; DeepSpeed's un-prefixed spellings
  (``prefetch_bucket_size``...) and the ``gather_16bit_weights_on_model_save`` /
  ``stage3_gather_fp16_weights_on_model_save`` spellings are accepted as aliases.
* The stage is accepted in 0..3; whether the engine builds a given stage is the engine's concern.
* ``offload_*.device == "nvme"`` requires ``nvme_path`` (DeepSpeed fails later, at swap time).
* Partial optimizer offload (``ratio`` < 1) is accepted at stages 1-3 (DeepSpeed: stage 3 only);
  it is applied per bucket (see :mod:`zerospeed.zero.offload.tier`).
* ``stage3_collective_timeout_s`` (default 600) is a zerospeed extension: the ZeRO-3 divergence
  watchdog's wait limit per collective (see :mod:`zerospeed.zero.stage3.watchdog`).
* Keys that switch on features zerospeed lacks (ZeRO++ quantization, hpZ, ZenFlow, SuperOffload,
  GDS) are refused before validation by :mod:`zerospeed.config.removed`; what reaches this module
  is off, so those keys are not fields here.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, model_validator

import threading

from .fields import Bool, NonNegFloat, NonNegInt, PosFraction, PosInt, Section, Str, bounded, fail, one_of

OffloadDevice = Annotated[
    Literal["none", "cpu", "nvme"], one_of("none", "cpu", "nvme", case_insensitive=True)
]


class _Offload(Section):
    device: OffloadDevice = "none"
    nvme_path: Str | None = None
    pin_memory: Bool = False

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> _Offload:
        if self.device == "nvme" and not self.nvme_path:
            raise fail(
                "device 'nvme' needs nvme_path (a directory on the NVMe drive)", key="nvme_path"
            )
        return self

    @property
    def enabled(self) -> bool:
        """True when this tier actually offloads (device is ``cpu`` or ``nvme``)."""
        return self.device != "none"


class OffloadOptimizerConfig(_Offload):
    """``zero_optimization.offload_optimizer``: optimizer state (and step) on CPU or NVMe."""

    buffer_count: NonNegInt = 4
    fast_init: Bool = False
    ratio: PosFraction = 1.0
    """Fraction of optimizer state offloaded, in (0, 1] (applied at bucket granularity)."""
    pipeline_read: Bool = False
    pipeline_write: Bool = False
    convert_grad_on_cpu: Bool = True
    cpuadam_cores_perc: Annotated[float, bounded(float, 0.0, 1.0, "a share of the CPU cores; 0 leaves none to the "
                                                                  "optimizer", low_open=True)] = 0.8


class OffloadParamConfig(_Offload):
    """``zero_optimization.offload_param``: stage-3 parameters on CPU or NVMe."""

    buffer_count: NonNegInt = 5
    buffer_size: PosInt = 100_000_000
    """Elements of one swap buffer; a shard larger than it cannot be offloaded, so 0 offloads nothing."""
    max_in_cpu: NonNegInt = 1_000_000_000


def _alias(name: str, *aliases: str) -> Any:
    return AliasChoices(name, *aliases)


class ZeroConfig(Section):
    """``zero_optimization``: what is sharded (``stage``) and how communication is bucketed."""

    stage: Annotated[Literal[0, 1, 2, 3], one_of(0, 1, 2, 3)] = 0
    contiguous_gradients: Bool = True
    reduce_scatter: Bool = True
    reduce_bucket_size: NonNegInt = 500_000_000
    use_multi_rank_bucket_allreduce: Bool = True
    allgather_partitions: Bool = True
    allgather_bucket_size: NonNegInt = 500_000_000
    overlap_comm: Bool = False
    """Default depends on the stage: True for stage 3, False otherwise (DeepSpeed)."""
    load_from_fp32_weights: Bool = True
    elastic_checkpoint: Bool = False
    offload_optimizer: OffloadOptimizerConfig | None = None
    offload_param: OffloadParamConfig | None = None
    sub_group_size: PosInt = 1_000_000_000
    """Elements the optimizer updates at once; 0 would make sub-groups of no elements."""
    stage3_prefetch_bucket_size: NonNegInt = Field(
        50_000_000, validation_alias=_alias("stage3_prefetch_bucket_size", "prefetch_bucket_size")
    )
    stage3_param_persistence_threshold: NonNegInt = Field(
        100_000,
        validation_alias=_alias(
            "stage3_param_persistence_threshold", "param_persistence_threshold"
        ),
    )
    stage3_model_persistence_threshold: NonNegInt = Field(
        sys.maxsize,
        validation_alias=_alias(
            "stage3_model_persistence_threshold", "model_persistence_threshold"
        ),
    )
    stage3_max_live_parameters: NonNegInt = Field(
        1_000_000_000, validation_alias=_alias("stage3_max_live_parameters", "max_live_parameters")
    )
    stage3_max_reuse_distance: NonNegInt = Field(
        1_000_000_000, validation_alias=_alias("stage3_max_reuse_distance", "max_reuse_distance")
    )
    stage3_gather_16bit_weights_on_model_save: Bool = Field(
        False,
        validation_alias=_alias(
            "stage3_gather_16bit_weights_on_model_save",
            "gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
        ),
    )
    stage3_collective_timeout_s: Annotated[float, bounded(float, 0.0, threading.TIMEOUT_MAX,
                                                          "the longest wait the platform can time")] = 600.0
    """zerospeed extension (not a DeepSpeed key): seconds a ZeRO-3 parameter gather or gradient
    reduce-scatter waits for its peers before failing with a report of which rank is at which module
    (control flow that differs between ranks, a dead peer) instead of hanging; 0 waits forever."""
    stage3_module_granularity_threshold: NonNegInt = 0
    stage3_use_all_reduce_for_fetch_params: Bool = False
    stage3_allgather_sequential: Bool = False
    stage3_partition_stream_chunk_size: NonNegInt = 0
    ignore_unused_parameters: Bool = True
    legacy_stage1: Bool = False
    round_robin_gradients: Bool = False
    memory_efficient_linear: Bool = True
    pipeline_loading_checkpoint: Bool = False
    override_module_apply: Bool = True
    log_trace_cache_warnings: Bool = False
    enable_sanity_checks: Bool = False
    save_muon_momentum_buffer_in_memory: Bool = False
    zero_quantized_weights: Bool = False
    """ZeRO++ qwZ (stage 3): parameters are all-gathered as block-wise int8 (zerospeed.zero.zeropp)."""
    zero_quantized_nontrainable_weights: Bool = False
    """ZeRO++ (stage 3): qwZ for the buckets of frozen parameters only."""
    zero_quantized_gradients: Bool = False
    """ZeRO++ qgZ (stage 3): gradients are reduce-scattered as block-wise int4 through all-to-all."""
    zero_hpz_partition_size: PosInt = 1
    """ZeRO++ hpZ (stage 3): ranks of the secondary weight partition (the ranks per node): backward's gathers
    stay inside that group. 1: off."""

    @model_validator(mode="before")
    @classmethod
    def _stage_dependent_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and "overlap_comm" not in data:
            stage = data.get("stage", 0)
            if stage in (0, 1, 2, 3) and not isinstance(stage, bool):
                data = {**data, "overlap_comm": stage == 3}
        return data

    @model_validator(mode="after")
    def _zeropp_needs_stage_3(self) -> "ZeroConfig":
        for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients"):
            if getattr(self, key) and self.stage != 3:
                raise fail(f"ZeRO++ works on stage 3, got stage {self.stage}", key=key)
        if self.zero_hpz_partition_size > 1 and self.stage != 3:
            raise fail(f"ZeRO++ works on stage 3, got stage {self.stage}", key="zero_hpz_partition_size")
        return self

    @property
    def stage3_gather_fp16_weights_on_model_save(self) -> bool:
        """DeepSpeed's old name for :attr:`stage3_gather_16bit_weights_on_model_save`."""
        return self.stage3_gather_16bit_weights_on_model_save


class AioConfig(Section):
    """``aio``: the asynchronous I/O engine used for NVMe offload."""

    block_size: PosInt = 1_048_576
    queue_depth: PosInt = 8
    thread_count: PosInt = Field(1, validation_alias=_alias("thread_count", "intra_op_parallelism"))
    single_submit: Bool = False
    overlap_events: Bool = True
    use_gds: Bool = False
    io_backend: Annotated[
        Literal["async_io", "posix"], one_of("async_io", "posix", case_insensitive=True)
    ] = "async_io"

    @property
    def intra_op_parallelism(self) -> int:
        """DeepSpeed's other name for :attr:`thread_count`."""
        return self.thread_count
