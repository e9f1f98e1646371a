"""Reading an HF model folder's tensors into our modules.

Files: ``model.safetensors``, or shards listed by ``model.safetensors.index.json`` (any
``*.safetensors`` otherwise); ``pytorch_model.bin`` (and its index) as a fallback, loaded with
``weights_only=True``. Tensors are read lazily, one at a time, and cast to the model's dtype.

Every family's ``load_weights`` declares which HF tensor (with which shape) fills each of our
parameters; :class:`TensorReader` collects every problem before touching the model, so one error
names *all* missing tensors, all shape mismatches and all unexpected tensors, and a model is
either fully loaded or not at all.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable

import torch

from zerospeed.inference.models.spec import ModelLoadError

# Tensors HF checkpoints carry that are not weights (rotary caches, causal-mask buffers).
_IGNORABLE = re.compile(r"(rotary_emb\.inv_freq|\.attn\.bias|\.attn\.masked_bias|attention\.bias|"
                        r"attention\.masked_bias|rotary_emb\.(cos|sin)_cached)$")


def _files(model_dir: str) -> list[str]:
    """The weight files to read (shards of an index, one single file, or every ``*.safetensors``)."""
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = os.path.join(model_dir, index_name)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelLoadError(f"{index}: no 'weight_map' object")
            shards = sorted(set(weight_map.values()))
            missing = [s for s in shards if not os.path.isfile(os.path.join(model_dir, s))]
            if missing:
                raise ModelLoadError(f"{index}: shard file(s) not found: {', '.join(missing)}")
            return [os.path.join(model_dir, s) for s in shards]
        if os.path.isfile(os.path.join(model_dir, single)):
            return [os.path.join(model_dir, single)]
    shards = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if shards:
        return [os.path.join(model_dir, s) for s in shards]
    raise ModelLoadError(f"{model_dir}: no weights found (expected model.safetensors, "
                         "model.safetensors.index.json or pytorch_model.bin)")


class TensorReader:
    def __init__(self, model_dir: str, dtype: torch.dtype, device: torch.device | str = "cpu",
                 state_dict: dict[str, torch.Tensor] | None = None) -> None:
        self.model_dir = model_dir
        self.dtype = dtype
        self.device = torch.device(device)
        self._location: dict[str, str] = {}
        self._loaded: dict[str, dict[str, torch.Tensor]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        if state_dict is not None:  # an in-memory HF model's tensors (init_inference)
            self._loaded["<memory>"] = state_dict
            self._location = {k: "<memory>" for k in state_dict}
            self._shapes = {k: tuple(v.shape) for k, v in state_dict.items()}
        for path in ([] if state_dict is not None else _files(model_dir)):
            for name, shape in self._scan(path).items():
                self._location[name] = path
                self._shapes[name] = shape
        self._used: set[str] = set()
        self._missing: list[str] = []
        self._mismatched: list[str] = []
        self._jobs: list[tuple[torch.nn.Parameter, Callable[[], torch.Tensor]]] = []

    def _scan(self, path: str) -> dict[str, tuple[int, ...]]:
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        state = torch.load(path, map_location="cpu", weights_only=True)
        self._loaded[path] = state
        return {k: tuple(v.shape) for k, v in state.items()}

    def _read(self, name: str) -> torch.Tensor:
        path = self._location[name]
        if path in self._loaded:
            t = self._loaded[path][name].detach()
        else:
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                t = f.get_tensor(name)
        return t.to(device=self.device, dtype=self.dtype)

    def has(self, name: str) -> bool:
        return name in self._location

    def ignore(self, name: str) -> None:
        self._used.add(name)

    def get(self, name: str, shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
        """A thunk reading ``name``; records the problem if it is absent or has another shape."""
        self._used.add(name)
        if name not in self._location:
            self._missing.append(name)
        elif self._shapes[name] != tuple(shape):
            self._mismatched.append(f"{name}: expected shape {tuple(shape)}, found {self._shapes[name]}")
        return lambda: self._read(name)

    def assign(self, param: torch.nn.Parameter, thunk: Callable[[], torch.Tensor]) -> None:
        self._jobs.append((param, thunk))

    def put(self, param: torch.nn.Parameter, name: str, shape: tuple[int, ...]) -> None:
        self.assign(param, self.get(name, shape))

    def finish(self, model: torch.nn.Module) -> None:
        """Raise naming every problem, or copy every tensor into ``model`` (all its parameters)."""
        self.check()
        filled = set()
        for param, thunk in self._jobs:
            t = thunk()
            if tuple(t.shape) != tuple(param.shape):  # only a bug in a family's plan can get here
                raise ModelLoadError(f"internal: tensor of shape {tuple(t.shape)} for parameter {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(t)
            filled.add(id(param))
        unfilled = [n for n, p in model.named_parameters() if id(p) not in filled]
        if unfilled:
            raise ModelLoadError(f"internal: parameters not loaded: {_listing(unfilled)}")
        self._loaded.clear()

    def check(self) -> None:
        """Raise naming every missing, mismatched or unexpected tensor of the plan (nothing copied)."""
        unexpected = sorted(k for k in self._location if k not in self._used and not _IGNORABLE.search(k))
        problems = []
        if self._missing:
            problems.append(f"missing tensors: {_listing(self._missing)}")
        if self._mismatched:
            problems.append(f"mismatched tensors: {_listing(self._mismatched)}")
        if unexpected:
            problems.append(f"unexpected tensors: {_listing(unexpected)}")
        if problems:
            raise ModelLoadError(f"{self.model_dir}: " + "; ".join(problems))


def _listing(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
