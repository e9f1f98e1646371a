"""PyTorch Distributed Checkpoint (DCP) folders in and out (``zerospeed-convert --to dcp`` / ``--from dcp``).

``--to dcp`` writes the consolidated model ``state_dict`` (fp32 masters where the checkpoint has them)
with ``torch.distributed.checkpoint.save`` in one process (``no_dist``); the keys are the module's
``state_dict`` keys, so ``torch.distributed.checkpoint.load`` reads it into any model of that
architecture, FSDP2's DTensor state dicts included (DCP reshards on load). ``--from dcp`` reads such
a folder (every tensor entry) and writes a zerospeed checkpoint holding the weights only: it loads with
``load_module_only`` semantics (the optimizer starts fresh), at any world size and stage.

Both hold the whole model in memory once (DCP saves and loads a state dict). The output is written
into a temporary directory and renamed.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from zerospeed.checkpoint.errors import CheckpointCorruptError, CheckpointNotFoundError
from zerospeed.checkpoint.export import resolve_dtype, write_zerospeed_weights
from zerospeed.checkpoint.full_tensors import FullTensors
from zerospeed.checkpoint.publish import new_nonce


def write_dcp(src: str, dst: str, src_tag: str | None = None, dtype: str = "fp32") -> str:
    """Write checkpoint ``src`` (either layout) as DCP folder ``dst`` (which must not hold files yet)."""
    out_dtype = resolve_dtype(dtype)
    if os.path.isdir(dst) and os.listdir(dst):
        raise FileExistsError(f"{dst}: the DCP output folder exists and is not empty")
    with FullTensors(src, src_tag) as ft:
        state = {key: ft.tensor(key, out_dtype).contiguous() for key in ft.keys}
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-{os.path.basename(os.path.abspath(dst))}-{new_nonce()}")
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
        if os.path.isdir(dst):
            os.rmdir(dst)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def read_dcp(src: str) -> dict[str, torch.Tensor]:
    """Every tensor entry of DCP folder ``src`` as a full CPU tensor."""
    if not os.path.isdir(src):
        raise CheckpointNotFoundError(f"DCP folder {src} does not exist")
    reader = dcp.FileSystemReader(src)
    try:
        metadata = reader.read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure to read the metadata is a bad folder
        raise CheckpointCorruptError(f"{os.path.join(src, '.metadata')}: not a readable DCP folder "
                                     f"({type(e).__name__}: {e})") from None
    state = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}
    if not state:
        raise CheckpointCorruptError(f"{src}: the DCP folder holds no tensors")
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def dcp_to_zerospeed(src: str, dst: str, tag: str = "global_step0") -> str:
    return write_zerospeed_weights(read_dcp(src), dst, tag)
