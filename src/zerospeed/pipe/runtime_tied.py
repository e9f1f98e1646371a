"""Tied weights across pipeline stages: one logical parameter, one copy per owning stage.

``PipelineModule.tied_stages[key]`` lists the (virtual) stages that hold a copy of tied ``key``.
Copies start equal and stay equal because every copy receives the same gradient (the sum of all
copies' gradients) and the same optimizer update. This class owns the three places that needs:

* start-up: the copy of the lowest owning stage is broadcast to the others (each stage may have
  drawn its own initial values when layers are not seeded);
* after the schedule, *before* the data-parallel reduction: the gradients of all copies are summed
  (locally when one rank holds several copies, as with interleaving, then one all-reduce per set
  of owning pipeline ranks over the ranks with the same data-parallel index, all keys of that set
  in one flat message). Summing before the data-parallel reduction is what makes ZeRO-1 correct:
  its reduce-scatter then reduces the already-summed gradient, whichever bucket and shard holds it;
* the gradient norm: the sum of squares over the pipeline must count each tied parameter once, so
  every copy but the lowest owning stage's subtracts its share (:meth:`norm_sq_correction`).

Communication groups come from the mesh (:meth:`zerospeed.comm.Mesh.subgroups`, purpose ``"pipe.tied"``), asked
for in the same order on every rank (creating a group is collective).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from zerospeed import comm

__all__ = ["TiedWeights"]


class TiedWeights:
    """Tied-weight bookkeeping for this rank's chunks (``stage -> PipelineModule``)."""

    def __init__(self, chunks: Mapping[int, nn.Module], tied_stages: Mapping[str, list[int]], *,
                 num_pp: int, num_dp: int, pipe_rank: int, dp_rank: int,
                 global_rank: Callable[[int, int], int], mesh: comm.Mesh | None = None) -> None:
        self.chunks = dict(chunks)
        self.num_pp = num_pp
        self.keys = sorted(tied_stages)
        self.owners = {key: sorted(tied_stages[key]) for key in self.keys}
        self.local_copies: dict[str, list[tuple[int, list[nn.Parameter]]]] = {}
        for key in self.keys:
            copies = [(s, list(self.chunks[s].tied_parameters(key)))
                      for s in self.owners[key] if s in self.chunks]
            if copies:
                self.local_copies[key] = copies
        # one group per set of owning pipeline ranks (and data-parallel index), created everywhere
        rank_sets: dict[tuple[int, ...], list[str]] = {}
        for key in self.keys:
            ranks = tuple(sorted({s % num_pp for s in self.owners[key]}))
            rank_sets.setdefault(ranks, []).append(key)
        self.grad_groups: list[tuple[list[str], dist.ProcessGroup | None]] = []
        self.src_of: dict[str, int] = {}
        mesh = mesh if mesh is not None else comm.current_mesh()
        for ranks, keys in sorted(rank_sets.items()):
            mine: dist.ProcessGroup | None = None
            if len(ranks) > 1:
                lists = [[global_rank(r, d) for r in ranks] for d in range(num_dp)]
                groups = mesh.subgroups("pipe.tied", lists)
                if pipe_rank in ranks:
                    mine = groups[tuple(sorted(lists[dp_rank]))]
            if pipe_rank in ranks:
                self.grad_groups.append((keys, mine))
                for key in keys:
                    self.src_of[key] = global_rank(self.owners[key][0] % num_pp, dp_rank)

    # ------------------------------------------------------------------ start-up
    @torch.no_grad()
    def broadcast_initial(self) -> None:
        """Make every copy equal to the lowest owning stage's."""
        for keys, group in self.grad_groups:
            for key in keys:
                copies = self.local_copies[key]
                first = copies[0][1]
                if group is not None:
                    flat = torch.cat([p.detach().reshape(-1) for p in first])
                    comm.broadcast(flat, src=self.src_of[key], group=group)
                    _unflatten_into(flat, first)
                for _, params in copies[1:]:
                    for dst, src in zip(params, first):
                        dst.copy_(src)

    # ------------------------------------------------------------------ gradients
    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Sum every tied parameter's gradient over all its copies (before data-parallel reduction)."""
        for keys, group in self.grad_groups:
            summed: list[torch.Tensor] = []
            for key in keys:
                copies = self.local_copies[key]
                for i, p in enumerate(copies[0][1]):
                    g = _grad(p)
                    for _, params in copies[1:]:
                        g = g + _grad(params[i])
                    summed.append(g)
            if group is not None and summed:
                flat = torch.cat([g.reshape(-1) for g in summed])
                comm.all_reduce(flat, group=group)
                summed = _split_like(flat, summed)
            it = iter(summed)
            for key in keys:
                copies = self.local_copies[key]
                for i in range(len(copies[0][1])):
                    g = next(it)
                    for _, params in copies:
                        _set_grad(params[i], g)

    def counted_twice(self) -> list[nn.Parameter]:
        """Local copies whose gradient must not count in the global norm (all but the lowest owner's)."""
        out = []
        for key, copies in self.local_copies.items():
            for stage, params in copies:
                if stage != self.owners[key][0]:
                    out.extend(params)
        return out


def _grad(p: nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _set_grad(p: nn.Parameter, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = g.clone()
    elif p.grad is not g:
        p.grad.copy_(g)  # keep the ZeRO strategy's gradient view: copy, do not rebind


def _split_like(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, pos = [], 0
    for t in like:
        out.append(flat[pos:pos + t.numel()].view_as(t))
        pos += t.numel()
    return out


def _unflatten_into(flat: torch.Tensor, params: list[nn.Parameter]) -> None:
    for p, piece in zip(params, _split_like(flat, [p.detach() for p in params])):
        p.copy_(piece)


def reduced_sq_norm(buckets: list, params: list[nn.Parameter]) -> torch.Tensor:
    """Sum of squares of the *reduced* gradient of ``params`` that this rank holds.

    ``buckets`` are the ZeRO strategy's :class:`~zerospeed.zero.flat_bucket.FlatBucket` objects:
    after the data-parallel reduction a bucket's ``reduced_grad()`` is this rank's range
    ``[shard_start, shard_end)`` of it (the whole bucket at stage 0), so each parameter's
    contribution is its slot intersected with that range. Summed over the data-parallel group this
    is the parameter's share of the squared global norm.
    """
    wanted = {id(p) for p in params}
    total = torch.zeros((), dtype=torch.float32)
    for bucket in buckets:
        reduced = None
        for p, slot in zip(bucket.params, bucket.layout.slots):
            if id(p) not in wanted:
                continue
            lo = max(slot.offset, bucket.shard_start)
            hi = min(slot.offset + slot.numel, bucket.shard_end)
            if hi <= lo:
                continue
            if reduced is None:
                reduced = bucket.reduced_grad()
            piece = reduced[lo - bucket.shard_start:hi - bucket.shard_start]
            total = total.to(piece.device) + torch.linalg.vector_norm(piece, dtype=torch.float32).square()
    return total
