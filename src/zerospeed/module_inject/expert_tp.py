"""Expert tensor parallelism: one MoE expert's FFN split over the tensor-parallel group.

``split_expert_ffn(expert, tp_group, tp_size, tp_rank)`` replaces, in place, the ``nn.Linear``
layers of an expert (an FFN such as ``Linear(M, F) -> act -> Linear(F, M)``, or gated
``gate_proj``/``up_proj`` -> ``down_proj``) with the tensor-parallel layers of
:mod:`zerospeed.module_inject.layers`: every linear but the last is column-parallel (its output
features split), the last is row-parallel (its input features split, output all-reduced over the
tp group, bias added once after the reduction). This is Megatron's MLP split, which DeepSpeed's
``enable_expert_tensor_parallelism`` expects of the expert.

Decisions:

* The split must be exact: every column layer reads the expert's input (``in_features`` equal to
  the last layer's ``out_features``) and writes the hidden size the last layer reads; anything
  else (a deeper MLP, a non-linear layer with weights) is refused naming the layer and the sizes,
  since a column layer after a column layer would read a sharded input.
* Parameter names do not change (``<expert>.0.weight`` stays), and each layer records its
  :class:`~zerospeed.module_inject.tp_shard.TPSplit`, so :func:`zerospeed.module_inject.tp_param_splits`,
  the tp checkpoint layout and the tp consolidation treat expert pieces as any other tp shard.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerospeed.module_inject.layers import LinearAllreduce, LinearLayer
from zerospeed.module_inject.tp_shard import TPSplit

__all__ = ["ExpertTPError", "split_expert_ffn"]


class ExpertTPError(ValueError):
    """An expert that cannot be split column -> row exactly (the message names the layer and sizes)."""


def _parent(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, attr = name.rpartition(".")
    return (module.get_submodule(parent_name) if parent_name else module), attr


def split_expert_ffn(expert: nn.Module, tp_group: Any, tp_size: int, tp_rank: int) -> nn.Module:
    """``expert`` with its linears replaced by this tp rank's column / row pieces (see module docstring)."""
    linears = [(n, m) for n, m in expert.named_modules() if type(m) is nn.Linear]
    if len(linears) < 2:
        raise ExpertTPError(f"expert tensor parallelism: the expert {type(expert).__name__} has {len(linears)} "
                            "nn.Linear layer(s); it needs column-parallel input layer(s) and a row-parallel output "
                            "layer")
    last_name, last = linears[-1]
    hidden, inner = last.out_features, last.in_features
    for name, m in linears[:-1]:
        if m.in_features != hidden or m.out_features != inner:
            raise ExpertTPError(f"expert tensor parallelism: layer {name} is [{m.in_features} -> {m.out_features}], "
                                f"expected [{hidden} -> {inner}] (every layer before {last_name} must read the "
                                "expert's input and feed the output layer)")
    if inner % tp_size:
        raise ExpertTPError(f"expert tensor parallelism: the expert's inner size {inner} is not divisible by "
                            f"tp={tp_size}")
    if tp_size == 1:
        return expert
    args = (tp_group, tp_size, tp_rank)
    with torch.no_grad():
        for name, m in linears[:-1]:
            parent, attr = _parent(expert, name)
            split = TPSplit(tuple(m.weight.shape), 0, (inner,), tp_size)
            bias_split = TPSplit((inner,), 0, (inner,), tp_size) if m.bias is not None else None
            setattr(parent, attr, LinearLayer(m.weight, m.bias, split, bias_split, *args))
        parent, attr = _parent(expert, last_name)
        split = TPSplit(tuple(last.weight.shape), 1, (inner,), tp_size)
        setattr(parent, attr, LinearAllreduce(last.weight, last.bias, split, *args))
    return expert
