"""``tensor_parallel``: AutoTP tensor parallelism (DeepSpeed's ``TPTrainingConfig`` keys).

The degree is ``autotp_size`` (training, DeepSpeed's key) or ``tp.tp_size`` (inference form, also
accepted here); :attr:`TensorParallelConfig.size` is the one to read (1 = off). Together with the
pipeline degree it defines the (pp, dp, tp) mesh (:mod:`zerospeed.comm.mesh`).

Decisions:

* ``partition_config`` is parsed here into typed layer specs: each regex must compile (an error
  names ``partition_config.layer_specs[i].patterns[j]``), ``partition_type`` is one of ``row``,
  ``column``, ``skip``, and ``shape`` is a list of positive ints or -1 with at most one nested
  list (unequal fused sub-projections, e.g. ``[[q, k, v], -1]``), at ``partition_dim``.
  Whether a pattern matches anything is the model's business and checked by ``module_inject``.
* ``preset_model`` is one of DeepSpeed's preset names (llama, bloom, chatglm, mixtral,
  deepseek_v2, qwen2, phi3) plus gpt2, gpt_neox, opt which zerospeed also ships.
* ``dtype`` (DeepSpeed's training dtype) is accepted for compatibility; the engine's precision
  comes from ``fp16`` / ``bf16`` as everywhere else. ``replace_with_kernel_inject`` (alias
  ``kernel_inject``) must stay false: zerospeed has no fused inference kernels to inject.
* ``tp.mpu`` / ``tp.tp_group`` (Python objects in DeepSpeed) cannot come from JSON; pass the mpu
  to ``initialize(mpu=...)``.
* Accepted for DeepSpeed configs, with no effect (said here so nobody expects one):
  ``tp_overlap_comm`` (each tp all-reduce is issued as soon as autograd reaches it; overlapping it
  with the next matmul is not built), ``tp_grain_size`` (splits are exact or an error, never
  rounded to a grain), ``keep_module_on_host`` (AutoTP splits the model where it already is).

This file holds the section's models only; :func:`zerospeed.config.loader.parse_tensor_parallel` parses a
section given on its own (it translates errors against the whole schema, which imports this file).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BeforeValidator, Field, field_validator, model_validator

from .fields import Bool, DType, NonNegInt, PosInt, Section, Str, fail, one_of, to_int

PRESET_MODELS = ("llama", "bloom", "chatglm", "mixtral", "deepseek_v2", "qwen2", "phi3", "gpt2", "gpt_neox", "opt")


def _shape_item(value: Any, nested_ok: bool) -> Any:
    if isinstance(value, (list, tuple)):
        if not nested_ok:
            raise fail(f"{value!r}: only one level of nesting is allowed in shape")
        if not value:
            raise fail("a nested shape list cannot be empty")
        return tuple(_shape_item(v, nested_ok=False) for v in value)
    number = to_int(value)
    if number != -1 and number < 1:
        raise fail(f"{value!r} is not allowed in shape; use positive ints or -1")
    return number


def _shape(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value:
        raise fail(f"{value!r} is not a non-empty list of ints")
    return tuple(_shape_item(v, nested_ok=True) for v in value)


class LayerSpecConfig(Section):
    """One ``partition_config.layer_specs`` entry: which parameters, and how they are split."""

    patterns: list[Str]
    partition_type: Annotated[
        Literal["row", "column", "skip"], one_of("row", "column", "skip", case_insensitive=True)
    ] = "column"
    shape: Annotated[tuple[Any, ...] | None, BeforeValidator(_shape)] = None
    partition_dim: NonNegInt | None = None
    model_types: list[Str] | None = None
    gather_output: Bool = False
    grad_allreduce: Bool = False

    @field_validator("patterns")
    @classmethod
    def _compiles(cls, patterns: list[str]) -> list[str]:
        if not patterns:
            raise fail("[] is empty; give at least one regex")
        for i, pattern in enumerate(patterns):
            try:
                re.compile(pattern)
            except re.error as exc:
                raise fail(f"{pattern!r} is not a valid regex ({exc})", key=str(i)) from None
        return patterns

    @model_validator(mode="after")
    def _nesting_at_partition_dim(self) -> LayerSpecConfig:
        if self.shape is None:
            return self
        dim = self.resolved_partition_dim
        if dim >= len(self.shape):
            raise fail(f"{dim} is out of range for shape {list(self.shape)}", key="partition_dim")
        for i, item in enumerate(self.shape):
            if isinstance(item, tuple) and i != dim:
                raise fail(f"a nested list is only allowed at partition_dim {dim}, found at index {i}", key="shape")
        return self

    @property
    def resolved_partition_dim(self) -> int:
        """Dimension of the (reshaped) weight that is split: 0 for column, 1 for row, unless given."""
        if self.partition_dim is not None:
            return self.partition_dim
        return 1 if self.partition_type == "row" else 0


class PartitionConfig(Section):
    """``tensor_parallel.partition_config``: explicit layer specs, matched before any heuristic."""

    layer_specs: list[LayerSpecConfig] = Field(default_factory=list)
    use_default_specs: Bool = True
    strict_mode: Bool = False
    lm_head_patterns: list[Str] = Field(default_factory=lambda: ["lm_head", "embed_out"])
    embedding_partition_dim: NonNegInt = 1
    tp_size: PosInt | None = None


class TPInnerConfig(Section):
    """``tensor_parallel.tp`` (DeepSpeed's ``TPConfig``, the inference form)."""

    tp_size: PosInt = 1
    tp_grain_size: PosInt = 1


def _preset(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, str) and value.lower() in PRESET_MODELS:
        return value.lower()
    raise fail(f"{value!r} is not a known preset; use one of {', '.join(PRESET_MODELS)}")


class TensorParallelConfig(Section):
    """``tensor_parallel``: AutoTP degree, layer specs and presets."""

    autotp_size: NonNegInt = 0
    """Tensor-parallel degree for training; 0 or 1 means off."""
    tp_overlap_comm: Bool = False
    partition_config: PartitionConfig | None = None
    preset_model: Annotated[str | None, BeforeValidator(_preset)] = None
    tp_grain_size: PosInt = 1
    keep_module_on_host: Bool = False
    dtype: DType | None = None
    vocab_parallel_lm_head: Bool | None = None
    tp: TPInnerConfig = Field(default_factory=TPInnerConfig, validation_alias=AliasChoices("tp", "tensor_parallel"))
    replace_with_kernel_inject: Bool = Field(
        default=False, validation_alias=AliasChoices("replace_with_kernel_inject", "kernel_inject"))
    injection_policy_tuple: None = None

    @model_validator(mode="after")
    def _one_degree(self) -> TensorParallelConfig:
        if self.replace_with_kernel_inject:
            raise fail("true is not supported: zerospeed has no fused kernels to inject; use AutoTP (false)",
                       key="replace_with_kernel_inject")
        if self.autotp_size > 1 and self.tp.tp_size > 1 and self.autotp_size != self.tp.tp_size:
            raise fail(f"{self.autotp_size} conflicts with tp.tp_size {self.tp.tp_size}; give one degree",
                       key="autotp_size")
        return self

    @property
    def size(self) -> int:
        """The tensor-parallel degree (1 when off)."""
        return max(self.autotp_size, self.tp.tp_size, 1)

    @property
    def enabled(self) -> bool:
        return self.size > 1
