"""The three tensor-parallel communication patterns, as autograd functions over the tp group.

* :func:`copy_to_tp` -- forward identity, backward all-reduce (input of a column-parallel layer:
  each rank's input gradient is only its shard's contribution).
* :func:`reduce_from_tp` -- forward all-reduce, backward identity (output of a row-parallel layer).
* :func:`gather_from_tp` -- forward all-gather along the last dimension, backward the local slice
  (output of the vocabulary-parallel LM head).

Column-parallel layers that read the same input (q, k, v; gate, up) share one :func:`copy_to_tp`
output, so their input gradients are summed by autograd first and all-reduced once, not once per
layer (Megatron's fused region): the last copy is remembered per tp group until a row-parallel
layer (or the LM head) closes the region, or the input changes (another tensor, or an in-place
write bumping its version).

Every collective goes through :mod:`zerospeed.comm` (counted); under ``torch.compile`` through its
custom ops (:mod:`zerospeed.comm.traceable`), so the collectives are nodes of the graph instead of
graph breaks. When autograd is off
(``torch.no_grad()`` / inference mode) or the input does not require grad, the collective is
called directly, with no ``autograd.Function`` in the way: inference pays for the communication
and nothing else.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm
from zerospeed.comm import traceable


def _tracking(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return traceable.all_reduce_sum(x, traceable.group_id(group))
    x = x.contiguous()
    comm.all_reduce(x, group=group)
    return x


def _gather_last(x: torch.Tensor, group: Any, tp_size: int) -> torch.Tensor:
    if torch.compiler.is_compiling():
        out = traceable.all_gather_stack(x, traceable.group_id(group), tp_size)
        return torch.cat(out.unbind(0), dim=-1)
    x = x.contiguous()
    out = x.new_empty((tp_size, *x.shape))
    comm.all_gather(out, x, group=group)
    return torch.cat(out.unbind(0), dim=-1)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x.clone() if x._base is not None else x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, tp_size: int, tp_rank: int) -> torch.Tensor:
        ctx.local, ctx.rank = x.shape[-1], tp_rank
        return _gather_last(x, group, tp_size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad.narrow(-1, ctx.rank * ctx.local, ctx.local).contiguous(), None, None, None


_OPEN_REGION: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # id(group) -> (input, version, copy)


def copy_to_tp(x: torch.Tensor, group: Any, tp_size: int) -> torch.Tensor:
    if tp_size == 1 or not _tracking(x):
        return x
    if torch.compiler.is_compiling():
        # Dynamo cannot read a version counter (data-dependent): inside a graph the region is keyed
        # on the input tensor alone (a traced graph has no in-place writes on a layer's input between
        # the column layers reading it)
        gid = -1 - traceable.group_id(group)
        open_region = _OPEN_REGION.get(gid)
        if open_region is not None and open_region[0] is x:
            return open_region[2]
        y = _CopyToTP.apply(x, group)
        _OPEN_REGION[gid] = (x, 0, y)
        return y
    key = id(group)
    open_region = _OPEN_REGION.get(key)
    if open_region is not None and open_region[0] is x and open_region[1] == x._version:
        return open_region[2]
    y = _CopyToTP.apply(x, group)
    _OPEN_REGION[key] = (x, x._version, y)
    return y


def all_reduce_grad(x: torch.Tensor, group: Any, tp_size: int) -> torch.Tensor:
    """Identity forward; the gradient summed over the tp group (for a replicated tensor of which each
    rank's backward produces only a part of the gradient). Unlike :func:`copy_to_tp`, no region:
    every call is its own collective in backward."""
    if tp_size == 1 or not _tracking(x):
        return x
    return _CopyToTP.apply(x, group)


def close_region(group: Any) -> None:
    """A row-parallel layer (or the LM head) ran: the next column layer starts a new region."""
    if torch.compiler.is_compiling():
        _OPEN_REGION.pop(-1 - traceable.group_id(group), None)
        return
    _OPEN_REGION.pop(id(group), None)


def reduce_from_tp(x: torch.Tensor, group: Any, tp_size: int) -> torch.Tensor:
    if tp_size == 1:
        return x
    close_region(group)
    if not _tracking(x):
        return _all_reduce(x, group)
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: Any, tp_size: int, tp_rank: int) -> torch.Tensor:
    if tp_size == 1:
        return x
    close_region(group)
    if not _tracking(x):
        return _gather_last(x, group, tp_size)
    return _GatherFromTP.apply(x, group, tp_size, tp_rank)
