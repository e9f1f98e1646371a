"""Checkpoints of either layout written as other formats, one tensor at a time (issue #26).

* :func:`write_state_dict_files`: the consolidated ``state_dict`` as ``pytorch_model.bin`` or
  ``model.safetensors`` (HuggingFace's names, ``*.index.json`` when split by ``max_shard_size``);
  used by ``zerospeed-convert --to hf`` and by :mod:`zerospeed.utils.zero_to_fp32`.
* :func:`write_zerospeed`: a zerospeed checkpoint (``index.json`` + one safetensors file) holding
  the source's weights, fp32 masters, optimizer moments and scalars, scheduler, loss scale and
  counters: ``zerospeed-convert --from deepspeed`` (the engine also loads DeepSpeed folders directly;
  this is for converting once). It loads at any world size and stage like any zerospeed checkpoint.

Each output file is written under a temporary name and renamed (the index last); a zerospeed
checkpoint is published as a directory rename and then ``latest``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import torch

from zerospeed.checkpoint.full_tensors import FullTensors
from zerospeed.checkpoint.index import FORMAT, FORMAT_VERSION, INDEX_FILE, rank_file
from zerospeed.checkpoint.jsonstate import encode
from zerospeed.checkpoint.publish import new_nonce, publish_dir, validate_tag, write_text_atomic
from zerospeed.checkpoint.tensor_io import dtype_name, write_safetensors

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12, "KIB": 2 ** 10,
          "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}
#: DeepSpeed's own entries of its model-states file, left out of the client state a conversion keeps
DEEPSPEED_INTERNAL = ("buffer_names", "param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments",
                      "ds_config", "ds_version", "global_samples", "checkpoint_parallel_dimensions", "lr_scheduler",
                      "optimizer", "sparse_tensor_module_names")


def resolve_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in (torch.float32, torch.float16, torch.bfloat16):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"dtype: {dtype!r} is not one of float32, float16, bfloat16")


def parse_size(size: int | str) -> int:
    if isinstance(size, int) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
    if not match:
        raise ValueError(f"max_shard_size: {size!r} is not a size like 5GB, 500MB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def _replace_file(path: str, write: Any) -> None:
    tmp = os.path.join(os.path.dirname(path), f".tmp-{os.path.basename(path)}-{new_nonce()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_state_dict_files(checkpoint_dir: str, output_dir: str, dtype: Any = torch.float32,
                           max_shard_size: int | str | None = "5GB", safe_serialization: bool = False,
                           tag: str | None = None, exclude_frozen_parameters: bool = False) -> list[str]:
    """Write the consolidated ``state_dict`` into ``output_dir``; return the files written (index last)."""
    out_dtype = resolve_dtype(dtype)
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    os.makedirs(output_dir, exist_ok=True)
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    with FullTensors(checkpoint_dir, tag, exclude_frozen_parameters) as ft:
        def nbytes(key: str) -> int:
            src_dtype = ft.source_dtype(key)
            return ft.numel(key) * (out_dtype.itemsize if src_dtype.is_floating_point else src_dtype.itemsize)

        shards: list[list[str]] = [[]]  # planned from the index's sizes, then built and written one at a time
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
                tensors[key] = ft.tensor(key, out_dtype).contiguous()
            if safe_serialization:
                _replace_file(os.path.join(output_dir, name),
                              lambda p, t=tensors: write_safetensors(p, t, {"format": "pt"}))
            else:
                _replace_file(os.path.join(output_dir, name), lambda p, t=tensors: torch.save(t, p))
            written.append(os.path.join(output_dir, name))
            del tensors
        if total > 1:
            index = {"metadata": {"total_size": sum(nbytes(k) for k in ft.keys)},
                     "weight_map": {k: name for name, keys in zip(names, shards) for k in keys}}
            path = os.path.join(output_dir, weights_name + ".index.json")

            def dump(p: str) -> None:
                with open(p, "w", encoding="utf-8") as f:
                    f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")

            _replace_file(path, dump)
            written.append(path)
        return written


def _client_state(ft: FullTensors, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    if ft.deepspeed is not None:
        client = {k: v for k, v in ft.deepspeed.client_state(True, True, False).items() if k not in DEEPSPEED_INTERNAL}
        return {"json": encode(client, "client_state", tensors, "client."), "file": rank_file(0),
                "keys": sorted(tensors)}
    return ft.index.data.get("client_state") or {}


def write_zerospeed(src: str, dst: str, src_tag: str | None = None, tag: str | None = None) -> str:
    """Write checkpoint ``src`` (DeepSpeed or zerospeed layout) as zerospeed checkpoint ``dst/<tag>``."""
    with FullTensors(src, src_tag) as ft:
        idx = ft.index
        data = idx.data
        state_keys = ft.state_keys()
        tensors: dict[str, torch.Tensor] = {}
        shards, params = [], {}
        for key in ft.keys:
            src_name = idx.canonical(key)
            if src_name != key or src_name in params:
                continue
            info = idx.params[src_name]
            kinds = {"weight": ft.tensor(key, None, kind="weight").reshape(-1)}
            if ft.has(key, "master") and info.get("kind", "param") == "param":
                kinds["master"] = ft.tensor(key, None, kind="master").reshape(-1)
                if kinds["weight"].dtype == torch.float32:
                    kinds["weight"] = kinds.pop("master")  # fp32 training: the weight is the master
            for k in state_keys:
                if ft.has(key, f"optim.{k}"):
                    kinds[f"optim.{k}"] = ft.tensor(key, None, kind=f"optim.{k}").reshape(-1)
            prefix = f"p{len(shards)}"
            for kind, t in kinds.items():
                tensors[f"{prefix}.{kind}"] = t.contiguous()
            params[src_name] = {"shape": [int(d) for d in info["shape"]], "dtype": dtype_name(kinds["weight"].dtype),
                                "kind": info.get("kind", "param"), "group": info.get("group", 0),
                                "master": "master" in kinds, "pieces": [[len(shards), 0, 0, kinds["weight"].numel()]]}
            shards.append({"file": rank_file(0), "prefix": prefix, "kinds": sorted(kinds)})
        client_tensors: dict[str, torch.Tensor] = {}
        client = _client_state(ft, client_tensors) if ft.deepspeed is not None else {}
        if ft.deepspeed is None and (data.get("client_state") or {}).get("keys"):
            cs = data["client_state"]
            client_tensors = {k: ft.source.get(cs["file"], k) for k in cs["keys"]}
            client = dict(cs, file=rank_file(0))
        tensors.update({k: v.contiguous() for k, v in client_tensors.items()})
        engine = dict(data.get("engine") or {})
        if tag is None:
            tag = f"global_step{int(engine.get('global_steps', 0))}"
        tag = validate_tag(tag)
        os.makedirs(dst, exist_ok=True)
        tmp = os.path.join(dst, f".tmp-{tag}-{new_nonce()}")
        os.makedirs(tmp)
        try:
            record = write_safetensors(os.path.join(tmp, rank_file(0)), tensors, {"format": "pt"})
            index = {k: v for k, v in data.items() if k not in ("files", "shards", "params", "rng", "client_state",
                                                                 "source", "world_size", "state_dict_keys")}
            index.update(format=FORMAT, format_version=FORMAT_VERSION, tag=tag, world_size=1, rng=[],
                         files={rank_file(0): record.to_json()}, shards=shards, params=params,
                         aliases=dict(data.get("aliases") or {}), client_state=client, engine=engine,
                         state_dict_keys=list(ft.keys), zero_stage=int(data.get("zero_stage", 0)),
                         converted_from="deepspeed" if ft.deepspeed is not None else "zerospeed")
            with open(os.path.join(tmp, INDEX_FILE), "w", encoding="utf-8") as f:
                json.dump(index, f)
            final = publish_dir(tmp, dst, tag, new_nonce())
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        write_text_atomic(os.path.join(dst, "latest"), tag)
        return final


def write_zerospeed_weights(state_dict: dict[str, torch.Tensor], dst: str, tag: str) -> str:
    """A zerospeed checkpoint holding only module weights (no optimizer state, counters at zero)."""
    tag = validate_tag(tag)
    tensors: dict[str, torch.Tensor] = {}
    shards, params = [], {}
    for key, t in state_dict.items():
        prefix = f"p{len(shards)}"
        tensors[f"{prefix}.weight"] = t.detach().reshape(-1).contiguous()
        params[key] = {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "kind": "param", "group": 0,
                       "master": False, "pieces": [[len(shards), 0, 0, t.numel()]]}
        shards.append({"file": rank_file(0), "prefix": prefix, "kinds": ["weight"]})
    os.makedirs(dst, exist_ok=True)
    tmp = os.path.join(dst, f".tmp-{tag}-{new_nonce()}")
    os.makedirs(tmp)
    try:
        record = write_safetensors(os.path.join(tmp, rank_file(0)), tensors, {"format": "pt"})
        index = {"format": FORMAT, "format_version": FORMAT_VERSION, "tag": tag, "world_size": 1, "rng": [],
                 "files": {rank_file(0): record.to_json()}, "shards": shards, "params": params, "aliases": {},
                 "engine": {"global_steps": 0, "global_samples": 0, "micro_steps": 0, "skipped_steps": 0},
                 "optimizer": None, "lr_scheduler": None, "loss_scaler": None, "client_state": None,
                 "state_dict_keys": list(state_dict), "zero_stage": 0, "converted_from": "dcp"}
        with open(os.path.join(tmp, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump(index, f)
        if os.path.lexists(os.path.join(dst, tag)):
            raise FileExistsError(f"{os.path.join(dst, tag)} exists; choose another --out-tag")
        final = publish_dir(tmp, dst, tag, new_nonce())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_text_atomic(os.path.join(dst, "latest"), tag)
    return final
