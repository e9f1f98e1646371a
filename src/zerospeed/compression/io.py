"""Save and load a cleaned (or post-training-quantized) model with safetensors.

The file holds the ``state_dict`` tensors (packed codes, scales, pruned weights) and, in the
safetensors metadata under ``"zerospeed.compression"``, a JSON description of the structure that differs
from a freshly built model: every ``QuantizedLinear`` / ``QuantizedEmbedding`` / ``InputQuantized`` /
Linear / HF Conv1D / Conv2d / BatchNorm2d with its constructor arguments, the length of every
``ModuleList`` / ``Sequential`` (layer reduction), and head-count attributes.  :func:`load_compressed`
takes a model built by the user's usual constructor (random or original weights), rebuilds those modules
with the recorded shapes, and loads the tensors strictly, so a missing or extra tensor is an error.
Tied tensors (one storage, two names) are stored once, as safetensors requires.

Tensor parallelism: a model cleaned under tp is saved per rank (each rank's file holds its shard,
:class:`~.tp.TPCleanedLinear` recorded with its inner layer); it loads into the same model split the
same way (``tp_model_init(model, tp)`` on the same tp group), each rank its own file.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .clean import HEAD_ATTRS, WIDTH_ATTRS, InputQuantized
from .layers import CompressedLayer, kind_of
from .quantized import QuantizedEmbedding, QuantizedLinear
from .tp import TPCleanedLinear, TPShard, is_tp_linear

META_KEY = "zerospeed.compression"


def _describe(module: nn.Module) -> dict[str, Any] | None:
    if isinstance(module, QuantizedLinear):
        return {"type": "QuantizedLinear", "in_features": module.in_features, "out_features": module.out_features,
                "bits": module.bits, "group_size": module.group_size, "symmetric": module.symmetric,
                "bias": module.bias is not None, "act_bits": module.act_bits,
                "act_symmetric": module.act_symmetric, "act_static": module.act_static}
    if isinstance(module, QuantizedEmbedding):
        return {"type": "QuantizedEmbedding", "num_embeddings": module.num_embeddings,
                "embedding_dim": module.embedding_dim, "bits": module.bits, "group_size": module.group_size,
                "symmetric": module.symmetric, "padding_idx": module.padding_idx}
    if isinstance(module, TPCleanedLinear):
        return {"type": "TPCleanedLinear", "bias": None if module.bias is None else list(module.bias.shape),
                "act_bits": module.act_bits, "act_symmetric": module.act_symmetric, "act_static": module.act_static}
    if isinstance(module, InputQuantized):
        return {"type": "InputQuantized", "bits": module.bits, "symmetric": module.symmetric,
                "static": module.static}
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return {"type": "shape", "num_features": module.num_features}
    if isinstance(module, CompressedLayer):
        raise ValueError(f"save_compressed: {module.name} is still a training-time CompressedLayer; call "
                         "redundancy_clean first")
    if kind_of(module) in ("linear", "conv1d", "conv2d", "embedding"):
        return {"type": "shape", "weight": list(module.weight.shape),
                "bias": None if getattr(module, "bias", None) is None else list(module.bias.shape)}
    return None


def describe(model: nn.Module) -> dict[str, Any]:
    modules, lists, attrs = {}, {}, {}
    for name, module in model.named_modules():
        found = _describe(module)
        if found is not None:
            modules[name] = found
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            lists[name] = len(module)
        for attr in HEAD_ATTRS + WIDTH_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                attrs[f"{name}:{attr}"] = value
    return {"modules": modules, "lists": lists, "attrs": attrs}


def save_compressed(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Write ``model``'s tensors and structure to one safetensors file (atomically)."""
    meta = json.dumps(describe(model))
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple[int, int], str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in model.state_dict(keep_vars=False).items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset()) if tensor.numel() else (id(tensor), 0)
        if key in seen and tensor.numel():
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = tensor.detach().contiguous().cpu()
    tmp = f"{os.fspath(path)}.tmp"
    save_file(tensors, tmp, metadata={META_KEY: meta, "zerospeed.aliases": json.dumps(aliases)})
    os.replace(tmp, path)


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, child = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child


def _rebuild(model: nn.Module, name: str, spec: dict[str, Any]) -> None:
    parent, child = _parent(model, name)
    current = getattr(parent, child)
    kind = spec["type"]
    if kind == "TPCleanedLinear":
        _rebuild_tp(parent, child, current, name, spec)
        return
    with torch.device("meta"):  # shapes only: load_state_dict(assign=True) brings the tensors
        _rebuild_on_meta(parent, child, current, kind, spec)


