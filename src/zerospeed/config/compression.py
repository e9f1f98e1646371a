"""``compression_training``: DeepSpeed's compression section, parsed into typed objects.

Shape of the section (DeepSpeed's, kept key for key)::

    compression_training:
      weight_quantization:   {shared_parameters: {...}, different_groups: {name: {params, modules}}}
      activation_quantization, sparse_pruning, row_pruning, head_pruning, channel_pruning: same shape
      layer_reduction: {enabled, keep_number_layer, module_name_prefix, teacher_layer, other_module_name}

Every technique is a :class:`Technique` with its own ``shared_parameters`` model and group-``params``
model; ``different_groups`` keeps the user's group names in order.  ``modules`` (and the inner lists of
``related_modules``) are regular expressions matched with ``re.search`` against module names, as
DeepSpeed does; they are compiled here so a bad pattern is a config error naming its key.

Decisions:

* Defaults are DeepSpeed's compression defaults (``modules: ["*"]`` meaning every module of a kind
  the technique applies to, ``quantization_period`` 1, sparse ``method`` l1, ``block_pattern`` 4x1,
  ``schedule_offset_end`` = ``schedule_offset``, row/channel ``method`` l1, head ``method`` topk).
* Bits are 1..16 (1 = binary, 2 = ternary, as in XTC); ``target_bits`` may not exceed
  ``start_bits`` (the schedule only lowers precision).
* ``dense_ratio`` is a fraction in (0, 1].
* ``quantize_verbose`` and ``quantizer_kernel`` are accepted and have no effect (logging and a CUDA
  kernel switch in DeepSpeed); ``fp16_mixed_quantize`` is parsed and honoured as DeepSpeed's
  gradual mix of the fp weight into the quantized one.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from .fields import Bool, Fraction, NonNegInt, PosFraction, PosInt, Section, Str, fail, one_of, to_int

MAX_BITS = 16


def _bits(value: Any) -> int:
    number = to_int(value)
    if not 1 <= number <= MAX_BITS:
        raise fail(f"{value!r} bits is not supported; use 1 (binary), 2 (ternary) or 3..{MAX_BITS}")
    return number


Bits = Annotated[int, BeforeValidator(_bits)]
QuantType = Annotated[Literal["symmetric", "asymmetric"], one_of("symmetric", "asymmetric")]


def _pattern_list(value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise fail(f"{value!r} is not a list of module-name patterns (regular expressions)")
    for pattern in value:
        if pattern == "*":
            continue
        try:
            re.compile(pattern)
        except re.error as err:
            raise fail(f"{pattern!r} is not a valid regular expression ({err})") from None
    return list(value)


Patterns = Annotated[list[str], BeforeValidator(_pattern_list)]


def _related(value: Any) -> list[list[str]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise fail(f"{value!r} is not a list of lists of module-name patterns")
    return [_pattern_list(v) for v in value]


Related = Annotated[list[list[str]] | None, BeforeValidator(_related)]


class FP16MixedQuantize(Section):
    enabled: Bool = False
    quantize_change_ratio: Fraction = 0.001


class WeightQuantShared(Section):
    enabled: Bool = False
    quantizer_kernel: Bool = False
    schedule_offset: NonNegInt = 0
    quantize_groups: PosInt = 1
    quantize_verbose: Bool = False
    quantization_type: QuantType = "symmetric"
    quantize_weight_in_forward: Bool = False
    rounding: Annotated[Literal["nearest", "stochastic"], one_of("nearest", "stochastic")] = "nearest"
    fp16_mixed_quantize: FP16MixedQuantize = Field(default_factory=FP16MixedQuantize)


class WeightQuantParams(Section):
    start_bits: Bits
    target_bits: Bits
    quantization_period: NonNegInt = 1

    @model_validator(mode="after")
    def _lowers(self) -> WeightQuantParams:
        if self.target_bits > self.start_bits:
            raise fail(f"{self.target_bits} is above start_bits {self.start_bits}; the schedule only lowers "
                       "the bit width", key="target_bits")
        return self


class ActQuantShared(Section):
    enabled: Bool = False
    quantization_type: QuantType = "symmetric"
    range_calibration: Annotated[Literal["dynamic", "static"], one_of("dynamic", "static")] = "dynamic"
    schedule_offset: NonNegInt = 0


class ActQuantParams(Section):
    bits: Bits


class SparseShared(Section):
    enabled: Bool = False
    method: Annotated[Literal["l1", "topk", "snip_momentum"], one_of("l1", "topk", "snip_momentum")] = "l1"
    schedule_offset: NonNegInt = 1000
    schedule_offset_end: NonNegInt | None = None
    schedule_offset_stride: PosInt = 1
    block_pattern: Str = "4x1"
    dense_ratio: PosFraction | None = None
    excluded_modules: Patterns = Field(default_factory=list)

    @field_validator("block_pattern")
    @classmethod
    def _block(cls, value: str) -> str:
        if not re.fullmatch(r"\d+x\d+", value) or "0" in value.split("x"):
            raise fail(f"{value!r} is not a block pattern like '4x1' (rows x columns, positive)")
        return value

    @model_validator(mode="after")
    def _end_after_start(self) -> SparseShared:
        if self.schedule_offset_end is not None and self.schedule_offset_end < self.schedule_offset:
            raise fail(f"{self.schedule_offset_end} is before schedule_offset {self.schedule_offset}",
                       key="schedule_offset_end")
        return self


class PruneShared(Section):
    enabled: Bool = False
    method: Annotated[Literal["l1", "topk"], one_of("l1", "topk")] = "l1"
    schedule_offset: NonNegInt = 1000


class HeadPruneShared(PruneShared):
    method: Annotated[Literal["l1", "topk"], one_of("l1", "topk")] = "topk"
    num_heads: PosInt | None = None


class DenseRatioParams(Section):
    dense_ratio: PosFraction


class _Group(Section):
    modules: Patterns = Field(default_factory=lambda: ["*"])
    related_modules: Related = None


class WeightQuantGroup(_Group):
    params: WeightQuantParams


class ActQuantGroup(_Group):
    params: ActQuantParams


class PruneGroup(_Group):
    params: DenseRatioParams


class WeightQuantization(Section):
    shared_parameters: WeightQuantShared = Field(default_factory=WeightQuantShared)
    different_groups: dict[str, WeightQuantGroup] = Field(default_factory=dict)


class ActivationQuantization(Section):
    shared_parameters: ActQuantShared = Field(default_factory=ActQuantShared)
    different_groups: dict[str, ActQuantGroup] = Field(default_factory=dict)


class SparsePruning(Section):
    shared_parameters: SparseShared = Field(default_factory=SparseShared)
    different_groups: dict[str, PruneGroup] = Field(default_factory=dict)


class RowPruning(Section):
    shared_parameters: PruneShared = Field(default_factory=PruneShared)
    different_groups: dict[str, PruneGroup] = Field(default_factory=dict)


class HeadPruning(Section):
    shared_parameters: HeadPruneShared = Field(default_factory=HeadPruneShared)
    different_groups: dict[str, PruneGroup] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _heads_given(self) -> HeadPruning:
        if self.shared_parameters.enabled and self.shared_parameters.num_heads is None:
            raise fail("is required when head pruning is enabled", key="shared_parameters.num_heads")
        return self


class ChannelPruning(Section):
    shared_parameters: PruneShared = Field(default_factory=PruneShared)
    different_groups: dict[str, PruneGroup] = Field(default_factory=dict)


class LayerReduction(Section):
    enabled: Bool = False
    keep_number_layer: PosInt | None = None
    module_name_prefix: Str = ""
    teacher_layer: list[Annotated[int, BeforeValidator(to_int)]] = Field(default_factory=list)
    other_module_name: list[Str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> LayerReduction:
        if not self.enabled:
            return self
        if self.keep_number_layer is None:
            raise fail("is required when layer_reduction is enabled", key="keep_number_layer")
        if not self.module_name_prefix:
            raise fail("is required when layer_reduction is enabled", key="module_name_prefix")
        if len(self.teacher_layer) != self.keep_number_layer:
            raise fail(f"lists {len(self.teacher_layer)} layers but keep_number_layer is "
                       f"{self.keep_number_layer}; give one teacher layer per kept layer", key="teacher_layer")
        if any(i < 0 for i in self.teacher_layer) or len(set(self.teacher_layer)) != len(self.teacher_layer):
            raise fail(f"{self.teacher_layer} must be distinct non-negative layer indices", key="teacher_layer")
        return self


class CompressionConfig(Section):
    """The whole ``compression_training`` section."""

    weight_quantization: WeightQuantization = Field(default_factory=WeightQuantization)
    activation_quantization: ActivationQuantization = Field(default_factory=ActivationQuantization)
    sparse_pruning: SparsePruning = Field(default_factory=SparsePruning)
    row_pruning: RowPruning = Field(default_factory=RowPruning)
    head_pruning: HeadPruning = Field(default_factory=HeadPruning)
    channel_pruning: ChannelPruning = Field(default_factory=ChannelPruning)
    layer_reduction: LayerReduction = Field(default_factory=LayerReduction)

    @property
    def any_enabled(self) -> bool:
        techniques = (self.weight_quantization, self.activation_quantization, self.sparse_pruning,
                      self.row_pruning, self.head_pruning, self.channel_pruning)
        return self.layer_reduction.enabled or any(t.shared_parameters.enabled for t in techniques)
