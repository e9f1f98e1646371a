"""Offline consolidation: a sharded checkpoint -> one safetensors state dict, without processes.

``consolidate(checkpoint_dir, output, tag=None, dtype="fp32")`` reassembles every entry of the
module's ``state_dict`` from the pieces recorded in the index, whatever world size and stage
wrote them, and writes a safetensors file that plain PyTorch loads::

    model.load_state_dict(safetensors.torch.load_file(output))

Weights come from the fp32 masters when the checkpoint has them (mixed-precision training), else
from the module weights; floating-point entries are cast to ``dtype`` ("fp32", "bf16", "fp16", or
None to keep each entry's training dtype), integer buffers are kept as they are. Tied weights
appear under each of their names (as in ``state_dict()``). The output is written to a temporary
file and renamed, so an interrupted run never leaves a partial output.

Console command: ``zerospeed-consolidate CHECKPOINT_DIR OUTPUT [--tag T] [--dtype fp32|bf16|fp16]``
(also ``python -m zerospeed.checkpoint``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

import torch

from zerospeed.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from zerospeed.checkpoint.index import CheckpointIndex
from zerospeed.checkpoint.loader import resolve
from zerospeed.checkpoint.publish import new_nonce
from zerospeed.checkpoint.reader import TensorSource
from zerospeed.checkpoint.shards import copy_pieces, plan_range
from zerospeed.checkpoint.tensor_io import dtype_from_name, write_safetensors

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def consolidated_state_dict(checkpoint_dir: str, tag: str | None = None,
                            dtype: str | None = "fp32") -> tuple[str, dict[str, torch.Tensor]]:
    """``(checkpoint path, state_dict)`` with full CPU tensors, in ``state_dict()`` key order."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or None, got {dtype!r}")
    _, directory = resolve(checkpoint_dir, tag)
    if directory is None:
        raise CheckpointNotFoundError(f"no 'latest' file in {checkpoint_dir}; pass a tag (--tag) to choose a "
                                      "checkpoint")
    index = CheckpointIndex.read(directory)
    source = TensorSource(index)
    try:
        entries = []
        for key in index.state_dict_keys():
            src = index.canonical(key)
            if src not in index.params:
                raise CheckpointError(f"{index.path}: state_dict entry {key!r} has no data in the checkpoint")
            kind = "master" if index.has_kind(src, "master") else "weight"
            ops = plan_range(src, index.sources(src), 0, index.numel(src), 0)
            entries.append((key, src, kind, ops))
        source.prefetch(index.key(op.shard, kind) for _, _, kind, ops in entries for op in ops)
        out: dict[str, torch.Tensor] = {}
        built: dict[str, torch.Tensor] = {}
        for key, src, kind, ops in entries:
            if src not in built:
                info = index.params[src]
                first = source.shard(ops[0].shard, kind) if ops else None
                src_dtype = first.dtype if first is not None else dtype_from_name(info["dtype"])
                flat = torch.empty(index.numel(src), dtype=src_dtype)
                copy_pieces(ops, lambda s, k=kind: source.shard(s, k), flat)
                t = flat.view([int(d) for d in info["shape"]])
                if dtype is not None and t.is_floating_point():
                    t = t.to(DTYPES[dtype])
                elif dtype is None and t.is_floating_point():
                    t = t.to(dtype_from_name(info["dtype"]))
                built[src] = t
                out[key] = t
            else:
                out[key] = built[src].clone()  # tied weights: one tensor per name, as safetensors requires
        return directory, out
    finally:
        source.close()


def consolidate(checkpoint_dir: str, output: str, tag: str | None = None, dtype: str | None = "fp32") -> str:
    """Write the consolidated state dict of a checkpoint to ``output`` (safetensors); return its path."""
    directory, state = consolidated_state_dict(checkpoint_dir, tag, dtype)
    output = os.fspath(output)
    if os.path.isdir(output) or output.endswith(os.sep):
        output = os.path.join(output, "model.safetensors")
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-{os.path.basename(output)}-{new_nonce()}")
    try:
        write_safetensors(tmp, {k: v.contiguous() for k, v in state.items()},
                          {"format": "pt", "zerospeed_checkpoint": directory})
        os.replace(tmp, output)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return output


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="zerospeed-consolidate",
        description="Merge a sharded zerospeed checkpoint into one safetensors state dict "
                    "(model.load_state_dict(safetensors.torch.load_file(OUTPUT))).")
    parser.add_argument("checkpoint_dir", help="the directory given to engine.save_checkpoint (holds 'latest')")
    parser.add_argument("output", help="output .safetensors file (or a directory: OUTPUT/model.safetensors)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one named by 'latest')")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="dtype of floating-point tensors")
    args = parser.parse_args(argv)
    try:
        path = consolidate(args.checkpoint_dir, args.output, tag=args.tag, dtype=args.dtype)
    except (CheckpointError, OSError, ValueError) as e:
        print(f"zerospeed-consolidate: error: {e}", file=sys.stderr)
        return 1
    size = os.path.getsize(path)
    print(f"zerospeed-consolidate: wrote {path} ({size / 1e6:.1f} MB, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
