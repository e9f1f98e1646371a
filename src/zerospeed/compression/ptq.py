"""``quantize``: weight-only post-training quantization of a trained model, in place.

Every ``nn.Linear`` and HF ``Conv1D`` whose name matches ``modules`` (regexes; default all) becomes a
:class:`~.quantized.QuantizedLinear` with ``bits`` 8 or 4 and ``group_size`` consecutive input weights
per scale (default: one scale per output row).  Symmetric, nearest rounding.

torchao (0.18, installed with the ``quant`` extra) was evaluated on this torch (2.13, CPU), one
thread, in ``bench/compression_bench.py`` (``bench/results/compression-20261123-211400.md``, the
demo GPT): its ``Int8WeightOnlyConfig`` gave the same forward latency as this module's int8
``QuantizedLinear`` (1.29x fp32 each on the loaded 2-core machine), the same bytes (0.29x) and a
higher peak memory (0.95x vs 0.75x of fp32), and its tensors are subclasses that safetensors cannot
store.  Decision: zerospeed's ``QuantizedLinear`` is the default (packed int4 two per byte,
safetensors round trip, the same layer ``redundancy_clean`` builds); ``backend="torchao"`` applies
torchao's int8 / int4 weight-only configs for users who want them (saved with ``torch.save`` only).
"""

from __future__ import annotations

from torch import nn

from .init import matches
from .layers import kind_of
from .quantized import QuantizedLinear

BITS = (8, 4)


def quantize(model: nn.Module, bits: int = 8, group_size: int | None = None, modules: list[str] | None = None,
             backend: str = "zerospeed") -> nn.Module:
    """Quantize the weights of ``model``'s Linear layers to ``bits`` (8 or 4) in place; returns ``model``."""
    if bits not in BITS:
        raise ValueError(f"quantize: bits={bits!r} is not supported; use 8 or 4")
    if group_size is not None and (not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"quantize: group_size={group_size!r} must be a positive integer or None (per row)")
    patterns = modules or ["*"]
    targets = [(n, m) for n, m in model.named_modules()
               if n and kind_of(m) in ("linear", "conv1d") and matches(n, patterns)]
    if not targets:
        raise ValueError(f"quantize: no Linear layer matches {patterns}")
    if backend == "torchao":
        return _torchao(model, bits, group_size, {id(m) for _, m in targets})
    if backend != "zerospeed":
        raise ValueError(f"quantize: backend={backend!r} is not one of 'zerospeed', 'torchao'")
    for name, module in targets:
        weight = module.weight.detach()
        canonical = weight.t() if kind_of(module) == "conv1d" else weight
        if group_size is not None and canonical.shape[1] % group_size:
            raise ValueError(f"quantize: group_size {group_size} does not divide {name}'s {canonical.shape[1]} "
                             "input features")
        layer = QuantizedLinear.from_weight(canonical.float(), getattr(module, "bias", None), bits, group_size)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    return model


def _torchao(model: nn.Module, bits: int, group_size: int | None, ids: set[int]) -> nn.Module:
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
    except ImportError as err:
        raise ValueError(f"quantize: backend='torchao' needs torchao (pip install zerospeed[quant]): {err}") from None
    if any(kind_of(m) == "conv1d" for m in model.modules() if id(m) in ids):
        raise ValueError("quantize: backend='torchao' quantizes nn.Linear only; HF Conv1D layers need the "
                         "default backend")
    config = Int8WeightOnlyConfig() if bits == 8 else Int4WeightOnlyConfig(group_size=group_size or 128)
    quantize_(model, config, filter_fn=lambda m, _name: id(m) in ids)
    return model
