"""DeepSpeed folders of pipeline-parallel and tensor-parallel (AutoTP) runs, seen by parameter name and offset.

zerospeed's loader addresses every piece by (parameter name, offset in the *full* parameter), so a folder
whose model is split over model-parallel ranks maps onto any zerospeed mesh once its pieces are named that
way. :func:`parse_model_parallel` does it for the two layouts DeepSpeed 0.19.8 writes:

* **Pipeline** (``PipelineEngine.save_checkpoint``): layer files ``layer_XX-model_states.pt`` (with a
  tensor-parallel ``model`` axis ``layer_XX-model_0T-model_states.pt``) plus each model-parallel rank's
  model and optimizer files, read by :mod:`zerospeed.checkpoint.deepspeed.pipeline` (ZeRO 0 and 1, bf16,
  tied layers, pipeline x tensor parallel).
* **Tensor parallel** (AutoTP training, ``tensor_parallel.autotp_size``): per tensor-parallel rank T,
  ``mp_rank_0T_model_states.pt`` holds that rank's slices and ``..._mp_rank_0T_optim_states.pt`` a ZeRO
  optimizer over them; :mod:`zerospeed.checkpoint.deepspeed.tp_maps` turns each rank's slice into runs of
  full-tensor offsets, so the folder loads at any tensor-parallel degree, data-parallel size and stage.
"""

from __future__ import annotations

from typing import Any

from zerospeed.checkpoint.deepspeed.errors import DeepSpeedFileMissingError, DeepSpeedLayoutError
from zerospeed.checkpoint.deepspeed.names import _LAYER_FILE_RE, MODEL_FILE, ZERO3_MODEL_FILE, _need
from zerospeed.checkpoint.deepspeed.pipeline import parse_pipeline
from zerospeed.checkpoint.deepspeed.tp_maps import runs_of_rank


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
    layers: dict[int, dict[int, str]] = {}  # layer index -> tensor-parallel rank -> file
    for n in sorted(names):
        match = _LAYER_FILE_RE.match(n)
        if match is not None:
            layers.setdefault(int(match.group(1)), {})[int(match.group(2) or 0)] = n
    if layers:
        tp_size = _tp_size(folder, first, layers, mp_world)
        parse_pipeline(folder, names, [_model_file(names, m) for m in range(mp_world)], layers, tp_size)
    else:
        _tensor_parallel(folder, names, mp_world)
    # counters, scheduler, client state and the index's file are model-parallel rank 0's (DeepSpeed's too)
    folder.model_file = _model_file(names, 0)
    folder.meta = first
    folder.mp = 0


def _tp_size(folder: Any, first: dict[str, Any], layers: dict[int, dict[int, str]], mp_world: int) -> int:
    """The tensor-parallel size of a pipeline folder: its layer files' ``model_0T`` ranks (DeepSpeed's
    ``checkpoint_parallel_dimensions`` must agree where it was saved); model-parallel rank = stage * tp + T."""
    ranks = {t for per in layers.values() for t in per}
    tp_size = max(ranks) + 1
    for idx, per in sorted(layers.items()):
        if sorted(per) != list(range(tp_size)):
            missing = [t for t in range(tp_size) if t not in per]
            path = folder.files.path(f"layer_{idx:02d}-model_{missing[0]:02d}-model_states.pt")
            raise DeepSpeedFileMissingError(f"{path} is missing: the folder's layer files are split over {tp_size} "
                                            "tensor-parallel ranks")
    dims = first.get("checkpoint_parallel_dimensions")
    if isinstance(dims, dict) and int(dims.get("tp_degree", tp_size)) != tp_size:
        raise DeepSpeedLayoutError(f"{folder.directory}: layer files of {tp_size} tensor-parallel ranks, but "
                                   f"checkpoint_parallel_dimensions records tp_degree {dims['tp_degree']}")
    if mp_world % tp_size:
        raise DeepSpeedLayoutError(f"{folder.directory}: mp_world_size {mp_world} is not a multiple of the "
                                   f"{tp_size} tensor-parallel ranks of its layer files")
    return tp_size


def _model_file(names: set[str], m: int) -> str:
    zero3 = ZERO3_MODEL_FILE.format(rank=0, mp=m)
    return zero3 if zero3 in names and MODEL_FILE.format(mp=m) not in names else MODEL_FILE.format(mp=m)


def _tensor_parallel(folder: Any, names: set[str], tp_size: int) -> None:
    buffers: dict[str, Any] = {}
    for t in range(tp_size):
        fname = _model_file(names, t)
        meta = folder.files.get(fname)
        folder._b.to_full = runs_of_rank(folder.files.path(fname), meta, t)
        try:
            module = folder._parse_rank(names, t)
        finally:
            folder._b.to_full = None
        if t == 0:
            buffers = {n: module[n] for n in folder.buffer_names if n in module}
    folder._extras(buffers)  # buffers are whole on every rank; rank 0's
