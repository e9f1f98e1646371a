"""Checkpoints of a tensor-parallel model in the ordinary name-and-offset format.

A checkpoint addresses every piece by (parameter name, offset in the *full* flattened parameter)
(:mod:`zerospeed.checkpoint.index`). A tp rank holds a piece of each split parameter that is, in
the full tensor's flat order, a few contiguous runs (one for a column split of ``[out, in]``, one
per row for a row split, one per sub-projection for fused layers). :class:`TPCheckpointLayout`
translates between the two, so:

* saving: each rank's pieces are rewritten from local to full coordinates (one piece per run) and
  the index records full shapes; replicated parameters are recorded by tp rank 0 only. Every
  rank of the world writes its own file; the agreement and the index span the whole world.
* loading: each local range asks the checkpoint for the full-coordinate runs it covers, so a
  checkpoint saved at any tp degree (or without tp) loads at any other, ZeRO stage and dp degree
  included, and ``zerospeed-consolidate`` needs no tp knowledge at all: the index is already in
  full coordinates (Conv1D weights in their ``[in, out]`` storage, vocabulary padding dropped).

The engine holds one as ``engine.checkpoint_layout`` (None without tp); the checkpoint code calls
it duck-typed and never learns how a layer is split.

Cost: the run map of a parameter is computed once with an index tensor of the full parameter's
size (8 bytes per element, transient) and kept as a list of runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerospeed import comm
from zerospeed.module_inject.auto_tp import tp_param_splits
from zerospeed.module_inject.tp_shard import TPSplit, local_piece

__all__ = ["TPCheckpointLayout"]


def _runs(split: TPSplit, rank: int) -> list[tuple[int, int, int]]:
    """``(local_offset, full_offset, numel)`` runs of rank ``rank``'s piece, in local order."""
    full_numel = 1
    for d in split.full_shape:
        full_numel *= d
    index = torch.arange(1, full_numel + 1, dtype=torch.int64).reshape(split.full_shape)
    local = local_piece(index, split, rank).reshape(-1) - 1  # padding rows become -1
    runs: list[tuple[int, int, int]] = []
    if local.numel() == 0:
        return runs
    valid = local >= 0
    breaks = torch.ones_like(local, dtype=torch.bool)
    breaks[1:] = (local[1:] != local[:-1] + 1) | (valid[1:] != valid[:-1])
    starts = torch.nonzero(breaks).reshape(-1).tolist() + [local.numel()]
    for a, b in zip(starts[:-1], starts[1:]):
        if int(local[a]) >= 0:
            runs.append((a, int(local[a]), b - a))
    return runs


class TPCheckpointLayout:
    """Local <-> full coordinates of this rank's tensor-parallel parameters (see the module docstring)."""

    def __init__(self, model: nn.Module, mesh: Any) -> None:
        self.splits: dict[str, TPSplit] = tp_param_splits(model)
        self.model, self.mesh = model, mesh
        self.tp_rank = mesh.tp_rank
        self.rank = comm.get_rank()
        self.world_size = comm.get_world_size()
        self.group = None  # the world
        self._runs: dict[str, list[tuple[int, int, int]]] = {}

    def is_split(self, name: str) -> bool:
        return name in self.splits

    def full_shape(self, name: str, local_shape: list[int]) -> list[int]:
        split = self.splits.get(name)
        return list(split.full_shape) if split is not None else list(local_shape)

    def runs(self, name: str, local_start: int, numel: int) -> list[tuple[int, int, int]]:
        """``(full_start, offset from local_start, numel)`` runs covering local elements ``[local_start, +numel)``."""
        split = self.splits.get(name)
        if split is None:
            return [(local_start, 0, numel)]
        if name not in self._runs:
            self._runs[name] = _runs(split, self.tp_rank)
        out, end = [], local_start + numel
        for lo, full, n in self._runs[name]:
            a, b = max(lo, local_start), min(lo + n, end)
            if a < b:
                out.append((full + a - lo, a - local_start, b - a))
        return out

    def gather_full(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors from every tp rank's local state dict (collective over the tp group)."""
        from zerospeed.module_inject.gather import gather_tp_state_dict

        return gather_tp_state_dict(local, self.model, self.mesh)

    def to_full(self, pieces: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        """Saved piece records ``[shard, key_offset, param_start, numel]`` in full coordinates.

        Replicated parameters are kept on tp rank 0 only (every tp rank holds the same values).
        """
        out: dict[str, list[list[int]]] = {}
        for name, records in pieces.items():
            if name not in self.splits:
                if self.tp_rank == 0:
                    out[name] = records
                continue
            for shard, key_offset, start, numel in records:
                for full, off, n in self.runs(name, start, numel):
                    out.setdefault(name, []).append([shard, key_offset + off, full, n])
        return out
