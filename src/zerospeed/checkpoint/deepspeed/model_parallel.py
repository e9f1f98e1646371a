"""DeepSpeed folders of pipeline-parallel and tensor-parallel (AutoTP) runs, seen by parameter name and offset.

zerospeed's loader addresses every piece by (parameter name, offset in the *full* parameter), so a folder
whose model is split over model-parallel ranks maps onto any zerospeed mesh once its pieces are named that
way. :func:`parse_model_parallel` does it for the two layouts DeepSpeed 0.19.8 writes:

* **Pipeline** (``PipelineEngine.save_checkpoint``): layer files ``layer_XX-model_states.pt`` plus each
  stage's model and optimizer files, read by :mod:`zerospeed.checkpoint.deepspeed.pipeline` (ZeRO 0 and 1,
  bf16, tied layers). Not read yet (refused by name): pipeline x tensor parallel.
* **Tensor parallel** (AutoTP training, ``tensor_parallel.autotp_size``): per tensor-parallel rank T,
  ``mp_rank_0T_model_states.pt`` holds that rank's slices and ``..._mp_rank_0T_optim_states.pt`` a ZeRO
  optimizer over them. DeepSpeed records how every parameter is spread in the model file's
  ``universal_checkpoint_info.affine_map``: per rank, blocks given as ``torch.as_strided`` arguments in
  the full tensor (source) and in the rank's slice (dest), with the ranks holding each block. Each
  rank's slice is turned into runs of full-tensor offsets; a block several ranks hold (a replicated
  bias or norm) is taken from the lowest of them. The folder then loads at any tensor-parallel degree,
  data-parallel size and stage. Scaled blocks (DeepSpeed's affine ``scale``) are refused: Adam's moments
  would need rescaling with its hyperparameters.

Memory: the run maps take one int64 index of the largest parameter while they are built; no tensor data is
read here (the files stay memory-mapped and are read when the loader asks).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from zerospeed.checkpoint.deepspeed.errors import (DeepSpeedFileMissingError, DeepSpeedLayoutError,
                                                   DeepSpeedUnsupportedError)
from zerospeed.checkpoint.deepspeed.names import _LAYER_FILE_RE, MODEL_FILE, ZERO3_MODEL_FILE, _need
from zerospeed.checkpoint.deepspeed.pipeline import parse_pipeline

#: where DeepSpeed's model file keeps the affine maps of an AutoTP run (its UNIVERSAL_CHECKPOINT_INFO / AFFINE_MAP)
UC_INFO, AFFINE_MAP, AFFINE_PARAMS = "universal_checkpoint_info", "affine_map", "params"


def parse_model_parallel(folder: Any, names: set[str], mp_ranks: list[int]) -> None:
    """Fill ``folder`` (a :class:`~zerospeed.checkpoint.deepspeed.layout.DeepSpeedFolder`) from a folder
    with several model-parallel ranks or pipeline layer files."""
    if not mp_ranks or mp_ranks[0] != 0:
        raise DeepSpeedFileMissingError(f"{folder.files.path(MODEL_FILE.format(mp=0))} is missing: a DeepSpeed "
                                        "folder holds model-parallel rank 0's model states")
    first = folder.files.get(_model_file(names, 0))
    mp_world = int(_need(first, "mp_world_size", folder.files.path(_model_file(names, 0)), int))
    for m in range(mp_world):
        if m not in mp_ranks:
            raise DeepSpeedFileMissingError(f"{folder.files.path(MODEL_FILE.format(mp=m))} is missing: the folder was "
                                            f"saved at model-parallel size {mp_world} and rank {m}'s model states are "
                                            "not there")
    if mp_ranks[-1] >= mp_world:
        raise DeepSpeedLayoutError(f"{folder.files.path(_model_file(names, mp_ranks[-1]))}: a model-parallel rank "
                                   f"beyond mp_world_size {mp_world}: files of two saves mixed")
    layers: dict[int, str] = {}
    for n in sorted(names):
        match = _LAYER_FILE_RE.match(n)
        if match is None:
            continue
        if match.group(2) not in (None, "00"):
            raise DeepSpeedUnsupportedError(f"{folder.files.path(n)}: a pipeline x tensor-parallel DeepSpeed folder "
                                            "(layer files per model rank); zerospeed reads pipeline folders and "
                                            "tensor-parallel folders, not both at once yet")
        layers[int(match.group(1))] = n
    if layers:
        parse_pipeline(folder, names, [_model_file(names, s) for s in range(mp_world)], layers)
    else:
        _tensor_parallel(folder, names, mp_world)
    # counters, scheduler, client state and the index's file are model-parallel rank 0's (DeepSpeed's too)
    folder.model_file = _model_file(names, 0)
    folder.meta = first
    folder.mp = 0


def _model_file(names: set[str], m: int) -> str:
    zero3 = ZERO3_MODEL_FILE.format(rank=0, mp=m)
    return zero3 if zero3 in names and MODEL_FILE.format(mp=m) not in names else MODEL_FILE.format(mp=m)


def _tensor_parallel(folder: Any, names: set[str], tp_size: int) -> None:
    buffers: dict[str, Any] = {}
    for t in range(tp_size):
        fname = _model_file(names, t)
        meta = folder.files.get(fname)
        folder._b.to_full = _runs_of_rank(folder.files.path(fname), meta, t)
        try:
            module = folder._parse_rank(names, t)
        finally:
            folder._b.to_full = None
        if t == 0:
            buffers = {n: module[n] for n in folder.buffer_names if n in module}
    folder._extras(buffers)  # buffers are whole on every rank; rank 0's


def _unescape(pattern: str) -> str | None:
    """The parameter name of DeepSpeed's ``^re.escape(name)$`` pattern (None for any other regex)."""
    if not (pattern.startswith("^") and pattern.endswith("$")):
        return None
    name = re.sub(r"\\(.)", r"\1", pattern[1:-1])
    return name if re.escape(name) == pattern[1:-1] else None


Runs = list[tuple[int, int, int]]


def _runs_of_rank(where: str, meta: dict[str, Any], rank: int) -> dict[str, tuple[list[int], Runs]]:
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
