"""Differentiable collectives for sequence parallelism: the Ulysses all-to-all, and the all-gather / all-reduce
that average a loss over the sequence-parallel group.

Every collective here is one of :mod:`zerospeed.comm.collectives`' (so it is counted, per call, in
:data:`zerospeed.comm.counter.COUNTER` as ``all_to_all`` / ``all_gather`` / ``all_reduce``), wrapped in an
autograd function whose backward is the adjoint collective:

* :func:`seq_all_to_all` splits a tensor along ``scatter_dim`` into ``world`` equal chunks, sends chunk ``j``
  to rank ``j`` and concatenates what it receives along ``gather_dim`` in rank order. Its adjoint is the same
  exchange with the two dimensions swapped (one all-to-all in backward too). (The Ulysses layers use the packed
  form in :mod:`zerospeed.sequence.exchange`: q, k and v in one all-to-all.)
* :func:`all_gather_with_grad` returns every rank's tensor (a list in rank order). Its backward follows
  ``torch.distributed.nn.functional.all_gather``: the gradient of rank ``r``'s slot is *summed over the ranks*
  (each rank back-propagates its own copy of whatever was computed from the list), so when every rank of a
  group computes the same scalar from the list, rank ``r``'s input gets ``world`` times its share. The engine
  averages gradients over the dp x sp group (as DeepSpeed's ZeRO does over its sequence-data-parallel group),
  which divides that factor out again: the result is the single-process gradient.
* :func:`all_reduce_with_grad` sums over the group; backward sums the incoming gradients over the group
  (``torch.distributed.nn.functional.all_reduce``'s rule), so the same ``world`` factor appears and cancels.

Decision: these are the forms zerospeed's SP loss helpers use (:mod:`zerospeed.sequence.loss`); a plain in-place
``dist.all_reduce`` on a loss is invisible to autograd and gives each rank only its own share, ``1/sp`` of what
the engine's averaging expects.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.comm import collectives
from zerospeed.comm.dist import get_rank, get_world_size, is_initialized

__all__ = ["all_gather_with_grad", "all_reduce_with_grad", "seq_all_to_all"]


def _world(group: Any) -> int:
    return get_world_size(group) if is_initialized() else 1


def _exchange(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    world = _world(group)
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    if x.shape[scatter_dim] % world:
        raise ValueError(f"sequence all-to-all: dimension {scatter_dim} of shape {tuple(x.shape)} "
                         f"({x.shape[scatter_dim]}) is not divisible by the group's {world} ranks")
    if world == 1:  # the identity, still counted (the same call pattern at every degree)
        out = torch.empty_like(x)
        collectives.all_to_all_single(out, x.contiguous(), group=group)
        return out
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()  # [world, ...chunk]: row j goes to rank j
    recv = torch.empty_like(send)
    collectives.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)  # rank order along the gathered dimension


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _exchange(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def seq_all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim`` over the group's ranks and gather along ``gather_dim`` (differentiable).

    With ``x`` sequence-sharded (local sequence at ``gather_dim``) and holding every head (at ``scatter_dim``),
    the result holds the whole sequence for ``1/world`` of the heads: rank ``r`` gets head chunk ``r``.
    ``x.shape[scatter_dim]`` must be divisible by the group size (one line naming the shape otherwise).
    """
    return _SeqAllToAll.apply(x, group, scatter_dim, gather_dim)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.meta = group, (x.shape, x.dtype, x.device)
        world = _world(group)
        out = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)  # flat: gloo wants 1-d for scalars
        collectives.all_gather(out, x.reshape(-1).contiguous(), group=group)
        return tuple(out.view(world, *x.shape).unbind(0))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        stacked = torch.stack([g if g is not None else torch.zeros(ctx.meta[0], dtype=ctx.meta[1], device=ctx.meta[2]) for g in grads]).contiguous()
        collectives.all_reduce(stacked, group=ctx.group)
        rank = get_rank(ctx.group) if is_initialized() else 0
        return stacked[rank], None


def all_gather_with_grad(x: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's ``x`` (same shape on every rank), in rank order; differentiable with torch's rule (see above)."""
    return list(_AllGather.apply(x, group))


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        collectives.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out = grad.clone()
        collectives.all_reduce(out, group=ctx.group)
        return out, None


def all_reduce_with_grad(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The group's sum of ``x`` (a new tensor); backward sums the gradients over the group (see above)."""
    return _AllReduce.apply(x, group)
