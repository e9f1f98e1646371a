"""Reused full-size gradient buffers for the transient reductions of ZeRO stages 2 and 3.

A transient bucket's full-size gradient buffer lives from the bucket's first gradient of a micro-step until its
reduce-scatter completes. Allocated with ``torch.zeros`` every micro-step, each buffer above glibc's mmap
threshold is a fresh mapping whose every page faults on first touch: on a 2-core AMD EPYC, allocating, zeroing
and touching once cost 1.4 / 14.6 / 90 ms for 1M / 8M / 50M fp32 elements, against 0.1 / 1.6 / 12.7 ms for
zeroing and touching a kept buffer (about 7x). In a ZeRO-2 step of ``bench/``'s 14M-parameter GPT (one 57 MB
bucket at the default ``reduce_bucket_size``; 8 x 128 tokens, one rank, one thread) the buffer cost 19.3 ms per step
fresh and 3.3-3.6 ms reused, of a 0.94 s step; stage 3's 83 small buckets stay below the threshold (no change).

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

__all__ = ["GradBufferPool", "pool_enabled"]


def pool_enabled() -> bool:
    raw = os.environ.get("ZEROSPEED_GRAD_BUFFER_POOL", "")
    if raw not in ("", "0", "1"):
        raise ValueError(f"ZEROSPEED_GRAD_BUFFER_POOL: {raw!r} is not '0' (off), '1' (on) or unset (on)")
    return raw != "0"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class GradBufferPool:
    """Zeroed 1-D buffers that are given back after use and handed out again (see the module docstring)."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = pool_enabled() if enabled is None else enabled
        self._free: list[torch.Tensor] = []
        self._out: dict[int, int] = {}  # data_ptr of a handed-out buffer -> the bytes of its whole tensor
        self._out_bytes = 0
        self.limit_bytes = 0  # the most bytes handed out at once: the pool keeps no more than this
        self.reused = 0  # buffers handed out again (tests read it)

    def zeros(self, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A zeroed buffer of ``numel`` elements; give it back with :meth:`give_back` once nothing reads it."""
        if not self.enabled or numel == 0:
            return torch.zeros(numel, dtype=dtype, device=device)
        device = torch.device(device)
        best = None
        for i, t in enumerate(self._free):
            if t.dtype == dtype and t.device == device and t.numel() >= numel and \
                    (best is None or t.numel() < self._free[best].numel()):
                best = i
        if best is None:
            whole = torch.zeros(numel, dtype=dtype, device=device)
            out = whole
        else:
            whole = self._free.pop(best)
            out = whole.narrow(0, 0, numel)
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
        whole = buffer if buffer._base is None else buffer._base  # a reused buffer is a narrow view of a kept one
        if self.kept_bytes() + size <= self.limit_bytes:
            self._free.append(whole)

    def kept_bytes(self) -> int:
        return sum(_nbytes(t) for t in self._free)

    def clear(self) -> None:
        """Drop every kept buffer (handed-out ones stay valid and are simply not kept when given back)."""
        self._free.clear()
