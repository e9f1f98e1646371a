"""The CPU accelerator: one "device" per local process, gloo for communication.

Facts kept from DeepSpeed's CPU accelerator: every device is named ``cpu``; ``current_device()`` is
the local rank; ``device_count()`` is ``LOCAL_SIZE`` when set (else ``LOCAL_WORLD_SIZE``, which
torchrun sets, else 1); memory statistics are the process' resident set size and the machine's
memory (psutil); streams and events do not exist (``Stream``/``Event`` are ``None``, ``stream()`` is a
no-op context). Difference: the backend is always gloo (DeepSpeed prefers oneCCL when installed).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import psutil
import torch

from zerospeed.accelerator.abstract import Accelerator, local_rank


class CPUAccelerator(Accelerator):
    _name = "cpu"
    _communication_backend_name = "gloo"

    def __init__(self) -> None:
        self._peak_rss = self._rss()

    def is_synchronized_device(self) -> bool:
        return True

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"

    def current_device_name(self) -> str:
        return "cpu"

    def device(self, device_index: int | None = None) -> Any:
        return None

    def set_device(self, device_index: int) -> None:
        return None

    def current_device(self) -> int:
        return local_rank()

    def device_count(self) -> int:
        for env in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
            value = int(os.environ.get(env, "0") or 0)
            if value > 0:
                return value
        return 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    # streams / events
    @property
    def Stream(self) -> Any:  # noqa: N802
        return None

    @property
    def Event(self) -> Any:  # noqa: N802
        return None

    def stream(self, stream: Any) -> Any:
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return None

    def default_stream(self, device_index: int | None = None) -> Any:
        return None

    # memory: the process' resident set stands for "allocated"
    @staticmethod
    def _rss() -> int:
        return int(psutil.Process().memory_info().rss)

    def empty_cache(self) -> None:
        return None

    def memory_allocated(self, device_index: int | None = None) -> int:
        rss = self._rss()
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return max(self._peak_rss, self.memory_allocated())

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self._peak_rss = self._rss()

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._peak_rss = self._rss()

    memory_cached = memory_allocated
    max_memory_cached = max_memory_allocated
    memory_reserved = memory_allocated
    max_memory_reserved = max_memory_allocated
    reset_max_memory_cached = reset_max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict[str, int]:
        allocated = self.memory_allocated()
        return {"allocated_bytes.all.current": allocated, "allocated_bytes.all.peak": self._peak_rss}

    def total_memory(self, device_index: int | None = None) -> int:
        return int(psutil.virtual_memory().total)

    def available_memory(self, device_index: int | None = None) -> int:
        return int(psutil.virtual_memory().available)

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        # fp16 matmuls run on every CPU torch build (slowly without AVX512-FP16); the engine's fp16
        # path is tested on CPU, so report it as supported.
        return True

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"
