"""Token slots split over the tensor-parallel group around the expert-parallel all-to-all.

Every rank of a tensor-parallel group holds the same tokens (the dense layers are tensor-parallel,
their outputs replicated), so an MoE layer on each of them dispatches the same ``[E, C, M]`` slots.
Sending all of them through the all-to-all on every tp rank would move each slot ``tp`` times.
DeepSpeed's answer, kept here: before the all-to-all each tp rank keeps only its ``1/tp`` of the
capacity slots (:func:`drop_tokens`), and after it the slices are all-gathered over the tp group
again (:func:`gather_tokens`), so the all-to-all carries ``E * C * M / tp`` elements per rank and
direction.

Both are autograd functions, each the other's backward: the gradient of a kept slice is the
all-gather of every tp rank's slice gradient (every rank needs the whole gradient of the replicated
input); the gradient of a gathered tensor (the same on every tp rank, since what follows is
replicated or tp-reduced) is this rank's slice of it. Collectives go through :mod:`zerospeed.comm`.

Decision: the capacity dimension must divide by ``tp``; the MoE layer lays its slots out with the
capacity rounded up to a multiple of ``tp`` (the extra slots stay empty and are never combined),
so the routing, and hence the results, are those of the unrounded capacity.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm

__all__ = ["drop_tokens", "gather_tokens"]


def _slice(x: torch.Tensor, dim: int, tp_size: int, tp_rank: int) -> torch.Tensor:
    if x.shape[dim] % tp_size:
        raise ValueError(f"MoE: {x.shape[dim]} capacity slots do not split over tp={tp_size}")
    n = x.shape[dim] // tp_size
    return x.narrow(dim, tp_rank * n, n).contiguous()


def _gather(x: torch.Tensor, dim: int, group: Any, tp_size: int) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((tp_size, *x.shape))
    comm.all_gather(out, x, group=group)
    return torch.cat(out.unbind(0), dim=dim)


class _Drop(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any, tp_size: int, tp_rank: int  # type: ignore[override]
                ) -> torch.Tensor:
        ctx.args = (dim, group, tp_size)
        return _slice(x, dim, tp_size, tp_rank)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        dim, group, tp_size = ctx.args
        return _gather(grad, dim, group, tp_size), None, None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any, tp_size: int, tp_rank: int  # type: ignore[override]
                ) -> torch.Tensor:
        ctx.args = (dim, tp_size, tp_rank)
        return _gather(x, dim, group, tp_size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        dim, tp_size, tp_rank = ctx.args
        return _slice(grad, dim, tp_size, tp_rank), None, None, None, None


def drop_tokens(x: torch.Tensor, dim: int, group: Any, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This tp rank's ``1/tp`` of ``x`` along ``dim`` (backward: all-gather over the tp group)."""
    if tp_size == 1:
        return x
    return _Drop.apply(x, dim, group, tp_size, tp_rank)


def gather_tokens(x: torch.Tensor, dim: int, group: Any, tp_size: int, tp_rank: int) -> torch.Tensor:
    """Every tp rank's slice of ``x`` concatenated along ``dim`` (backward: this rank's slice)."""
    if tp_size == 1:
        return x
    return _Gather.apply(x, dim, group, tp_size, tp_rank)
