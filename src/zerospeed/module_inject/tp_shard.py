"""Arithmetic of one tensor-parallel split: which piece of a full tensor a tp rank holds.

A :class:`TPSplit` describes how a full parameter (as stored on the module: ``[out, in]`` for
``nn.Linear``, ``[in, out]`` for HF ``Conv1D``) is cut over ``tp_size`` ranks:

* the tensor is viewed as ``view_shape`` (the storage shape unless a layer spec gave ``shape``),
* along view dimension ``dim`` it consists of sub-projections of sizes ``sub_sizes`` (one entry for a
  plain layer; three for GPT-2's fused ``c_attn``, ``(q, k, v)`` sizes for a GQA ``qkv_proj``),
* each sub-projection is cut into ``tp_size`` equal contiguous pieces; rank r holds piece r of every
  sub-projection, concatenated in sub-projection order,
* ``padded_size`` (vocabulary splits only) pads the single sub-projection with zeros up to a
  multiple of ``tp_size``, so every rank holds the same number of rows.

Decisions: sizes that do not divide are an error at planning time (``check``), never a silent
uneven split, except the vocabulary, which is padded (the padding rows are zeros, never looked up,
and their logits are cut off). The functions here are pure (no process group), so checkpoints and
consolidation reuse them to merge or re-cut shards at another tp degree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["TPSplit", "assemble", "local_piece", "plain_split"]


@dataclass(frozen=True)
class TPSplit:
    """How one full tensor is cut over the tensor-parallel ranks (see the module docstring)."""

    full_shape: tuple[int, ...]
    dim: int
    sub_sizes: tuple[int, ...]
    tp_size: int
    view_shape: tuple[int, ...] | None = None
    padded_size: int | None = None

    @property
    def view(self) -> tuple[int, ...]:
        return self.view_shape if self.view_shape is not None else self.full_shape

    @property
    def total(self) -> int:
        """Size along ``dim`` after padding."""
        return self.padded_size if self.padded_size is not None else sum(self.sub_sizes)

    def local_view(self) -> tuple[int, ...]:
        shape = list(self.view)
        shape[self.dim] = self.total // self.tp_size
        return tuple(shape)

    def local_shape(self) -> tuple[int, ...]:
        """Storage shape of one rank's piece."""
        return _storage_shape(self.full_shape, self.view, self.local_view(), self.dim)

    def problem(self) -> str | None:
        """Why this split cannot be exact (None when it can)."""
        if sum(self.sub_sizes) != self.view[self.dim]:
            return f"sub-projection sizes {list(self.sub_sizes)} do not add up to {self.view[self.dim]}"
        if self.padded_size is None:
            bad = [s for s in self.sub_sizes if s % self.tp_size]
            if bad:
                return f"size {bad[0]} is not divisible by tp={self.tp_size}"
        elif self.padded_size % self.tp_size or len(self.sub_sizes) != 1:
            return f"padded size {self.padded_size} is not a multiple of tp={self.tp_size}"
        return None


def plain_split(full_shape: tuple[int, ...], dim: int, tp_size: int, pad: bool = False) -> TPSplit:
    """One sub-projection along storage dimension ``dim`` (padded to a multiple of tp when ``pad``)."""
    size = full_shape[dim]
    padded = math.ceil(size / tp_size) * tp_size if pad else None
    return TPSplit(tuple(full_shape), dim, (size,), tp_size, padded_size=padded if padded != size else None)


def _storage_shape(full: tuple[int, ...], view: tuple[int, ...], local_view: tuple[int, ...], dim: int) -> tuple[int, ...]:
    """Storage shape of a piece whose view is ``local_view``: the storage dim holding view ``dim`` shrinks."""
    if view == full:
        return tuple(local_view)
    # walk storage dims, consuming the view dims whose product makes each one (row-major)
    out, v = [], 0
    for size in full:
        prod, local_prod = 1, 1
        while prod < size and v < len(view):
            prod, local_prod, v = prod * view[v], local_prod * local_view[v], v + 1
        if prod != size:
            raise ValueError(f"view {list(view)} does not factor the shape {list(full)}")
        out.append(local_prod)
    return tuple(out)


def _padded_view(full: torch.Tensor, split: TPSplit) -> torch.Tensor:
    view = full.reshape(split.view)
    if split.padded_size is not None and split.padded_size > view.shape[split.dim]:
        pad_shape = list(view.shape)
        pad_shape[split.dim] = split.padded_size - view.shape[split.dim]
        view = torch.cat([view, view.new_zeros(pad_shape)], dim=split.dim)
    return view


def local_piece(full: torch.Tensor, split: TPSplit, rank: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full`` (a new contiguous tensor of ``split.local_shape()``)."""
    if tuple(full.shape) != split.full_shape:
        raise ValueError(f"tensor of shape {list(full.shape)} does not match the split's {list(split.full_shape)}")
    view = _padded_view(full, split)
    subs = (split.total,) if split.padded_size is not None else split.sub_sizes
    pieces = [sub.chunk(split.tp_size, dim=split.dim)[rank] for sub in view.split(list(subs), dim=split.dim)]
    return torch.cat(pieces, dim=split.dim).reshape(split.local_shape()).contiguous()


def assemble(pieces: list[torch.Tensor], split: TPSplit) -> torch.Tensor:
    """The full tensor from every rank's piece (rank order); inverse of :func:`local_piece`."""
    if len(pieces) != split.tp_size:
        raise ValueError(f"{len(pieces)} pieces for a split over tp={split.tp_size}")
    subs = (split.total,) if split.padded_size is not None else split.sub_sizes
    local_subs = [s // split.tp_size for s in subs]
    per_rank = [p.reshape(split.local_view()).split(local_subs, dim=split.dim) for p in pieces]
    full = torch.cat([torch.cat([per_rank[r][i] for r in range(split.tp_size)], dim=split.dim)
                      for i in range(len(subs))], dim=split.dim)
    if split.padded_size is not None:
        full = full.narrow(split.dim, 0, split.sub_sizes[0])
    return full.reshape(split.full_shape).contiguous()
