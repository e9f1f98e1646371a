"""Reused full-size gradient buffers for the transient reductions of ZeRO stages 2 and 3.

A transient bucket's full-size gradient buffer lives from the bucket's first gradient of a micro-step until its
reduce-scatter completes. Allocated with ``torch.zeros`` every micro-step, each buffer above glibc's mmap
threshold is a fresh mapping whose every page faults on first touch: on a 2-core AMD EPYC, allocating, zeroing
and touching once cost 1.4 / 14.6 / 90 ms for 1M / 8M / 50M fp32 elements, against 0.1 / 1.6 / 12.7 ms for
zeroing and touching a kept buffer (about 7x). ``bench/grad_buffer_bench.py`` (``grad_buffer_bench-20261128-130623``,
the bench GPT of 14M parameters, one rank, one thread, DeepSpeed's default ``reduce_bucket_size``): at ZeRO-2 (one
57 MB bucket) the buffer costs 19.9 ms per step fresh and 3.3 ms reused, and the step's CPU time goes from 0.965 to
0.945 s; stage 3's 83 buckets of at most 2.4 MB stay below :data:`MIN_POOLED_BYTES` (5.4 ms either way).

:class:`GradBufferPool` keeps the buffers that finished reductions give back and hands them out again, zeroed
over the part the caller uses (the best fit: the smallest free buffer of that dtype and device that is large
enough). It never keeps more bytes than were handed out at once, so the peak is the same as without it. Between
steps those bytes stay mapped, as DeepSpeed's ``reduce_bucket_size`` buffers do. ``ZEROSPEED_GRAD_BUFFER_POOL=0``
turns the reuse off (every buffer is a fresh ``torch.zeros``, as before); any other value than ``0``/``1``/unset is
refused by name.
"""

from __future__ import annotations

import os

import torch

__all__ = ["MIN_POOLED_BYTES", "GradBufferPool", "pool_enabled"]

#: buffers below this size are allocated fresh, as before: the allocator's free lists already serve them cheaply
#: (pooling stage 3's 83 buckets of at most 2.4 MB too cost 0.4 ms more per step than fresh buffers in a trial run)
MIN_POOLED_BYTES = 4 << 20


def pool_enabled() -> bool:
    raw = os.environ.get("ZEROSPEED_GRAD_BUFFER_POOL", "")
    if raw not in ("", "0", "1"):
        raise ValueError(f"ZEROSPEED_GRAD_BUFFER_POOL: {raw!r} is not '0' (off), '1' (on) or unset (on)")
    return raw != "0"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class GradBufferPool:
    """Zeroed 1-D buffers that are given back after use and handed out again (see the module docstring)."""

    def __init__(self, enabled: bool | None = None, min_bytes: int | None = None) -> None:
        self.enabled = pool_enabled() if enabled is None else enabled
        self.min_bytes = MIN_POOLED_BYTES if min_bytes is None else min_bytes
        self._free: dict[tuple[torch.dtype, torch.device, int], list[torch.Tensor]] = {}  # kept, by size
        self._kept = 0  # bytes kept in _free
        self._out: dict[int, int] = {}  # data_ptr of a handed-out buffer -> the bytes of its whole tensor
        self._out_bytes = 0
        self.limit_bytes = 0  # the most bytes handed out at once: the pool keeps no more than this
        self.reused = 0  # buffers handed out again (tests read it)

    def zeros(self, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A zeroed buffer of ``numel`` elements; give it back with :meth:`give_back` once nothing reads it."""
        if not self.enabled or numel == 0 or numel * dtype.itemsize < self.min_bytes:
            return torch.zeros(numel, dtype=dtype, device=device)
        device = torch.device(device)
        key: tuple[torch.dtype, torch.device, int] | None = (dtype, device, numel)
        if not self._free.get(key):  # no kept buffer of this size: the smallest larger one of this dtype and device
            larger = [k for k, kept in self._free.items() if kept and k[:2] == (dtype, device) and k[2] >= numel]
            key = min(larger, key=lambda k: k[2], default=None)
        if key is None:
            whole = out = torch.zeros(numel, dtype=dtype, device=device)
        else:
            whole = self._free[key].pop()
            self._kept -= _nbytes(whole)
            out = whole if whole.numel() == numel else whole.narrow(0, 0, numel)
            out.zero_()
            self.reused += 1
        self._out[out.data_ptr()] = _nbytes(whole)
        self._out_bytes += _nbytes(whole)
        self.limit_bytes = max(self.limit_bytes, self._out_bytes)
        return out

    def give_back(self, buffer: torch.Tensor) -> None:
        """``buffer`` (from :meth:`zeros`) is no longer read or written: keep it for a later call, within the limit.
        A tensor this pool did not hand out is ignored."""
        size = self._out.pop(buffer.data_ptr(), None)
        if size is None:
            return
        self._out_bytes -= size
        whole = buffer if buffer._base is None else buffer._base  # a reused buffer may be a narrow view of a kept one
        if self._kept + size <= self.limit_bytes:
            self._free.setdefault((whole.dtype, whole.device, whole.numel()), []).append(whole)
            self._kept += size

    def kept_bytes(self) -> int:
        return self._kept
