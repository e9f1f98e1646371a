"""Map a DeepSpeed file's tensors again without unpickling it again.

The loader copies a DeepSpeed folder one (file, kind) at a time and releases the file after each, so the
pages it touched are given back (the file is memory-mapped: touched pages count in the process's RSS until
the mapping goes). The next kind of the same file used to unpickle it again, and the weights-only unpickler
is the largest CPU cost of a load. :func:`skeleton` keeps, instead of the unpickled object, a copy of its
containers with every tensor replaced by where its bytes lie in the file (the storage's record offset,
dtype, storage offset, size, stride); :func:`rebuild` maps the file again (one ``mmap``) and puts views of
it back. Nothing is unpickled the second time, so nothing from the file runs.

The offsets come from the first load: ``torch.load(mmap=True)`` maps the whole file once and each storage
is a view at its zip record's offset, so ``data_ptr - record offset`` is the same for every storage; that is
checked against the file's records (``torch._C.PyTorchFileReader``), and any file where it does not hold (or
a tensor kept inside an object other than a dict, list or tuple) gets no skeleton: it is simply unpickled
again, as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class _Recipe:
    offset: int  # of the storage's bytes in the file
    nbytes: int
    dtype: torch.dtype
    storage_offset: int  # in elements, as Tensor.storage_offset()
    size: tuple[int, ...]
    stride: tuple[int, ...]
    parameter: bool  # saved as an nn.Parameter
    requires_grad: bool


class _NoSkeleton(Exception):
    pass


def _tensors(obj: Any, out: list[torch.Tensor]) -> None:
    if torch.is_tensor(obj):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out)
    elif hasattr(obj, "__dict__") and any(torch.is_tensor(v) for v in vars(obj).values()):
        raise _NoSkeleton


def skeleton(path: str, obj: Any) -> Any | None:
    """``obj`` (unpickled from ``path`` with ``mmap=True``) with its tensors replaced by recipes; None when the
    offsets cannot be established (the caller then unpickles the file again)."""
    tensors: list[torch.Tensor] = []
    try:
        _tensors(obj, tensors)
    except (_NoSkeleton, RecursionError):
        return None
    if not tensors:
        return obj  # nothing mapped: the object itself is the skeleton
    stored = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
              if t.untyped_storage().nbytes() > 0}
    try:
        reader = torch._C.PyTorchFileReader(path)
        offsets = sorted(reader.get_record_offset(n) for n in reader.get_all_records()
                         if n.startswith("data/") or "/data/" in n)
    except (RuntimeError, OSError):
        return None
    size = os.path.getsize(path)
    base = (min(stored) - offsets[0] if offsets else None) if stored else 0
    known = set(offsets)
    if base is None or any(p - base not in known or p - base + n > size for p, n in stored.items()):
        return None

    def convert(x: Any) -> Any:
        if torch.is_tensor(x):
            st = x.untyped_storage()
            return _Recipe(st.data_ptr() - base if st.nbytes() else -1, st.nbytes(), x.dtype, x.storage_offset(),
                           tuple(x.shape), tuple(x.stride()), isinstance(x, torch.nn.Parameter), x.requires_grad)
        if isinstance(x, dict):
            return type(x)((k, convert(v)) for k, v in x.items())
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            return type(x)(convert(v) for v in x)
        return x

    try:
        return convert(obj)
    except (TypeError, RecursionError):  # a container type that cannot be rebuilt from its items
        return None


def rebuild(path: str, skel: Any) -> Any:
    """The object :func:`skeleton` described, its tensors views of a fresh private mapping of ``path``."""
    # module-level recursion (a nested closure calling itself is a reference cycle: the mapping would stay
    # until the cyclic garbage collector ran, not be unmapped when the loader drops the file)
    return _build(skel, torch.UntypedStorage.from_file(os.fspath(path), False, os.path.getsize(path)))


def _build(x: Any, whole: torch.UntypedStorage) -> Any:
    if isinstance(x, _Recipe):
        if x.nbytes:
            t = torch.empty(0, dtype=x.dtype).set_(whole[x.offset:x.offset + x.nbytes], x.storage_offset, x.size,
                                                   x.stride)
        else:
            t = torch.empty_strided(x.size, x.stride, dtype=x.dtype)
        return torch.nn.Parameter(t, requires_grad=x.requires_grad) if x.parameter else \
            t.requires_grad_(x.requires_grad)
    if isinstance(x, dict):
        return type(x)((k, _build(v, whole)) for k, v in x.items())
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_build(v, whole) for v in x)
    return x
