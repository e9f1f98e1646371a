"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` helpers, on DeepSpeed folders and zerospeed checkpoints.

The names and arguments are DeepSpeed's, so a script that imports them from here works unchanged:

* :func:`get_fp32_state_dict_from_zero_checkpoint` -> a ``state_dict`` of full fp32 CPU tensors;
* :func:`convert_zero_checkpoint_to_fp32_state_dict` (and :func:`convert_zero_checkpoint_to_state_dict`
  with ``dtype``) -> ``pytorch_model.bin`` / ``model.safetensors`` in ``output_dir``, split into
  ``max_shard_size`` shards with HuggingFace's ``*.index.json`` when larger;
* :func:`load_state_dict_from_zero_checkpoint` -> the fp32 weights loaded into ``model`` (moved to CPU).

``checkpoint_dir`` is the folder holding ``latest`` (the tag is read from it unless ``tag`` is given),
or a tag folder itself. Both layouts are read by :class:`zerospeed.checkpoint.full_tensors.FullTensors`;
DeepSpeed's pickles only through its allowlisted ``weights_only`` loader.

Memory: the conversion writes each output shard as soon as its tensors are built and drops it, so it
holds one output shard (at most ``max_shard_size``, or one tensor when a tensor is larger) plus the
memory-mapped source pages it is copying; DeepSpeed's script first merges every rank's partitions. Each
output file is written to a temporary name and renamed; the index file is renamed last.
``lazy_mode`` is accepted for compatibility: the tensors returned are ordinary tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.checkpoint.export import write_state_dict_files
from zerospeed.checkpoint.full_tensors import FullTensors

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "convert_zero_checkpoint_to_state_dict",
           "get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint"]

def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """Every ``state_dict`` entry of the checkpoint as a full fp32 CPU tensor (integer buffers as saved)."""
    with FullTensors(checkpoint_dir, tag, exclude_frozen_parameters) as ft:
        built: dict[str, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        for key in ft.keys:
            src = ft.index.canonical(key)
            if src not in built:
                built[src] = ft.tensor(key, torch.float32)
            out[key] = built[src]  # tied names share the tensor, as in DeepSpeed's output
        return out


def convert_zero_checkpoint_to_state_dict(checkpoint_dir: str, output_dir: str, dtype: Any = torch.float32,
                                          max_shard_size: int | str | None = "5GB", safe_serialization: bool = False,
                                          tag: str | None = None, exclude_frozen_parameters: bool = False) -> list[str]:
    """Write the checkpoint's consolidated ``state_dict`` into ``output_dir``; return the files written."""
    return write_state_dict_files(checkpoint_dir, output_dir, dtype, max_shard_size, safe_serialization, tag,
                                  exclude_frozen_parameters)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str,
                                               max_shard_size: int | str | None = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> list[str]:
    """:func:`convert_zero_checkpoint_to_state_dict` in fp32 (DeepSpeed's name and arguments)."""
    return write_state_dict_files(checkpoint_dir, output_dir, torch.float32, max_shard_size, safe_serialization, tag,
                                  exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str,
                                         tag: str | None = None) -> torch.nn.Module:
    """Load the checkpoint's fp32 weights into ``model`` on CPU (non-strict, as DeepSpeed); return it."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model
