"""The peak FLOP/s MFU is measured against: given by the user, or measured with a matmul probe.

The probe times square matmuls of the dtype the model computes in (fp32 / bf16 / fp16) on the
profiled device and keeps the best of a few repetitions: the rate this device reaches on the
friendliest kernel, which is the honest denominator for a model-FLOPs utilisation on a machine
whose datasheet peak is unknown (a CPU with a given thread count, a shared GPU). Results are
cached per (device, dtype) for the process.
"""

from __future__ import annotations

import time

import torch

_CACHE: dict[tuple[str, torch.dtype], float] = {}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peak_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                       size: int | None = None, repeats: int = 3) -> float:
    """Best FLOP/s of ``size x size`` matmuls (default 4096 on CUDA, 1024 elsewhere)."""
    device = torch.device(device)
    key = (str(device), dtype)
    if key in _CACHE and size is None:
        return _CACHE[key]
    n = size or (4096 if device.type == "cuda" else 1024)
    if device.type == "cpu" and dtype == torch.float16:
        dtype = torch.float32  # no fast fp16 matmul on CPU: the model's fp16 ops fall back as well
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.matmul(a, b)  # warm-up: kernel selection, allocations
    _sync(device)
    best = float("inf")
    inner = 10 if device.type == "cuda" else 1
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            torch.matmul(a, b)
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / inner)
    rate = 2.0 * n ** 3 / best
    if size is None:
        _CACHE[key] = rate
    return rate
