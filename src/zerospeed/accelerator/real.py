"""Choosing the accelerator once per process (``DS_ACCELERATOR`` first, then detection)."""

from __future__ import annotations

import os

import torch

from zerospeed.accelerator.abstract import Accelerator

#: names DeepSpeed accepts in DS_ACCELERATOR; zerospeed builds for the first two.
BUILT = ("cuda", "cpu")
DEEPSPEED_NAMES = ("cuda", "cpu", "xpu", "npu", "mps", "hpu", "mlu", "sdaa", "supa", "klxpu")

_current: Accelerator | None = None


def _from_name(name: str) -> Accelerator:
    from zerospeed.accelerator.cpu import CPUAccelerator
    from zerospeed.accelerator.cuda import CUDAAccelerator

    if name == "cpu":
        return CPUAccelerator()
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("DS_ACCELERATOR=cuda, but torch.cuda.is_available() is False on this machine")
        return CUDAAccelerator()
    if name in DEEPSPEED_NAMES:
        raise ValueError(f"DS_ACCELERATOR={name}: zerospeed runs on {' and '.join(BUILT)} only")
    raise ValueError(f"DS_ACCELERATOR={name!r} is not one of {', '.join(DEEPSPEED_NAMES)}")


def get_accelerator() -> Accelerator:
    """The process' accelerator, chosen on first call and kept."""
    global _current
    if _current is None:
        name = os.environ.get("DS_ACCELERATOR", "").strip().lower()
        if not name:
            name = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
        _current = _from_name(name)
    return _current


def set_accelerator(accel: Accelerator) -> None:
    """Use ``accel`` from now on (DeepSpeed's ``set_accelerator``)."""
    global _current
    missing = [n for n in ("device_name", "communication_backend_name", "is_available") if not hasattr(accel, n)]
    if missing:
        raise TypeError(f"set_accelerator: {type(accel).__name__} lacks {', '.join(missing)} of the Accelerator "
                        "interface")
    _current = accel


def is_current_accelerator_supported() -> bool:
    return get_accelerator().device_name() in BUILT
