"""The Ulysses exchanges, packed: q, k and v go to head shards in *one* all-to-all, and back in one.

Two exchanges, each the other's adjoint, over a list of tensors that share a layout (``head_dim``, ``seq_dim``):

* :func:`heads_to_seq` (forward of q/k/v): tensor ``i`` holds ``1/sp`` of the sequence and ``H_i`` heads; rank ``j``
  receives head chunk ``j`` of every rank's sequence shard, so it holds the whole sequence (in rank order) and
  ``h_i = H_i * rep_i / sp`` heads. ``rep_i > 1`` (grouped-query attention with fewer KV heads than ranks) sends KV
  head ``j // rep_i`` to rank ``j``: the same tensors as repeating each head ``rep_i`` times first (DeepSpeed's
  ``repeat_interleave``), without building the repeated copy.
* :func:`seq_to_heads` (forward of the attention output; backward of q/k/v): the reverse; with ``rep_i > 1`` the
  ``rep_i`` received copies of each head are summed (the adjoint of the repetition).

Each call packs its tensors into one ``[sp, sum(h_i), *rest]`` send buffer (one copy), exchanges it with one
:func:`zerospeed.comm.collectives.all_to_all_single` (counted as one ``all_to_all``), and unpacks each tensor into
its layout (one copy). The arithmetic is only moves, except the sum of the ``rep_i`` copies in backward, so the
results equal whole-sequence attention's exactly (the sum: up to its order, a few ulps, as autograd's own
``repeat_interleave`` backward). Layout: any; the sequence dimension's length must be the same on every rank
(the all-to-all exchanges equal chunks).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from zerospeed.comm import collectives
from zerospeed.comm.dist import get_world_size, is_initialized

__all__ = ["heads_to_seq", "seq_to_heads"]


def _world(group: Any) -> int:
    return get_world_size(group) if is_initialized() else 1


def _perm(src: Sequence[str], dst: Sequence[str]) -> list[int]:
    return [list(src).index(label) for label in dst]


def _labels(ndim: int, head_dim: int, seq_dim: int) -> list[str]:
    """Names of a tensor's dimensions: "H" heads, "S" sequence, "d<i>" the others."""
    return ["H" if i == head_dim else "S" if i == seq_dim else f"d{i}" for i in range(ndim)]


def _exchange(send: torch.Tensor, group: Any) -> torch.Tensor:
    recv = torch.empty_like(send)
    collectives.all_to_all_single(recv, send, group=group)
    return recv


