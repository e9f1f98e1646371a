"""``zerospeed.runtime.utils``: DeepSpeed's ``set_random_seed`` and ``see_memory_usage``."""

from __future__ import annotations

import gc
import logging
import random

import psutil
import torch

logger = logging.getLogger("zerospeed")


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy (when installed) and torch on every device."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"set_random_seed: seed must be a non-negative int, got {seed!r}")
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:  # numpy is optional
        pass
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


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
