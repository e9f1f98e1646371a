"""``quantize``: post-training quantization of a trained model (weights, optionally activations), in place.

Every ``nn.Linear`` and HF ``Conv1D`` whose name matches ``modules`` (regexes; default all) becomes a
:class:`~.quantized.QuantizedLinear` with ``bits`` 8 or 4 and ``group_size`` consecutive input weights
per scale (default: one scale per output row) or ``num_groups`` groups per matrix; symmetric by
default, nearest rounding; ``act_bits=8`` adds dynamic per-tensor int8 activations (int8 GEMMs).

torchao (0.18, installed with the ``quant`` extra) was evaluated on this torch (2.13, CPU), one thread:
per Linear at the demo GPT's shapes (1024 tokens; ``bench/compression_bench.py`` for the whole model),
its ``Int8WeightOnlyConfig`` took 1.8-2.3 ms against fp32's 1.5-2.0 ms and its
``Int8DynamicActivationInt8WeightConfig`` 5.3 ms (unfused per-token quantization in eager mode),
against 0.4-1.0 ms for ``QuantizedLinear``'s oneDNN int8 kernel with ``act_bits=8``; its tensors are
subclasses that safetensors cannot store.  Decision: zerospeed's ``QuantizedLinear`` is the default
(packed int4 two per byte, safetensors round trip, the same layer ``redundancy_clean`` builds);
``backend="torchao"`` applies torchao's int8 / int4 weight-only configs for users who want them
(saved with ``torch.save`` only).
"""

from __future__ import annotations

from torch import nn

from .init import matches
from .layers import kind_of
from .quantized import QuantizedLinear

BITS = (8, 4)


def quantize(model: nn.Module, bits: int = 8, group_size: int | None = None, modules: list[str] | None = None,
             backend: str = "zerospeed", *, num_groups: int | None = None, symmetric: bool = True,
             act_bits: int = 0) -> nn.Module:
    """Quantize the weights of ``model``'s Linear layers to ``bits`` (8 or 4) in place; returns ``model``.

    ``group_size``: consecutive input weights per scale (default one scale per output row);
    ``num_groups``: instead, a count of equal groups per weight matrix (DeepSpeed's ``q_groups``);
    ``symmetric``: symmetric (default) or asymmetric grids; ``act_bits=8`` also quantizes each layer's
    input per tensor at run time, so the layer runs int8 x int8 GEMMs (``QuantizedLinear``'s
    ``onednn`` kernel)."""
    if bits not in BITS:
        raise ValueError(f"quantize: bits={bits!r} is not supported; use 8 or 4")
    if group_size is not None and (not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"quantize: group_size={group_size!r} must be a positive integer or None (per row)")
    if num_groups is not None and (not isinstance(num_groups, int) or num_groups < 1 or group_size is not None):
        raise ValueError(f"quantize: num_groups={num_groups!r} must be a positive integer, and not given with "
                         "group_size")
    if act_bits not in (0, 8):
        raise ValueError(f"quantize: act_bits={act_bits!r} is not supported; use 0 (weight-only) or 8")
    patterns = modules or ["*"]
    targets = [(n, m) for n, m in model.named_modules()
               if n and kind_of(m) in ("linear", "conv1d") and matches(n, patterns)]
    if not targets:
        raise ValueError(f"quantize: no Linear layer matches {patterns}")
    _refuse_tp(targets, "quantize")
    if backend == "torchao":
        if act_bits or num_groups is not None or not symmetric:
            raise ValueError("quantize: backend='torchao' is weight-only, symmetric, with group_size; "
                             "act_bits, num_groups and symmetric=False need the default backend")
        return _torchao(model, bits, group_size, {id(m) for _, m in targets})
    if backend != "zerospeed":
        raise ValueError(f"quantize: backend={backend!r} is not one of 'zerospeed', 'torchao'")
    for name, module in targets:
        replace_module(model, name, quantized_linear(name, module, bits, group_size, num_groups, symmetric, act_bits))
    return model


def _refuse_tp(targets: list[tuple[str, nn.Module]], where: str) -> None:
    """A plain QuantizedLinear in place of AutoTP's layer would drop its communication."""
    from .tp import is_tp_linear

    split = [n for n, m in targets if is_tp_linear(m)]
    if split:
        raise ValueError(f"{where}: {split[0]} is a tensor-parallel layer (AutoTP); post-training quantization of a "
                         "split model is not supported: quantize the whole model, or serve int8 under tensor "
                         "parallelism with init_inference(replace_with_kernel_inject=True, quant=...)")


def quantized_linear(name: str, module: nn.Module, bits: int, group_size: int | None = None,
                     num_groups: int | None = None, symmetric: bool = True, act_bits: int = 0,
                     act_symmetric: bool = True) -> QuantizedLinear:
    """A :class:`QuantizedLinear` holding ``module``'s weight (an ``nn.Linear``, HF ``Conv1D`` or any
    module with an ``(out, in)`` ``weight`` and optional ``bias``)."""
    weight = module.weight.detach()
    canonical = weight.t() if kind_of(module) == "conv1d" else weight
    rows, cols = canonical.shape
    if group_size is not None and cols % group_size:
        raise ValueError(f"quantize: group_size {group_size} does not divide {name}'s {cols} input features")
    if num_groups is not None:
        if rows % num_groups:
            raise ValueError(f"quantize: {num_groups} groups do not divide {name}'s {rows} output rows")
        group_size = rows * cols // num_groups
    return QuantizedLinear.from_weight(canonical.float(), getattr(module, "bias", None), bits, group_size,
                                       symmetric=symmetric, act_bits=act_bits, act_symmetric=act_symmetric)


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


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
