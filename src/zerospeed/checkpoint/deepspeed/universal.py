"""Reading ``ds_to_universal`` output (DeepSpeed's universal checkpoint) into a :class:`~.layout.DeepSpeedFolder`:
one full fp32 tensor per parameter and state under ``zero/<name>/``, described as single-piece shards of zerospeed's
index, so the loader restores it at any world size and stage."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from zerospeed.checkpoint.deepspeed.errors import DeepSpeedLayoutError, DeepSpeedUnsupportedError
from zerospeed.checkpoint.deepspeed.names import _need
from zerospeed.checkpoint.deepspeed.values import _loss_scaler, _numel, _step_scalar

#: the folder of a universal checkpoint (ds_to_universal) holding zero/<parameter>/<state>.pt
UNIVERSAL_DIR = "zero"


def parse_universal(folder: Any) -> None:
    """``ds_to_universal`` output: every parameter's full fp32 value and optimizer states in its own files
    (``zero/<name>/fp32.pt``, ``exp_avg.pt``, ...; a tensor, or a dict with it under ``param``), the
    shared optimizer state in ``zero/optimizer_state.pt``."""
    folder.zero_optimizer = True
    where_model = folder.files.path(folder.model_file)
    shapes = _need(folder.meta, "param_shapes", where_model, list)
    common_name = os.path.join(UNIVERSAL_DIR, "optimizer_state.pt")
    common = folder.files.get(common_name) if folder.files.exists(common_name) else {}
    folder.loss_scaler = _loss_scaler(common.get("loss_scaler"))
    groups = common.get("param_groups") or (common.get("optimizer_state_dict") or {}).get("param_groups") or []
    folder._set_groups(list(groups)[:len(shapes)], folder.files.path(common_name))
    inner_state = (common.get("optimizer_state_dict") or {}).get("state") or {}
    shared_step = next((_step_scalar({"step": st["step"]}) for st in inner_state.values()
                        if isinstance(st, dict) and "step" in st), None)

    def tensor_of(rel: str, shape: list[int]) -> torch.Tensor:
        obj = folder.files.get(rel, None)
        t = obj.get("param") if isinstance(obj, dict) else obj
        if not torch.is_tensor(t):
            raise DeepSpeedLayoutError(f"{folder.files.path(rel)}: holds a {type(t).__name__}, not a tensor")
        if t.numel() != _numel(shape):
            raise DeepSpeedUnsupportedError(f"{folder.files.path(rel)}: {t.numel()} elements for a parameter of "
                                            f"shape {tuple(shape)} (a tensor-parallel slice?): not read yet")
        return t.detach().reshape(-1)

    for g, group in enumerate(shapes):
        for name, shape in group.items():
            name, shape = str(name), [int(d) for d in shape]
            pdir = os.path.join(UNIVERSAL_DIR, name)
            folder.files.require(os.path.join(pdir, "fp32.pt"), f"a universal checkpoint holds every parameter's "
                               f"fp32 value ({name!r} is in param_shapes of {folder.model_file})")
            keys = sorted(f[:-3] for f in os.listdir(folder.files.path(pdir))
                          if f.endswith(".pt") and f not in ("fp32.pt", "step.pt"))
            folder.state_keys.update(keys)
            fp32 = os.path.join(pdir, "fp32.pt")
            kinds: dict[str, Callable[[], torch.Tensor]] = {
                "master": lambda fp32=fp32, shape=shape: tensor_of(fp32, shape),
                "weight": lambda fp32=fp32, shape=shape: tensor_of(fp32, shape).to(folder.weight_dtype)}
            for k in keys:
                kinds[f"optim.{k}"] = lambda rel=os.path.join(pdir, f"{k}.pt"), shape=shape: tensor_of(rel, shape)
            folder._b.add_param(name, shape, torch.float32, "param", g)
            shard = folder._b.add_shard(folder.model_file, f"u.{name}", kinds)
            folder._b.add_piece(name, shard, 0, 0, _numel(shape))
            step_file = os.path.join(pdir, "step.pt")
            if folder.files.exists(step_file):
                value = folder.files.get(step_file, None)
                folder.scalars[("u", name)] = _step_scalar({"step": value})
            elif shared_step is not None:
                folder.scalars[("u", name)] = shared_step
            folder.scalar_group[name] = ("u", name)
