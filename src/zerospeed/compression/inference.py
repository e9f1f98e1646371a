"""``quantize_for_inference``: what ``init_inference``'s ``quant`` section (or ``dtype=int8``) does.

The parsed section (:class:`zerospeed.config.inference_quant.InferenceQuantConfig`, whose docstring
states the key semantics) becomes :func:`~.ptq.quantize`-style replacements, in place, of every
``nn.Linear`` / HF ``Conv1D`` of the model ``init_inference`` serves -- the user's HF model, or
zerospeed's injected model, whose row-parallel projections (``RowLinear``) are quantized too -- by
:class:`~.quantized.QuantizedLinear` (int8 / int4 codes, weight-only, or int8 x int8 GEMMs with
``activation.enabled``).

Decision: with tensor parallelism on the injected path, each rank quantizes its own shard
(column-parallel layers hold whole rows, so their per-row scales are the single-process ones;
row-parallel shards get scales of their own slice, and their partial products are all-reduced
after dequantization, as in the floating-point layer).  Embeddings and norms stay floating point.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerospeed.comm.collectives import all_reduce
from zerospeed.config.inference_quant import InferenceQuantConfig

from .layers import kind_of
from .ptq import quantized_linear, replace_module
from .quantized import QuantizedLinear

#: module names (last component) of attention q/k/v projections, left alone with ``qkv.enabled: false``
QKV_NAMES = frozenset({"qkv", "c_attn", "query_key_value", "q_proj", "k_proj", "v_proj", "query", "key", "value",
                       "Wqkv", "qkv_proj"})


class QuantizedRowLinear(nn.Module):
    """A row-parallel projection with quantized local weights: ``all_reduce(q(x_local)) + bias``."""

    def __init__(self, inner: QuantizedLinear, bias: torch.Tensor | None, tp: Any) -> None:
        super().__init__()
        self.inner, self.tp = inner, tp
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if self.tp.size > 1:  # partial products of the input-feature shards
            all_reduce(y, group=self.tp.group)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class _Unbiased(nn.Module):
    """A view of a module's weight without its bias (the bias of a row-parallel layer is added after the reduce)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None


def quantize_for_inference(model: nn.Module, quant: InferenceQuantConfig,
                           row_parallel: tuple[type[nn.Module], ...] = ()) -> nn.Module:
    """Apply ``quant`` to ``model`` in place (see the module docstring); returns ``model``.

    ``row_parallel``: the classes of the model's row-parallel projections (a ``weight`` split along its input
    features, a ``bias``, and ``tp`` with the group's ``size`` and ``group``; partial products all-reduced).
    ``init_inference`` passes its injected models' ``RowLinear``; compression, a lower layer than inference,
    does not import it.
    """
    if not quant.enabled:
        return model
    if not quant.weight.enabled:
        if quant.activation.enabled:
            raise ValueError("quant.activation.enabled: int8 activations need int8 weights; set "
                             "quant.weight.enabled true")
        return model
    group_wise = quant.group_wise()
    targets = []
    for name, module in model.named_modules():
        row = isinstance(module, row_parallel)
        if not name or (kind_of(module) not in ("linear", "conv1d") and not row):
            continue
        if not quant.qkv.enabled and name.rpartition(".")[2] in QKV_NAMES:
            continue
        keys = [k for k in group_wise if k in name]
        if len(keys) > 1:
            raise ValueError(f"quant.weight.post_init_quant: module {name!r} matches several keys {keys}")
        targets.append((name, module, row, group_wise[keys[0]] if keys else None))
    if not targets:
        raise ValueError("quant: the model has no Linear layer to quantize")
    from .ptq import _refuse_tp

    _refuse_tp([(n, m) for n, m, _, _ in targets], "quant")
    act_bits = 8 if quant.activation.enabled else 0
    act_symmetric = quant.activation.q_type == "symmetric"
    for name, module, row, entry in targets:
        if entry is not None:
            key, bits, group_size, groups, symmetric = ("quant.weight.post_init_quant", entry.num_bits,
                                                        entry.group_size, None, entry.symmetric)
        else:
            key, bits, group_size, groups, symmetric = ("quant.weight.q_groups", quant.weight.num_bits, None,
                                                        quant.weight.q_groups, quant.weight.q_type == "symmetric")
        split_row = row and module.tp.size > 1
        source = _Unbiased(module.weight) if split_row else module
        try:
            layer = quantized_linear(name, source, bits, group_size, groups, symmetric, act_bits, act_symmetric)
        except ValueError as err:
            raise ValueError(f"{key}: {str(err).removeprefix('quantize: ')}") from None
        replace_module(model, name, QuantizedRowLinear(layer, module.bias, module.tp) if split_row else layer)
    return model
