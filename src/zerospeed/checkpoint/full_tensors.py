"""Whole tensors of any checkpoint zerospeed reads, one at a time (zero_to_fp32, conversions).

Both layouts: a zerospeed checkpoint (``index.json`` + safetensors shards) and a folder DeepSpeed's
``save_checkpoint`` wrote (read through :mod:`zerospeed.checkpoint.deepspeed`). :class:`FullTensors`
resolves the tag (``latest`` as DeepSpeed does), lists the ``state_dict`` keys, and builds the full
tensor of one key on request from its pieces: the fp32 master where the checkpoint has one, the
module weight otherwise (buffers). A caller that writes each tensor out and drops it holds one output
tensor plus the source files' mapped pages, never the whole model (DeepSpeed's ``zero_to_fp32``
materialises every partition first).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from zerospeed.checkpoint.deepspeed.layout import OPTIMIZER, is_deepspeed_folder, open_folder
from zerospeed.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from zerospeed.checkpoint.index import INDEX_FILE, CheckpointIndex
from zerospeed.checkpoint.loader import resolve
from zerospeed.checkpoint.reader import TensorSource
from zerospeed.checkpoint.shards import copy_pieces, plan_range
from zerospeed.checkpoint.tensor_io import dtype_from_name


def open_checkpoint(directory: str) -> tuple[CheckpointIndex, Any, Any]:
    """``(index, tensor source, DeepSpeedFolder or None)`` of one tag directory of either layout."""
    if not os.path.isfile(os.path.join(directory, INDEX_FILE)) and is_deepspeed_folder(directory):
        return open_folder(directory)
    index = CheckpointIndex.read(directory)
    return index, TensorSource(index), None


class FullTensors:
    """The full tensors of one checkpoint by ``state_dict`` key. Use as a context manager."""

    def __init__(self, checkpoint_dir: str, tag: str | None = None, exclude_frozen: bool = False) -> None:
        checkpoint_dir = os.fspath(checkpoint_dir)
        if tag is None and os.path.isdir(checkpoint_dir) and not os.path.exists(
                os.path.join(checkpoint_dir, "latest")) and (
                os.path.isfile(os.path.join(checkpoint_dir, INDEX_FILE)) or is_deepspeed_folder(checkpoint_dir)):
            directory = checkpoint_dir  # the tag folder itself
        else:
            _, directory = resolve(checkpoint_dir, tag)
            if directory is None:
                raise CheckpointNotFoundError(f"no 'latest' file in {checkpoint_dir}; pass tag= to choose a "
                                              "checkpoint")
        self.directory = directory
        self.index, self.source, self.deepspeed = open_checkpoint(directory)
        idx = self.index
        self.keys = [k for k in idx.state_dict_keys()
                     if not (exclude_frozen and idx.params.get(idx.canonical(k), {}).get("kind") == "frozen")]
        for key in self.keys:
            if idx.canonical(key) not in idx.params:
                raise CheckpointError(f"{idx.path}: state_dict entry {key!r} has no data in the checkpoint")

    def __enter__(self) -> FullTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.source.close()

    def shape(self, key: str) -> list[int]:
        return [int(d) for d in self.index.params[self.index.canonical(key)]["shape"]]

    def numel(self, key: str) -> int:
        return self.index.numel(self.index.canonical(key))

    def source_dtype(self, key: str) -> torch.dtype:
        src = self.index.canonical(key)
        if self.index.has_kind(src, "master"):
            return torch.float32
        return dtype_from_name(self.index.params[src]["dtype"])

    def has(self, key: str, kind: str) -> bool:
        """Whether the checkpoint holds ``kind`` ("weight", "master", "optim.exp_avg", ...) of ``key``."""
        src = self.index.canonical(key)
        return bool(self.index.sources(src)) and self.index.has_kind(src, kind)

    def state_keys(self) -> list[str]:
        """The element-wise optimizer states saved (``exp_avg``, ``exp_avg_sq``...)."""
        return list((self.index.data.get(OPTIMIZER) or {}).get("state_keys") or [])

    def optimizer_scalars(self, key: str) -> dict[str, Any]:
        """The scalar optimizer state of ``key`` (Adam's ``step``), decoded."""
        from zerospeed.checkpoint.jsonstate import decode

        enc = ((self.index.data.get(OPTIMIZER) or {}).get("scalars") or {}).get(self.index.canonical(key)) or {}
        return {k: (v["v"] if "t" in v else decode(v["v"])) for k, v in enc.items()}

    def tensor(self, key: str, dtype: torch.dtype | None = torch.float32, kind: str | None = None) -> torch.Tensor:
        """The full tensor of ``key``; floating-point entries cast to ``dtype`` (None: as stored). ``kind``
        defaults to the fp32 master where there is one, else the weight."""
        idx = self.index
        src = idx.canonical(key)
        if kind is None:
            kind = "master" if idx.has_kind(src, "master") else "weight"
        ops = plan_range(src, idx.sources(src), 0, idx.numel(src), 0)
        first = self.source.shard(ops[0].shard, kind) if ops else None
        flat = torch.empty(idx.numel(src), dtype=first.dtype if first is not None else self.source_dtype(key))
        copy_pieces(ops, lambda s: self.source.shard(s, kind), flat)
        t = flat.view(self.shape(key))
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        return t
