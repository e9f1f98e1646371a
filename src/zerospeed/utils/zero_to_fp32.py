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

import json
import os
import re
from typing import Any

import torch

from zerospeed.checkpoint.full_tensors import FullTensors
from zerospeed.checkpoint.publish import new_nonce
from zerospeed.checkpoint.tensor_io import write_safetensors

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "convert_zero_checkpoint_to_state_dict",
           "get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12, "KIB": 2 ** 10,
          "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


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


def _resolve_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in (torch.float32, torch.float16, torch.bfloat16):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"dtype: {dtype!r} is not one of float32, float16, bfloat16")


def _parse_size(size: int | str) -> int:
    if isinstance(size, int) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
    if not match:
        raise ValueError(f"max_shard_size: {size!r} is not a size like 5GB, 500MB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def _write(path: str, tensors: dict[str, torch.Tensor], safe: bool) -> None:
    tmp = os.path.join(os.path.dirname(path), f".tmp-{os.path.basename(path)}-{new_nonce()}")
    try:
        if safe:
            write_safetensors(tmp, {k: v.contiguous() for k, v in tensors.items()}, {"format": "pt"})
        else:
            torch.save(tensors, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def convert_zero_checkpoint_to_state_dict(checkpoint_dir: str, output_dir: str, dtype: Any = torch.float32,
                                          max_shard_size: int | str | None = "5GB", safe_serialization: bool = False,
                                          tag: str | None = None, exclude_frozen_parameters: bool = False) -> list[str]:
    """Write the checkpoint's consolidated ``state_dict`` into ``output_dir``; return the files written."""
    out_dtype = _resolve_dtype(dtype)
    limit = None if max_shard_size is None else _parse_size(max_shard_size)
    os.makedirs(output_dir, exist_ok=True)
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    with FullTensors(checkpoint_dir, tag, exclude_frozen_parameters) as ft:
        def nbytes(key: str) -> int:
            item = out_dtype.itemsize if ft.source_dtype(key).is_floating_point else ft.source_dtype(key).itemsize
            return ft.numel(key) * item

        # plan the shards first (sizes are known from the index), then build and write one shard at a time
        shards: list[list[str]] = [[]]
        size = 0
        for key in ft.keys:
            n = nbytes(key)
            if limit is not None and shards[-1] and size + n > limit:
                shards.append([])
                size = 0
            shards[-1].append(key)
            size += n
        total = len(shards)
        names = [weights_name] if total == 1 else [
            weights_name.replace(".bin", f"-{i + 1:05d}-of-{total:05d}.bin").replace(
                ".safetensors", f"-{i + 1:05d}-of-{total:05d}.safetensors") for i in range(total)]
        written = []
        for name, keys in zip(names, shards):
            tensors: dict[str, torch.Tensor] = {}
            for key in keys:
                t = ft.tensor(key, out_dtype)
                tensors[key] = t.clone() if any(t is v for v in tensors.values()) else t
            _write(os.path.join(output_dir, name), tensors, safe_serialization)
            written.append(os.path.join(output_dir, name))
            del tensors
        if total > 1:
            index = {"metadata": {"total_size": sum(nbytes(k) for k in ft.keys)},
                     "weight_map": {k: name for name, keys in zip(names, shards) for k in keys}}
            index_name = weights_name + ".index.json"
            path = os.path.join(output_dir, index_name)
            tmp = os.path.join(output_dir, f".tmp-{index_name}-{new_nonce()}")
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, path)
            written.append(path)
        return written


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str,
                                               max_shard_size: int | str | None = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> list[str]:
    """:func:`convert_zero_checkpoint_to_state_dict` in fp32 (DeepSpeed's name and arguments)."""
    return convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32, max_shard_size,
                                                 safe_serialization, tag, exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str,
                                         tag: str | None = None) -> torch.nn.Module:
    """Load the checkpoint's fp32 weights into ``model`` on CPU (non-strict, as DeepSpeed); return it."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model
