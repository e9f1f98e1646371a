"""Full (unsharded) tensors from tensor-parallel pieces: state dicts for saving, tests and HF export.

:func:`gather_tp_state_dict` takes each tp rank's *local* state dict (for instance the engine's
``consolidated_state_dict()``, which is complete on data-parallel rank 0 and empty elsewhere),
gathers the pieces over the tp group and reassembles every split tensor with its
:class:`~zerospeed.module_inject.tp_shard.TPSplit`; replicated tensors are taken from tp rank 0.
Keys stay the original model's, Conv1D weights keep their ``[in, out]`` layout, padded vocabulary
rows are dropped, so the result loads into the unsplit model (HF ``from_pretrained`` included).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerospeed import comm
from zerospeed.module_inject.auto_tp import tp_param_splits
from zerospeed.module_inject.tp_shard import assemble

__all__ = ["gather_tp_state_dict", "merge_tp_pieces"]


def merge_tp_pieces(pieces: list[dict[str, torch.Tensor]], splits: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One full state dict from every tp rank's local one (rank order); pure, no communication."""
    out: dict[str, torch.Tensor] = {}
    for key, value in pieces[0].items():
        split = splits.get(key)
        if split is None:
            out[key] = value
            continue
        missing = [r for r, p in enumerate(pieces) if key not in p]
        if missing:
            raise KeyError(f"tensor-parallel piece of {key!r} is missing on tp rank {missing[0]}")
        out[key] = assemble([p[key] for p in pieces], split)
    return out


def gather_tp_state_dict(local: dict[str, torch.Tensor], model: nn.Module, mesh: Any = None) -> dict[str, torch.Tensor]:
    """The full state dict on every rank whose ``local`` is non-empty; ``{}`` elsewhere.

    Collective over the tp group (every rank must call it). ``mesh`` defaults to the current one;
    without a mesh, or at tp 1, ``local`` is returned unchanged.
    """
    mesh = mesh if mesh is not None else comm.get_mesh()
    if mesh is None or mesh.tp_size == 1:
        return local
    cpu = {k: v.detach().cpu() for k, v in local.items()}
    pieces = comm.all_gather_object(cpu, group=mesh.tp_group)
    if not local:
        return {}
    if any(not p for p in pieces):
        raise RuntimeError("gather_tp_state_dict: some tp ranks gave an empty state dict while others did not "
                           "(call it with the same data-parallel rank's state on every tp rank)")
    return merge_tp_pieces(pieces, tp_param_splits(model))
