"""Counting FLOPs with ``torch.utils.flop_counter.FlopCounterMode``, plus the formulas it lacks.

Decisions:

* Counts come from torch's own per-operator formulas (matmul, addmm, bmm, baddbmm, convolution,
  scaled-dot-product attention, forward and backward), attributed to modules through the mode's
  module tracker; nothing here is a hand-written table of layer types.
* torch 2.13's registry has no formula for the CPU flash-attention kernels
  (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward), so attention would read
  zero on CPU. They are added through ``FlopCounterMode(custom_mapping=...)`` (its public
  extension point, no registry mutation), reusing torch's own SDPA formulas.
* Every counted operator is a multiply-accumulate kernel whose formula counts 2 FLOPs per MAC, so
  MACs are FLOPs / 2. Element-wise work (activations, norms, softmax) is not counted, as in
  torch's counter; on transformer workloads it is well under 1% of the matmul FLOPs.
* Causal attention is counted as the full T x T product (torch's formula, and the convention of
  the 6·N·tokens + 12·L·d·T model-FLOPs estimate).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count


def _cpu_flash_forward(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_flash_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None,
                        **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _extra_formulas() -> dict[Any, Any]:
    aten = torch.ops.aten
    extra: dict[Any, Any] = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        extra[aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_flash_forward
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        extra[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_flash_backward
    return extra


def flop_counter() -> FlopCounterMode:
    """A silent FlopCounterMode tracking the whole module hierarchy, with the CPU SDPA formulas."""
    return FlopCounterMode(display=False, depth=None, custom_mapping=_extra_formulas())


def module_flops(counter: FlopCounterMode, root: torch.nn.Module) -> tuple[int, dict[str, int]]:
    """(total FLOPs, FLOPs per module name as in ``root.named_modules()``; ``""`` is the root).

    The counter names modules ``<RootClass>.<path>``; the root's own entry holds everything run
    inside it, ``Global`` everything counted.
    """
    counts = counter.get_flop_counts()
    total = int(sum(counts.get("Global", {}).values()))
    prefix = type(root).__name__
    out: dict[str, int] = {}
    for name, per_op in counts.items():
        if name == prefix:
            out[""] = int(sum(per_op.values()))
        elif name.startswith(prefix + "."):
            out[name[len(prefix) + 1:]] = int(sum(per_op.values()))
    return total, out
