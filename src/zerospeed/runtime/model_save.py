"""``engine.save_16bit_model``: the consolidated model weights in one file a plain PyTorch / HF user loads.

Decisions:

* The weights are the module's own (compute-dtype: bf16 / fp16 under mixed precision, fp32
  otherwise), consolidated over the data-parallel group; buffers are included, as in
  ``module.state_dict()``. Rank 0 writes; every rank must call (stage 3 gathers).
* At stage 3 the save happens only when ``zero_optimization.stage3_gather_16bit_weights_on_model_save``
  is true; otherwise nothing is written and False is returned (DeepSpeed's contract: gathering the
  whole model is expensive and opt-in), with a warning naming the key.
* ``save_filename`` ending in ``.safetensors`` writes safetensors (tied weights are written under
  each name as separate copies, since safetensors refuses shared storage), anything else ``torch.save``.
* The file is written to a temporary name in ``save_dir`` and renamed, so a failure never leaves a
  half-written file under the requested name.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from zerospeed import comm

logger = logging.getLogger("zerospeed")


def frozen_names(module: torch.nn.Module) -> set[str]:
    return {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def write_state_dict(state_dict: dict[str, torch.Tensor], path: str) -> None:
    """Write ``state_dict`` to ``path`` (safetensors by extension, else torch.save), atomically."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import save_file

            seen: set[int] = set()
            out = {}
            for k, v in state_dict.items():
                v = v.detach().cpu().contiguous()
                ptr = v.untyped_storage().data_ptr()
                if ptr in seen and v.numel():
                    v = v.clone()
                seen.add(v.untyped_storage().data_ptr())
                out[k] = v
            save_file(out, tmp, metadata={"format": "pt"})
        else:
            torch.save({k: v.detach().cpu() for k, v in state_dict.items()}, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_16bit_model(engine: Any, save_dir: str, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    if not isinstance(save_dir, (str, os.PathLike)) or not str(save_dir):
        raise ValueError(f"save_16bit_model: save_dir must be a directory path, got {save_dir!r}")
    if not isinstance(save_filename, str) or not save_filename or os.sep in save_filename:
        raise ValueError(f"save_16bit_model: save_filename must be a file name without '{os.sep}', "
                         f"got {save_filename!r}")
    save_dir = str(save_dir)
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise ValueError(f"save_16bit_model: save_dir {save_dir!r} exists and is not a directory")
    zcfg = engine.config.zero_optimization
    if zcfg.stage == 3 and not zcfg.stage3_gather_16bit_weights_on_model_save:
        if engine.dp_rank == 0:
            logger.warning("zerospeed: save_16bit_model did not save %s: set "
                           "zero_optimization.stage3_gather_16bit_weights_on_model_save to true to gather "
                           "the stage-3 weights on save", os.path.join(save_dir, save_filename))
        return False
    state_dict = engine.consolidated_state_dict()
    error: str | None = None
    if comm.get_rank() == 0:
        try:
            if exclude_frozen_parameters:
                frozen = frozen_names(engine.module)
                state_dict = {k: v for k, v in state_dict.items() if k not in frozen}
            os.makedirs(save_dir, exist_ok=True)
            write_state_dict(state_dict, os.path.join(save_dir, save_filename))
        except Exception as exc:  # every rank must learn of it, not wait in the barrier forever
            error = f"{type(exc).__name__}: {exc}"
    errors = comm.all_gather_object(error) if comm.get_world_size() > 1 else [error]
    failed = next((e for e in errors if e), None)
    if failed:
        raise RuntimeError(f"save_16bit_model: writing {os.path.join(save_dir, save_filename)} failed on rank 0: "
                           f"{failed}")
    return True


__all__ = ["save_16bit_model", "write_state_dict"]
