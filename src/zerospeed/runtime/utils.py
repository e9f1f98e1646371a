"""``zerospeed.runtime.utils``: DeepSpeed's ``set_random_seed``, ``move_to_device`` and ``see_memory_usage``.

Semantics as ``deepspeed/runtime/utils.py`` (0.19.8): ``set_random_seed`` takes any int (NumPy gets it modulo 2**32,
torch modulo 2**63, as DeepSpeed reduces it); ``move_to_device`` moves a tensor, or the tensors nested in lists,
tuples and dicts, to ``device`` and returns the result, replacing the storage in place (``item.data``) of the
tensors ``criterion_func`` selects. Decision: a leaf that is not a tensor and has no ``.to`` (an int, a string,
None) is returned as it is, where DeepSpeed raises ``AttributeError``.
"""

from __future__ import annotations

from typing import Any, Callable

import gc
import logging
import random

import psutil
import torch

logger = logging.getLogger("zerospeed")


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy (when installed, ``seed % 2**32``) and torch on every device
    (``seed % 2**63``), as DeepSpeed does; any int is accepted, negative ones included."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"set_random_seed: seed must be an int, got {seed!r}")
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:  # numpy is optional
        pass
    torch.manual_seed(seed % (2**63))  # every device's generator


def move_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool] | None = None) -> Any:
    """``item`` (a tensor or nested lists / tuples / dicts of them) on ``device``; containers are rebuilt.

    A tensor for which ``criterion_func`` is true keeps its identity: its storage is replaced (``item.data``) and
    the same object is returned, so references held elsewhere (an optimizer's, a module's) see the move. Every
    other tensor is returned as ``item.to(device)`` (DeepSpeed moves those too)."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device) if hasattr(item, "to") else item


def memory_usage() -> dict[str, float]:
    """Device and host memory in GiB, as :func:`see_memory_usage` reports it."""
    from zerospeed.accelerator import get_accelerator

    acc = get_accelerator()
    gib = 1024**3
    vm = psutil.virtual_memory()
    return {"allocated_gb": acc.memory_allocated() / gib, "max_allocated_gb": acc.max_memory_allocated() / gib,
            "cached_gb": acc.memory_cached() / gib, "max_cached_gb": acc.max_memory_cached() / gib,
            "cpu_used_gb": (vm.total - vm.available) / gib, "cpu_percent": float(vm.percent)}


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log device and host memory on rank 0, only when ``force`` is true (as DeepSpeed: the
    call sites stay in the code and are switched on when needed). Resets the peak statistics."""
    from zerospeed import comm
    from zerospeed.accelerator import get_accelerator

    if not force or comm.get_rank() != 0:
        return
    gc.collect()
    m = memory_usage()
    logger.info("%s | MA %.2f GB  Max_MA %.2f GB  CA %.2f GB  Max_CA %.2f GB | CPU Virtual Memory: used = %.2f GB, "
                "percent = %.1f%%", message, m["allocated_gb"], m["max_allocated_gb"], m["cached_gb"],
                m["max_cached_gb"], m["cpu_used_gb"], m["cpu_percent"])
    get_accelerator().reset_peak_memory_stats()
