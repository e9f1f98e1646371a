"""Small Python state as JSON plus tensors: client_state, optimizer hyperparameters, RNG states.

Nothing is pickled. :func:`encode` turns a value built from JSON types, tuples, tensors and numpy
arrays into JSON; tensors go into a ``tensors`` dict (saved in a safetensors file) and are referred
to by key, or, with ``tensors=None``, are written inline as lists (fine for a scalar lr). Tuples
and tensors are tagged so :func:`decode` gives back the same types. Anything else is refused at save
time with the path of the offending value, so a checkpoint never holds something that cannot be
loaded back without executing code.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from zerospeed.checkpoint.tensor_io import dtype_from_name, dtype_name

TENSOR = "__zs_tensor__"
ARRAY = "__zs_ndarray__"
TUPLE = "__zs_tuple__"
_MARKERS = (TENSOR, ARRAY, TUPLE)


def _refuse(path: str, value: Any) -> TypeError:
    return TypeError(f"{path} is a {type(value).__module__}.{type(value).__qualname__}, which a zerospeed checkpoint "
                     "cannot store without pickle; use JSON types (dict with str keys, list, tuple, str, int, float, "
                     "bool, None), torch tensors or numpy arrays")


def encode(value: Any, path: str, tensors: dict[str, torch.Tensor] | None, key_prefix: str = "") -> Any:
    """JSON-able form of ``value``; tensors are moved into ``tensors`` (or inlined when it is None)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (torch.Tensor, np.ndarray)):
        is_array = isinstance(value, np.ndarray)
        if is_array and value.dtype == object:
            raise _refuse(path, value)
        t = torch.from_numpy(np.ascontiguousarray(value)) if is_array else value.detach()
        marker = ARRAY if is_array else TENSOR
        if tensors is None:
            return {marker: t.cpu().tolist(), "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
        key = f"{key_prefix}{len(tensors)}"
        tensors[key] = t.to("cpu", copy=True).contiguous()
        return {marker: key}
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{path} has key {k!r} of type {type(k).__name__}; a zerospeed checkpoint stores "
                                "dicts with str keys only")
            if k in _MARKERS:
                raise TypeError(f"{path} uses the reserved key {k!r}")
            out[k] = encode(v, f"{path}[{k!r}]", tensors, key_prefix)
        return out
    if isinstance(value, list):
        return [encode(v, f"{path}[{i}]", tensors, key_prefix) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {TUPLE: [encode(v, f"{path}[{i}]", tensors, key_prefix) for i, v in enumerate(value)]}
    raise _refuse(path, value)


def decode(value: Any, tensors: dict[str, torch.Tensor] | None = None) -> Any:
    """Inverse of :func:`encode`; ``tensors`` maps the keys written at save time to loaded tensors."""
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if TUPLE in value:
        return tuple(decode(v, tensors) for v in value[TUPLE])
    for marker in (TENSOR, ARRAY):
        if marker in value:
            ref = value[marker]
            if "dtype" in value:  # inline
                t = torch.tensor(ref, dtype=dtype_from_name(value["dtype"])).reshape(value["shape"])
            else:
                if tensors is None or ref not in tensors:
                    raise KeyError(f"tensor {ref!r} referred to by the checkpoint's JSON is missing")
                t = tensors[ref]
            return t.numpy() if marker == ARRAY else t
    return {k: decode(v, tensors) for k, v in value.items()}


# -- RNG states -------------------------------------------------------------------------------------


def capture_rng(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """This process's python / numpy / torch CPU / CUDA RNG states: JSON scalars + tensors."""
    version, internal, gauss_next = random.getstate()
    tensors["rng.python"] = torch.tensor(internal, dtype=torch.int64)
    name, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["rng.numpy"] = torch.from_numpy(np.asarray(keys, dtype=np.int64).copy())
    tensors["rng.torch_cpu"] = torch.get_rng_state().clone()
    meta: dict[str, Any] = {"python": {"version": version, "gauss_next": gauss_next},
                            "numpy": {"name": name, "pos": int(pos), "has_gauss": int(has_gauss),
                                      "cached_gaussian": float(cached)},
                            "num_cuda": 0}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states = torch.cuda.get_rng_state_all()
        for i, s in enumerate(states):
            tensors[f"rng.cuda.{i}"] = s.cpu().clone()
        meta["num_cuda"] = len(states)
    return meta


def restore_rng(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    py = meta["python"]
    random.setstate((py["version"], tuple(int(x) for x in tensors["rng.python"].tolist()), py["gauss_next"]))
    npm = meta["numpy"]
    np.random.set_state((npm["name"], tensors["rng.numpy"].numpy().astype(np.uint32), npm["pos"], npm["has_gauss"],
                         npm["cached_gaussian"]))
    torch.set_rng_state(tensors["rng.torch_cpu"].to(torch.uint8))
    num_cuda = int(meta.get("num_cuda", 0))
    if num_cuda and torch.cuda.is_available():
        states = [tensors[f"rng.cuda.{i}"].to(torch.uint8) for i in range(num_cuda)]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
        else:
            torch.cuda.set_rng_state(states[min(torch.cuda.current_device(), len(states) - 1)])