def _heads_to_seq(xs: Sequence[torch.Tensor], reps: Sequence[int], head_dim: int, seq_dim: int,
                  group: Any) -> list[torch.Tensor]:
    sp = _world(group)
    labels = _labels(xs[0].dim(), head_dim, seq_dim)
    rest = [label for label in labels if label != "H"]  # the send buffer: [R, H, *rest], rest at the local length
    widths = [x.shape[head_dim] * r // sp for x, r in zip(xs, reps)]
    shape = [sp, sum(widths)] + [xs[0].shape[labels.index(label)] for label in rest]
    if len(xs) == 1 and reps[0] == 1:
        view = xs[0].unflatten(head_dim, (sp, widths[0]))
        view = view.permute(_perm(labels[:head_dim] + ["R", "H"] + labels[head_dim + 1:], ["R", "H"] + rest))
        if view.is_contiguous():  # already in the send order: no copy
            return _unpack_seq(_exchange(view, group), xs, widths, labels, rest, seq_dim, sp)
    send = torch.empty(shape, dtype=xs[0].dtype, device=xs[0].device)
    at = 0
    for x, rep, h in zip(xs, reps, widths):
        dst = send.narrow(1, at, h)
        if rep == 1:  # head chunk j of x goes to rank j
            src = x.unflatten(head_dim, (sp, h))
            src_labels = labels[:head_dim] + ["R", "H"] + labels[head_dim + 1:]
            dst.copy_(src.permute(_perm(src_labels, ["R", "H"] + rest)))
        else:  # one head per rank: rank j gets head j // rep (rep ranks share each head)
            src = x.permute(_perm(labels, ["H"] + rest)).unsqueeze(1).unsqueeze(2)  # [Hkv, 1, 1, *rest]
            dst.unflatten(0, (x.shape[head_dim], rep)).copy_(src)  # [Hkv, rep, 1, *rest]
        at += h
    return _unpack_seq(_exchange(send, group), xs, widths, labels, rest, seq_dim, sp)


def _unpack_seq(recv: torch.Tensor, xs: Sequence[torch.Tensor], widths: Sequence[int], labels: list[str],
                rest: list[str], seq_dim: int, sp: int) -> list[torch.Tensor]:
    """``recv`` ``[R (the sender: its sequence chunk), H, *rest]`` -> each tensor's whole sequence, its layout."""
    head_dim = labels.index("H")
    out, at = [], 0
    recv_labels = ["R", "H"] + rest
    for x, h in zip(xs, widths):
        full = list(x.shape)
        full[head_dim], full[seq_dim] = h, x.shape[seq_dim] * sp
        y = torch.empty(full, dtype=x.dtype, device=x.device)
        y_labels = labels[:seq_dim] + ["R", "S"] + labels[seq_dim + 1:]
        y.unflatten(seq_dim, (sp, x.shape[seq_dim])).copy_(recv.narrow(1, at, h).permute(_perm(recv_labels,
                                                                                                  y_labels)))
        out.append(y)
        at += h
    return out


def _seq_to_heads(ys: Sequence[torch.Tensor], reps: Sequence[int], head_dim: int, seq_dim: int,
                  group: Any) -> list[torch.Tensor]:
    sp = _world(group)
    labels = _labels(ys[0].dim(), head_dim, seq_dim)
    rest = [label for label in labels if label != "H"]
    for y in ys:
        if y.shape[seq_dim] % sp:
            raise ValueError(f"Ulysses exchange: sequence dimension {seq_dim} of shape {tuple(y.shape)} is not "
                             f"divisible by the group's {sp} ranks")
    local = ys[0].shape[seq_dim] // sp
    widths = [y.shape[head_dim] for y in ys]
    shape = [sp, sum(widths)] + [local if label == "S" else ys[0].shape[labels.index(label)] for label in rest]
    src_labels = labels[:seq_dim] + ["R", "S"] + labels[seq_dim + 1:]
    views = [y.unflatten(seq_dim, (sp, local)).permute(_perm(src_labels, ["R", "H"] + rest)) for y in ys]
    if len(views) == 1 and views[0].is_contiguous():
        send = views[0]  # already in the send order (e.g. [batch 1, seq, heads, dim]): no copy
    else:
        send = torch.empty(shape, dtype=ys[0].dtype, device=ys[0].device)
        at = 0
        for view, h in zip(views, widths):  # sequence chunk j goes to rank j
            send.narrow(1, at, h).copy_(view)
            at += h
    recv = _exchange(send, group)  # [R (the sender: its head chunk), H, *rest]
    out, at = [], 0
    for y, rep, h in zip(ys, reps, widths):
        got = recv.narrow(1, at, h)
        at += h
        if rep > 1:  # the rep copies of each KV head, summed: [Hkv, rep, 1, *rest] -> [Hkv, *rest]
            got = got.unflatten(0, (sp // rep, rep)).sum(1).squeeze(1)
            out.append(got.permute(_perm(["H"] + rest, labels)).contiguous())
            continue
        full = list(y.shape)
        full[head_dim], full[seq_dim] = h * sp, local
        x = torch.empty(full, dtype=y.dtype, device=y.device)
        x_labels = labels[:head_dim] + ["R", "H"] + labels[head_dim + 1:]
        x.unflatten(head_dim, (sp, h)).copy_(got.permute(_perm(["R", "H"] + rest, x_labels)))
        out.append(x)
    return out


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: Any, reps: tuple[int, ...], head_dim: int, seq_dim: int,
                *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (reps, head_dim, seq_dim, group)
        return tuple(_heads_to_seq(xs, reps, head_dim, seq_dim, group))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        reps, head_dim, seq_dim, group = ctx.args
        return (None, None, None, None, *_seq_to_heads(grads, reps, head_dim, seq_dim, group))


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: Any, head_dim: int, seq_dim: int, *ys: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (head_dim, seq_dim, group)
        return tuple(_seq_to_heads(ys, (1,) * len(ys), head_dim, seq_dim, group))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        head_dim, seq_dim, group = ctx.args
        return (None, None, None, *_heads_to_seq(grads, (1,) * len(grads), head_dim, seq_dim, group))


def heads_to_seq(xs: Sequence[torch.Tensor], group: Any, head_dim: int, seq_dim: int,
                 reps: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Sequence-sharded tensors with all their heads -> the whole sequence with ``1/sp`` of the (repeated) heads,
    in one all-to-all (differentiable; see the module docstring). ``reps[i]``: how many ranks share each head of
    ``xs[i]`` (1: its heads divide by sp; else ``sp // heads``)."""
    reps = tuple(reps) if reps is not None else (1,) * len(xs)
    ndim = xs[0].dim()
    head_dim, seq_dim = head_dim % ndim, seq_dim % ndim
    sp = _world(group)
    for x, rep in zip(xs, reps):
        if x.dim() != ndim or (x.shape[head_dim] * rep) % sp or (rep > 1 and x.shape[head_dim] * rep != sp):
            raise ValueError(f"Ulysses exchange: a tensor of shape {tuple(x.shape)} (head dimension {head_dim}, "
                             f"repeated {rep}x) cannot be split over {sp} ranks")
    return list(_HeadsToSeq.apply(group, reps, head_dim, seq_dim, *xs))


def seq_to_heads(ys: Sequence[torch.Tensor], group: Any, head_dim: int, seq_dim: int) -> list[torch.Tensor]:
    """The whole sequence with ``1/sp`` of the heads -> this rank's sequence shard with all heads, in one
    all-to-all (differentiable)."""
    ndim = ys[0].dim()
    return list(_SeqToHeads.apply(group, head_dim % ndim, seq_dim % ndim, *ys))
