"""Values read from DeepSpeed's files in zerospeed's terms: element counts, scalar optimizer state, the loss
scaler, moment keys, a module's flat weights (shared by the layout parsers of :mod:`.layout` and :mod:`.universal`)."""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from zerospeed.checkpoint.deepspeed.errors import DeepSpeedLayoutError
from zerospeed.checkpoint.deepspeed.safe_load import LossScalerState
from zerospeed.checkpoint.jsonstate import encode


def _numel(shape: Iterable[int]) -> int:
    return math.prod(int(d) for d in shape)


def _step_scalar(state: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0:
            continue
        v = value.item() if torch.is_tensor(value) else value
        if key == "step":  # torch and zerospeed keep Adam's step as a float32 tensor; DeepSpeed's fused Adam an int
            out[key] = {"v": float(v), "t": "float32"}
        else:
            out[key] = {"v": encode(v, f"optimizer state {key!r}", None)}
    return out


def _moment_keys(state: dict[str, Any]) -> list[str]:
    return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0)


def _flat_module(module: dict[str, Any], names: list[str], where: str) -> torch.Tensor:
    parts = []
    for n in names:
        t = module.get(n)
        if not torch.is_tensor(t):
            raise DeepSpeedLayoutError(f"{where}: 'module' has no tensor {n!r} although 'param_shapes' lists it")
        parts.append(t.reshape(-1))
    return torch.cat(parts) if parts else torch.empty(0)


def _loss_scaler(obj: Any) -> dict[str, Any] | None:
    """DeepSpeed's scaler state -> zerospeed's ``{"scale", "hysteresis_left", "clean_steps"}``."""
    d = obj.as_dict() if isinstance(obj, LossScalerState) else obj if isinstance(obj, dict) else None
    if d is None or "cur_scale" not in d:
        return None
    out: dict[str, Any] = {"scale": float(d["cur_scale"])}
    if d.get("dynamic", d.get("dynamic_loss_scale", "cur_iter" in d)) and "cur_iter" in d:
        # DeepSpeed grows the scale when (cur_iter - last_overflow_iter) % window == 0 after counting the step;
        # zerospeed when clean_steps % window == 0 after counting it: the same count since the last overflow.
        out["clean_steps"] = int(d["cur_iter"]) - int(d.get("last_overflow_iter", -1)) - 1
        out["hysteresis_left"] = int(d.get("cur_hysteresis", d.get("delayed_shift", 1)))
    else:
        out.update(clean_steps=0, hysteresis_left=1)
    return out
