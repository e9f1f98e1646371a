"""Inference configuration: DeepSpeed's ``init_inference`` keys (v1, ``DeepSpeedInferenceConfig``)
and FastGen's ``RaggedInferenceEngineConfig`` (v2, for ``build_hf_engine``).

Decisions:

* v1: the config dict and keyword arguments are merged (keywords win, as in DeepSpeed), then
  validated. ``mp_size`` (deprecated in DeepSpeed) is folded into ``tensor_parallel.tp_size``;
  ``max_tokens`` is an alias of ``max_out_tokens``, ``kernel_inject`` of ``replace_with_kernel_inject``.
  ``injection_policy`` / ``tp_group`` hold Python objects (module classes, process groups) and are
  passed through unvalidated beyond their container type. Keys for GPU-only machinery zerospeed
  does not have (``enable_cuda_graph``, ``use_triton``, ``triangular_masking``...) are accepted
  only at their off value, so a config that needs them fails loudly instead of silently.
* v2: ``state_manager.memory_config.mode`` is ``reserve`` (``size`` bytes kept free for everything
  but the KV cache) or ``allocate`` (``size`` KV blocks), as in DeepSpeed.
* Both (zerospeed keys, not DeepSpeed's): the fast-path switches of the CPU inference engine (issue #25,
  :mod:`zerospeed.inference.fast_path_choice`), ``greedy_head`` (``auto``, ``float32``, ``bf16``,
  ``int8``) and ``cpu_kernels`` (``auto``, ``on``, ``off``); ``auto`` measures which is faster here.
  They apply to the kernel-injected engine (v1 with ``replace_with_kernel_inject``) and to v2.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BeforeValidator, ConfigDict, Field, ValidationError
from typing_extensions import Annotated

from .errors import ConfigError
from .fields import Bool, DType, NonNegInt, PosInt, Section, Str, fail, one_of
from .inference_quant import InferenceQuantConfig
from .loader import translate_validation_error


def _off(name: str) -> Any:
    def check(value: Any) -> Any:
        if value not in (False, None, 0):
            raise fail(f"{value!r}: {name} is not supported by zerospeed inference (CPU/GPU torch path); "
                       "leave it false")
        return False
    return BeforeValidator(check)


GreedyHead = Annotated[Literal["auto", "float32", "bf16", "int8"], one_of("auto", "float32", "bf16", "int8")]
CpuKernels = Annotated[Literal["auto", "on", "off"], one_of("auto", "on", "off")]


class InferenceTPConfig(Section):
    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)
    enabled: Bool = True
    tp_size: PosInt = 1
    tp_group: Any = None


class CheckpointSpec(Section):
    """DeepSpeed's checkpoint-json form: ``{"type": ..., "checkpoints": [files], "base_dir": ...}``."""
    type: Str = "HF"
    checkpoints: list[Str] = Field(default_factory=list)
    base_dir: Str = ""
    version: Any = None


class InferenceConfig(Section):
    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True, populate_by_name=True)
    dtype: DType = "fp32"
    tensor_parallel: InferenceTPConfig = Field(default_factory=InferenceTPConfig,
                                               validation_alias=AliasChoices("tensor_parallel", "tp"))
    injection_policy: dict | None = None
    injection_policy_tuple: tuple | None = None
    replace_with_kernel_inject: Bool = Field(False, validation_alias=AliasChoices("replace_with_kernel_inject",
                                                                                  "kernel_inject"))
    checkpoint: Str | CheckpointSpec | None = None
    base_dir: Str = ""
    save_mp_checkpoint_path: Str | None = None
    max_out_tokens: PosInt = Field(1024, validation_alias=AliasChoices("max_out_tokens", "max_tokens"))
    min_out_tokens: PosInt = 1
    keep_module_on_host: Bool = False
    return_tuple: Bool = True
    replace_method: Str = "auto"
    enable_cuda_graph: Annotated[bool, _off("enable_cuda_graph")] = False
    use_triton: Annotated[bool, _off("use_triton")] = False
    triangular_masking: Bool = True
    zero: dict | None = None
    moe: Any = None
    quant: InferenceQuantConfig | None = None  # applied when given or with dtype int8 (inference_quant.py)
    greedy_head: GreedyHead = "auto"  # zerospeed: the greedy LM head of the injected engine
    cpu_kernels: CpuKernels = "auto"  # zerospeed: the C kernels of the injected engine


class MemoryConfig(Section):
    mode: Annotated[Literal["reserve", "allocate"], one_of("reserve", "allocate")] = "reserve"
    size: NonNegInt = 1_000_000_000


class StateManagerConfig(Section):
    max_tracked_sequences: PosInt = 2048
    max_ragged_batch_size: PosInt = 768
    max_ragged_sequence_count: PosInt = 512
    max_context: PosInt = 8192
    memory_config: MemoryConfig = Field(default_factory=MemoryConfig)
    offload: Annotated[bool, _off("offload")] = False


class V2TPConfig(Section):
    tp_size: PosInt = 1


class RaggedInferenceEngineConfig(Section):
    tensor_parallel: V2TPConfig = Field(default_factory=V2TPConfig)
    state_manager: StateManagerConfig = Field(default_factory=StateManagerConfig)
    block_size: PosInt = 16  # zerospeed: KV block size in tokens (DeepSpeed fixes it per kernel)
    dtype: DType = "fp32"  # zerospeed: the model's compute dtype (DeepSpeed takes the checkpoint's)
    greedy_head: GreedyHead = "auto"  # zerospeed: the greedy LM head (auto|float32|bf16|int8)
    cpu_kernels: CpuKernels = "auto"  # zerospeed: the C kernels (auto|on|off)


def _validate(model: type[Section], data: Any, prefix: str) -> Any:
    if isinstance(data, model):
        return data
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"{type(data).__name__} is not a config dict")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = translate_validation_error(exc)
        raise ConfigError(f"{prefix}.{err.key_path}" if prefix else err.key_path, err.problem) from None


def load_inference_config(config: Any = None, **kwargs: Any) -> InferenceConfig:
    """``init_inference``'s ``config`` (dict, JSON path or InferenceConfig) merged with keywords."""
    if isinstance(config, InferenceConfig) and not kwargs:
        return config
    if isinstance(config, str):
        import json

        with open(config) as f:
            config = json.load(f)
    data = dict(config.model_dump(by_alias=False) if isinstance(config, InferenceConfig) else (config or {}))
    data.update(kwargs)
    if "mp_size" in data:
        mp = data.pop("mp_size")
        tp = dict(data.get("tensor_parallel") or data.pop("tp", None) or {})
        tp.setdefault("tp_size", mp)
        data["tensor_parallel"] = tp
    dtype = data.get("dtype")
    if dtype is not None and not isinstance(dtype, str):  # torch.half etc.
        data["dtype"] = {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16",
                         "torch.int8": "int8"}.get(str(dtype), dtype)
    if isinstance(data.get("dtype"), str) and data["dtype"].lower() == "int8":
        # DeepSpeed's int8 inference: int8 weights (the quant section, default if absent), the rest in fp32
        data["dtype"] = "fp32"
        if data.get("quant") is None:
            data["quant"] = {}
    return _validate(InferenceConfig, data, "")


def load_ragged_config(config: Any = None) -> RaggedInferenceEngineConfig:
    return _validate(RaggedInferenceEngineConfig, config or {}, "")
