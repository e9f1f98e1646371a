"""``init_inference``'s ``quant`` section: DeepSpeed's inference ``QuantizationConfig``, applied.

Shape (DeepSpeed's keys)::

    quant:
      enabled: true
      weight:     {enabled: true, num_bits: 8, q_type: symmetric, q_groups: 1,
                   quantized_initialization: {}, post_init_quant: {}}
      activation: {enabled: false, num_bits: 8, q_type: symmetric, q_groups: 1}
      qkv:        {enabled: true}

Decisions:

* The section is applied when it is given (and ``enabled``), or when ``dtype`` is ``int8`` (DeepSpeed's
  switch for int8 inference; the non-quantized parts then compute in fp32).  Without either, nothing
  is quantized.
* ``weight.num_bits`` is 8 or 4; ``weight.q_groups`` is DeepSpeed's count of scale groups per weight
  matrix (1: one scale for the whole matrix); it must divide the matrix's rows.  ``q_type``
  symmetric or asymmetric.
* ``activation.enabled`` defaults to **false** here (DeepSpeed's model says true, but its v1 engine
  never quantizes activations, so a DeepSpeed config that does not mention it means weight-only
  int8).  When set: ``num_bits`` 8, per-tensor (``q_groups`` 1), dynamic range; the Linear layers then
  run int8 x int8 GEMMs.
* ``qkv.enabled: false`` leaves the attention q/k/v projections in floating point.
* ``weight.post_init_quant`` / ``weight.quantized_initialization`` (DeepSpeed's ZeRO-Inference
  group-wise form) map a module-name *substring* to ``{num_bits, group_size, group_dim, symmetric}``
  and override the section's weight settings for the modules they match; both are applied after
  loading (zerospeed has no quantized construction); ``group_dim`` must be 1 (groups along the input
  features of an ``(out, in)`` weight).  A module matching two keys is an error, as in DeepSpeed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator

from .fields import Bool, PosInt, Section, fail, one_of, to_int

QType = Annotated[Literal["symmetric", "asymmetric"], one_of("symmetric", "asymmetric")]


def _weight_bits(value: Any) -> int:
    bits = to_int(value)
    if bits not in (4, 8):
        raise fail(f"{value!r} bits is not supported for inference weights; use 8 or 4")
    return bits


def _act_bits(value: Any) -> int:
    bits = to_int(value)
    if bits != 8:
        raise fail(f"{value!r} bits is not supported for inference activations; use 8")
    return bits


class GroupWiseQuant(Section):
    """One ``post_init_quant`` entry."""
    num_bits: Annotated[int, BeforeValidator(_weight_bits)] = 8
    group_size: PosInt | None = None
    group_dim: Annotated[int, BeforeValidator(to_int)] = 1
    symmetric: Bool = False

    @field_validator("group_dim")
    @classmethod
    def _dim(cls, value: int) -> int:
        if value != 1:
            raise fail(f"{value!r}: only group_dim 1 (groups along a Linear weight's input features) is supported")
        return value


class WeightQuant(Section):
    enabled: Bool = True
    num_bits: Annotated[int, BeforeValidator(_weight_bits)] = 8
    q_type: QType = "symmetric"
    q_groups: PosInt = 1
    quantized_initialization: dict[str, GroupWiseQuant] = Field(default_factory=dict)
    post_init_quant: dict[str, GroupWiseQuant] = Field(default_factory=dict)


class ActivationQuant(Section):
    enabled: Bool = False
    num_bits: Annotated[int, BeforeValidator(_act_bits)] = 8
    q_type: QType = "symmetric"
    q_groups: PosInt = 1

    @field_validator("q_groups")
    @classmethod
    def _per_tensor(cls, value: int) -> int:
        if value != 1:
            raise fail(f"{value!r}: activations are quantized per tensor; q_groups must be 1")
        return value


class QKVQuant(Section):
    enabled: Bool = True


class InferenceQuantConfig(Section):
    enabled: Bool = True
    weight: WeightQuant = Field(default_factory=WeightQuant)
    activation: ActivationQuant = Field(default_factory=ActivationQuant)
    qkv: QKVQuant = Field(default_factory=QKVQuant)

    def group_wise(self) -> dict[str, GroupWiseQuant]:
        """``quantized_initialization`` and ``post_init_quant`` together (the latter wins on a shared key)."""
        return {**self.weight.quantized_initialization, **self.weight.post_init_quant}
