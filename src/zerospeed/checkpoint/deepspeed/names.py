"""The names of the files ``DeepSpeedEngine.save_checkpoint`` writes (DeepSpeed 0.19.8), and a checked lookup
of the entries in them; shared by the reader (layout.py, model_parallel.py) and the writers."""

from __future__ import annotations

import re
from typing import Any

from zerospeed.checkpoint.deepspeed.errors import DeepSpeedLayoutError

MODEL_FILE = "mp_rank_{mp:02d}_model_states.pt"
ZERO3_MODEL_FILE = "zero_pp_rank_{rank}_mp_rank_{mp:02d}_model_states.pt"
OPTIM_FILE = "{prefix}zero_pp_rank_{rank}_mp_rank_{mp:02d}_optim_states.pt"
_DS_FILE = re.compile(r"^(bf16_)?(zero_pp_rank_\d+_)?mp_rank_\d\d_(model|optim)_states\.pt$|^layer_\d+-"
                      r"(model_\d\d-)?model_states\.pt$")
#: a model-parallel rank's model file (group 1: the rank)
_MODEL_FILE_RE = re.compile(r"^(?:zero_pp_rank_0_)?mp_rank_(\d\d)_model_states\.pt$")
#: a pipeline layer's file (group 1: the layer index, group 2: the tensor-parallel rank when there is one)
_LAYER_FILE_RE = re.compile(r"^layer_(\d+)-(?:model_(\d\d)-)?model_states\.pt$")


def _need(d: Any, key: str, where: str, kind: type | tuple[type, ...] = object) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise DeepSpeedLayoutError(f"{where}: has no {key!r} entry: not a DeepSpeed checkpoint file, or one of a "
                                   "version zerospeed does not read")
    value = d[key]
    if not isinstance(value, kind):
        raise DeepSpeedLayoutError(f"{where}: {key!r} is a {type(value).__name__}, not what DeepSpeed writes")
    return value