def _rebuild_on_meta(parent: nn.Module, child: str, current: nn.Module, kind: str, spec: dict[str, Any]) -> None:
    if kind == "QuantizedLinear":
        new: nn.Module = QuantizedLinear(spec["in_features"], spec["out_features"], spec["bits"], spec["group_size"],
                                         spec["symmetric"], spec["bias"], spec["act_bits"], spec["act_symmetric"],
                                         spec["act_static"])
    elif kind == "QuantizedEmbedding":
        new = QuantizedEmbedding(spec["num_embeddings"], spec["embedding_dim"], spec["bits"], spec["group_size"],
                                 spec["symmetric"], spec["padding_idx"])
    elif kind == "InputQuantized":
        inner = current.module if isinstance(current, InputQuantized) else current
        new = InputQuantized(inner, spec["bits"], spec["symmetric"], spec["static"])
    else:  # same class, new shapes
        if "num_features" in spec:
            current.num_features = spec["num_features"]
            for attr in ("weight", "bias", "running_mean", "running_var"):
                t = getattr(current, attr, None)
                if t is not None:
                    new_t = torch.empty(spec["num_features"], dtype=t.dtype)
                    setattr(current, attr, nn.Parameter(new_t) if isinstance(t, nn.Parameter) else new_t)
            return
        current.weight = nn.Parameter(torch.empty(spec["weight"], dtype=current.weight.dtype))
        if spec["bias"] is not None:
            current.bias = nn.Parameter(torch.empty(spec["bias"], dtype=current.weight.dtype))
        canon = current.weight.t() if kind_of(current) == "conv1d" else current.weight
        if isinstance(current, nn.Linear):
            current.out_features, current.in_features = canon.shape
        elif isinstance(current, nn.Conv2d):
            current.out_channels, current.in_channels = canon.shape[0], canon.shape[1] * current.groups
        elif kind_of(current) == "conv1d":
            current.nf = canon.shape[0]
        return
    setattr(parent, child, new)


def _rebuild_tp(parent: nn.Module, child: str, current: nn.Module, name: str, spec: dict[str, Any]) -> None:
    """A TPCleanedLinear over the skeleton's tp layer (its group and rank); the inner layer and the
    tensors follow from their own entries."""
    if isinstance(current, TPCleanedLinear):
        shard = current.shard
    elif is_tp_linear(current):
        shard = TPShard.of(current, name)
    else:
        raise ValueError(f"load_compressed: {name} was saved from a tensor-parallel model but is a "
                         f"{type(current).__name__} here; split the model the same way first (tp_model_init)")
    with torch.device("meta"):
        bias = None if spec["bias"] is None else torch.empty(spec["bias"])
        act_range = (torch.empty(()), torch.empty(())) if spec["act_static"] else None
        new = TPCleanedLinear(nn.Linear(1, 1, bias=False), shard, bias, spec["act_bits"], spec["act_symmetric"],
                              act_range)
    setattr(parent, child, new)


def load_compressed(model: nn.Module, path: str | os.PathLike[str]) -> nn.Module:
    """Reshape ``model`` (built by its usual constructor) to the saved structure and load the tensors."""
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if META_KEY not in metadata:
        raise ValueError(f"load_compressed: {path} was not written by zerospeed.compression.save_compressed")
    structure = json.loads(metadata[META_KEY])
    aliases = json.loads(metadata.get("zerospeed.aliases", "{}"))
    for name, length in sorted(structure["lists"].items(), key=lambda kv: kv[0].count(".")):
        holder = model.get_submodule(name) if name else model
        if len(holder) < length:
            raise ValueError(f"load_compressed: {name} has {len(holder)} layers, the file {length}")
        while len(holder) > length:
            del holder[len(holder) - 1]
    for name, spec in sorted(structure["modules"].items(), key=lambda kv: kv[0].count(".")):
        try:
            _rebuild(model, name, spec)
        except AttributeError:
            raise ValueError(f"load_compressed: the model has no module {name!r} (the file was saved from "
                             "another architecture)") from None
    for key, value in structure["attrs"].items():
        name, _, attr = key.partition(":")
        setattr(model.get_submodule(name) if name else model, attr, value)
    tensors = load_file(os.fspath(path))
    for alias, source in aliases.items():
        tensors[alias] = tensors[source]
    # assign: the loaded tensors become the parameters, so a skeleton built on the meta device
    # (``with torch.device("meta"): Model(...)``) loads without ever holding its fp32 weights
    model.load_state_dict(tensors, strict=True, assign=True)
    return model


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's distinct tensors (parameters and buffers), what a checkpoint holds."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in model.state_dict().values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return total
