"""One bucket's tensors: the flat parameter buffer, its gradient storage and this rank's shard.

A :class:`FlatBucket` is the only code that re-points a module's parameters (``param.data``) at
views of a flat buffer, and the only owner of gradient storage for its parameters:

* ``persistent`` gradients (stages 0 and 1): a flat buffer the size of the bucket; each
  ``param.grad`` is a view of it, so autograd accumulates micro-batches in place and the buffer
  is reduced as one message with no copy.
* ``transient`` gradients (stage 2): the full-size buffer exists only from the bucket's first
  gradient of a micro-step until its reduce-scatter completes (the reducer reuses its storage across
  micro-steps: ``zero/grad_buffer_pool.py``); what persists is this rank's reduced shard
  (``grad_shard``), 1/N of the bucket.

``grad_dtype`` other than the parameters' (bf16 parameters with fp32 accumulation, DeepSpeed's
``data_types.grad_accum_dtype``): a ``.grad`` cannot view a buffer of another dtype, so ``param.grad`` stays
autograd's own tensor for one backward and the reducer adds it into the buffer (persistent) or copies it into the
transient buffer, then clears it; micro-batches are summed in ``grad_dtype``.

Invariants: ``param_buffer`` has ``layout.padded_numel`` elements in the model dtype, padding
zero; ``reduced_grad()`` is this rank's reduced (summed, not yet averaged or unscaled) gradient,
either the whole bucket (stage 0) or its shard.
"""

from __future__ import annotations

import torch
from torch import nn

from zerospeed.zero.layout import BucketLayout


class FlatBucket:
    def __init__(self, layout: BucketLayout, params: list[nn.Parameter], rank: int, sharded: bool,
                 grad_mode: str, grad_dtype: torch.dtype | None = None) -> None:
        if grad_mode not in ("persistent", "transient"):
            raise ValueError(f"grad_mode must be 'persistent' or 'transient', got {grad_mode!r}")
        self.layout = layout
        self.params = params
        self.sharded = sharded
        self.grad_mode = grad_mode
        first = params[0]
        self.dtype = first.dtype
        self.device = first.device
        self.grad_dtype = grad_dtype or self.dtype
        self.shard_start, self.shard_end = layout.shard_range(rank) if sharded else (0, layout.padded_numel)

        self.param_buffer = torch.zeros(layout.padded_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for slot, p in zip(layout.slots, params):
                if p.dtype != self.dtype or p.device != self.device:
                    raise ValueError(f"parameter {slot.name!r} is {p.dtype} on {p.device}; its bucket holds "
                                     f"{self.dtype} on {self.device}: a bucket needs one dtype and device")
                view = self._slot_view(self.param_buffer, slot.offset, slot.numel, slot.shape)
                view.copy_(p.data)
                p.data = view

        self.grad_buffer: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        if grad_mode == "persistent":
            self.grad_buffer = torch.zeros(layout.padded_numel, dtype=self.grad_dtype, device=self.device)
            self.attach_grad_views()
        else:
            self.grad_shard = torch.zeros(self.shard_end - self.shard_start, dtype=self.grad_dtype, device=self.device)

    @staticmethod
    def _slot_view(buffer: torch.Tensor, offset: int, numel: int, shape: tuple[int, ...]) -> torch.Tensor:
        return buffer.narrow(0, offset, numel).view(shape)

    def grad_view(self, i: int) -> torch.Tensor:
        assert self.grad_buffer is not None
        slot = self.layout.slots[i]
        return self._slot_view(self.grad_buffer, slot.offset, slot.numel, slot.shape)

    @property
    def grads_are_views(self) -> bool:
        """Whether each ``param.grad`` is a view of the persistent buffer (same dtype), so autograd accumulates
        into the buffer itself; otherwise the reducer adds each backward's gradient into it."""
        return self.grad_mode == "persistent" and self.grad_dtype == self.dtype

    def attach_grad_views(self) -> None:
        """Point every ``param.grad`` at its slot of the persistent gradient buffer (cleared when the buffer has
        another dtype than the parameters: see the module docstring)."""
        for i, p in enumerate(self.params):
            p.grad = self.grad_view(i) if self.grads_are_views else None

    def param_shard(self) -> torch.Tensor:
        """This rank's range of the flat parameter buffer (the whole bucket when not sharded)."""
        return self.param_buffer.narrow(0, self.shard_start, self.shard_end - self.shard_start)

    def reduced_grad(self) -> torch.Tensor:
        """This rank's reduced gradient: the full bucket (stage 0) or its shard (stages 1-2)."""
        if self.grad_shard is not None:
            return self.grad_shard
        assert self.grad_buffer is not None
        return self.grad_buffer.narrow(0, self.shard_start, self.shard_end - self.shard_start)

    def zero_grad(self) -> None:
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
            self.attach_grad_views()  # in case user code replaced or cleared a .grad
        if self.grad_shard is not None:
            self.grad_shard.zero_()
            for p in self.params:
                p.grad = None

    def param_views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Parameter-shaped views of a full-bucket flat tensor (for per-parameter optimizer state)."""
        return [self._slot_view(flat, s.offset, s.numel, s.shape) for s in self.layout.slots]

    def param_bytes(self) -> int:
        return self.param_buffer.numel() * self.param_buffer.element_size()

    def grad_bytes(self) -> int:
        held = self.grad_buffer if self.grad_buffer is not None else self.grad_shard
        assert held is not None
        return held.numel() * held.element_size()
