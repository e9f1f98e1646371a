"""How a tensor-parallel DeepSpeed folder spreads each parameter over its ranks, as runs of full-tensor offsets.

zerospeed's loader records every piece in the *full* parameter's coordinates, so a tensor-parallel rank's
slice becomes ``(local_start, full_start, numel)`` runs (the ``to_full`` maps of
:class:`~zerospeed.checkpoint.deepspeed.layout._Builder`). DeepSpeed records the split two ways:

* AutoTP training (0.19): ``universal_checkpoint_info.affine_map``: per rank, blocks given as
  ``torch.as_strided`` arguments in the full tensor (source) and in the rank's slice (dest), with the ranks
  holding each block (:func:`runs_of_rank`);
* Megatron-style layers (a pipeline with a ``model`` axis): the client saves ``universal_checkpoint_info``
  with name patterns, as Megatron-DeepSpeed does and DeepSpeed's ``ds_to_universal`` reads them
  (:func:`pattern_maps`): ``tp_replicated_parameter_patterns`` (every rank holds the whole tensor),
  ``parameter_with_row_parallelism_patterns`` (slices joined on dim 1), anything else joined on dim 0.
  Vocabulary padding, averaged parameters and sub-parameter layouts are refused by name.

A block several ranks hold (a replicated bias or norm) is taken from the lowest of them. Scaled blocks
(DeepSpeed's affine ``scale``) are refused: Adam's moments would need rescaling with its hyperparameters.
Memory: one int64 index of the largest parameter while a map is built.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from zerospeed.checkpoint.deepspeed.errors import DeepSpeedLayoutError, DeepSpeedUnsupportedError

#: where DeepSpeed's model file keeps the affine maps of an AutoTP run (its UNIVERSAL_CHECKPOINT_INFO / AFFINE_MAP)
UC_INFO, AFFINE_MAP, AFFINE_PARAMS = "universal_checkpoint_info", "affine_map", "params"
#: DeepSpeed's universal_checkpoint_info pattern lists (deepspeed/checkpoint/constants.py)
REPLICATED, ROW = "tp_replicated_parameter_patterns", "parameter_with_row_parallelism_patterns"
NOT_READ = ("vocabulary_parameter_patterns", "parameter_to_average_patterns", "parameter_with_2_sub_params_cat_dim_0",
            "parameter_with_sub_params")
Runs = list[tuple[int, int, int]]


def pattern_maps(where: str, meta: dict[str, Any], shapes: dict[str, Any], rank: int,
                 tp_size: int) -> dict[str, tuple[list[int], Runs]]:
    """``to_full`` of tensor-parallel rank ``rank`` from the name patterns of ``universal_checkpoint_info``
    (``shapes``: the rank's parameter names -> slice shapes)."""
    info = meta.get(UC_INFO)
    if not isinstance(info, dict) or not (info.get(REPLICATED) or info.get(ROW)) and not info.get(AFFINE_MAP):
        raise DeepSpeedUnsupportedError(f"{where}: a pipeline x tensor-parallel DeepSpeed folder without "
                                        f"{UC_INFO} ({REPLICATED}, {ROW}: the patterns Megatron-DeepSpeed saves and "
                                        "ds_to_universal needs): how each parameter is split is not recorded")
    if info.get(AFFINE_MAP):
        return runs_of_rank(where, meta, rank)
    out: dict[str, tuple[list[int], Runs]] = {}
    for name, shape in shapes.items():
        for key in NOT_READ:
            if any(re.match(p, name) for p in info.get(key) or []):
                raise DeepSpeedUnsupportedError(f"{where}: {name!r} matches {UC_INFO}.{key}; such parameters are "
                                                "not read")
        local = [int(d) for d in shape]
        dim = None if any(re.match(p, name) for p in info.get(REPLICATED) or []) else \
            1 if any(re.match(p, name) for p in info.get(ROW) or []) else 0
        if dim is not None and dim >= len(local):
            raise DeepSpeedLayoutError(f"{where}: {name!r} of shape {local} cannot be split on dim {dim}")
        full = list(local)
        if dim is not None:
            full[dim] *= tp_size
        strides = _strides(full)
        block = {"shape": local, "dest": (0, _strides(local)), "scale": 1.0,
                 "source": (0 if dim is None else rank * local[dim] * strides[dim], strides),
                 "locations": list(range(tp_size)) if dim is None else [rank]}
        entry = {"logical_shape": full, "ranks": {rank: {"shard_shape": local, "pieces": [block]}}}
        out[name] = (full, _runs(where, name, entry, rank))
    return out


def _strides(shape: list[int]) -> list[int]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return out[::-1]


def _unescape(pattern: str) -> str | None:
    """The parameter name of DeepSpeed's ``^re.escape(name)$`` pattern (None for any other regex)."""
    if not (pattern.startswith("^") and pattern.endswith("$")):
        return None
    name = re.sub(r"\\(.)", r"\1", pattern[1:-1])
    return name if re.escape(name) == pattern[1:-1] else None


Runs = list[tuple[int, int, int]]


def runs_of_rank(where: str, meta: dict[str, Any], rank: int) -> dict[str, tuple[list[int], Runs]]:
    info = meta.get(UC_INFO)
    maps = ((info or {}).get(AFFINE_MAP) or {}).get(AFFINE_PARAMS) if isinstance(info, dict) else None
    if not isinstance(maps, dict) or not maps:
        raise DeepSpeedUnsupportedError(f"{where}: a tensor-parallel DeepSpeed folder without "
                                        f"{UC_INFO}.{AFFINE_MAP} (written by DeepSpeed's AutoTP training from 0.19): "
                                        "how each parameter is split is not recorded")
    out: dict[str, tuple[list[int], Runs]] = {}
    for pattern, entry in maps.items():
        name = _unescape(str(pattern))
        if name is None:
            raise DeepSpeedUnsupportedError(f"{where}: affine map for {pattern!r}, a pattern rather than one "
                                            "parameter's name; not read")
        out[name] = (list(entry["logical_shape"]), _runs(where, name, entry, rank))
    return out


def _runs(where: str, name: str, entry: dict[str, Any], rank: int) -> list[tuple[int, int, int]]:
    """``(local_start, full_start, numel)`` runs of the elements rank ``rank`` is the first holder of."""
    ranks = {int(r): v for r, v in entry["ranks"].items()}
    if rank not in ranks:
        raise DeepSpeedLayoutError(f"{where}: the affine map of {name!r} has no entry for tensor-parallel rank {rank}")
    full_numel = _prod(entry["logical_shape"])
    local = torch.full((_prod(ranks[rank]["shard_shape"]),), -1, dtype=torch.int64)
    full = torch.arange(full_numel, dtype=torch.int64)
    for piece in ranks[rank]["pieces"]:
        if float(piece.get("scale", 1.0)) != 1.0:
            raise DeepSpeedUnsupportedError(f"{where}: {name!r} is held scaled by {piece['scale']} on rank {rank} "
                                            "(DeepSpeed's affine scale); Adam's moments and hyperparameters would "
                                            "need rescaling: not read")
        if min(int(r) for r in piece["locations"]) != rank:
            continue  # a replicated block: read from its lowest holder
        shape = [int(d) for d in piece["shape"]]
        (src_off, src_strides), (dst_off, dst_strides) = piece["source"], piece["dest"]
        try:
            torch.as_strided(local, shape, dst_strides, dst_off).copy_(
                torch.as_strided(full, shape, src_strides, src_off))
        except RuntimeError as e:
            raise DeepSpeedLayoutError(f"{where}: a block of {name!r} on rank {rank} lies outside the tensor "
                                       f"({e})") from None
    runs: list[tuple[int, int, int]] = []
    valid = local >= 0
    if not bool(valid.any()):
        return runs
    breaks = torch.ones_like(valid)
    breaks[1:] = (local[1:] != local[:-1] + 1) | (valid[1:] != valid[:-1])
    starts = torch.nonzero(breaks).reshape(-1).tolist() + [local.numel()]
    for a, b in zip(starts[:-1], starts[1:]):
        if int(local[a]) >= 0:
            runs.append((a, int(local[a]), b - a))
    return runs


def _prod(shape: Any) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out
