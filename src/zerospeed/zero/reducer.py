"""Gradient hooks that reduce each bucket as soon as its last gradient is ready, during backward.

One :class:`GradientReducer` owns the post-accumulate-grad hooks of every trainable parameter and
the collectives they start: one all-reduce (stage 0) or one reduce-scatter (stages 1-2) per bucket.

Ordering guarantee (why nothing here can deadlock on divergent readiness): buckets are launched
strictly in bucket order. A bucket that is complete waits until every earlier bucket has been
launched; whatever is still unlaunched when backward returns (a parameter unused in this forward)
is launched by :meth:`finish` in the same order. Every rank therefore issues the same sequence of
collectives whatever order its gradients arrived in.

Collectives are asynchronous: gloo and NCCL progress them on their own threads/streams while
autograd continues, which is the overlap of communication with the rest of backward. With
``overlap=False`` each collective is waited for right after it starts. Transient buckets (stage 2)
bound memory: at most ``max_in_flight`` full-size buffers exist while reductions are in flight.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zerospeed import comm
from zerospeed.zero.flat_bucket import FlatBucket
from zerospeed.zero.grad_buffer_pool import GradBufferPool


class _Pending:
    __slots__ = ("bucket", "work", "sent", "received")

    def __init__(self, bucket: FlatBucket, work: Any, sent: torch.Tensor, received: torch.Tensor | None) -> None:
        self.bucket, self.work, self.sent, self.received = bucket, work, sent, received


class GradientReducer:
    def __init__(self, buckets: list[FlatBucket], op: str, dp_group: dist.ProcessGroup | None,
                 comm_dtype: torch.dtype | None = None, overlap: bool = True, max_in_flight: int = 2,
                 prescale: float = 1.0) -> None:
        if op not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"op must be 'all_reduce' or 'reduce_scatter', got {op!r}")
        self.buckets = buckets
        self.op = op
        self.dp_group = dp_group
        self.comm_dtype = comm_dtype
        self.overlap = overlap
        self.max_in_flight = max(1, max_in_flight)
        self.prescale = prescale  # multiply gradients by this before they are sent (1.0: no pass)
        self._where: dict[int, tuple[int, int]] = {}
        self._handles = []
        for b, bucket in enumerate(buckets):
            for i, p in enumerate(bucket.params):
                self._where[id(p)] = (b, i)
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        self._ready = [0] * len(buckets)
        self._transient: list[torch.Tensor | None] = [None] * len(buckets)
        self._pool = GradBufferPool()  # the transient buffers, reused across micro-steps (grad_buffer_pool.py)
        self._next = 0
        self._pending: list[_Pending] = []
        self._in_backward = False
        self._reduce_now = False
        self.stray_backward = False  # a hook fired outside engine.backward (user called loss.backward())
        #: the gradient buffers hold the reduction over ranks (False between micro-batches at stages 0-1, where
        #: the persistent buffers hold this rank's local sum until the accumulation boundary's backward)
        self.reduced = True
        self.peak_comm_buffer_bytes = 0

    # -- lifecycle -------------------------------------------------------------------------------
    def begin(self, reduce_now: bool) -> None:
        """Called before a micro-step's backward; ``reduce_now``: reduce during this backward."""
        self._in_backward = True
        self._reduce_now = reduce_now or self.buckets_are_transient
        self.reduced = self._reduce_now  # what the buffers hold after this backward: reduced, or local sums
        self._ready = [0] * len(self.buckets)
        self._next = 0

    @property
    def buckets_are_transient(self) -> bool:
        return bool(self.buckets) and self.buckets[0].grad_mode == "transient"

    def finish(self) -> None:
        """Called after backward: launch what is left (in order) and wait for every reduction."""
        try:
            if self._reduce_now:
                while self._next < len(self.buckets):
                    self._launch(self._next)
                    self._next += 1
            while self._pending:
                self._complete(self._pending.pop(0))
        finally:
            self._in_backward = False

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- hooks -----------------------------------------------------------------------------------
    def accept_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """A gradient computed where autograd does not accumulate it (a DeepCompile backward graph):
        accumulate it as autograd would, then do what the hook does (the bucket may start its reduction)."""
        b, i = self._where[id(param)]
        bucket = self.buckets[b]
        with torch.no_grad():
            if bucket.grad_mode == "persistent" and not bucket.grads_are_views:  # fp32 accumulation: the hook adds
                param.grad = grad if param.grad is None else param.grad + grad
            elif bucket.grad_mode == "persistent":
                view = bucket.grad_view(i)
                if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
                    view.copy_(param.grad)
                param.grad = view
                view.add_(grad.reshape(view.shape))
            else:
                param.grad = grad if param.grad is None else param.grad + grad
        self._on_grad_ready(param)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        b, i = self._where[id(param)]
        bucket = self.buckets[b]
        if bucket.grad_mode == "persistent" and not bucket.grads_are_views:
            if param.grad is not None:  # this backward's gradient, summed into the (fp32) buffer
                bucket.grad_view(i).add_(param.grad.reshape(bucket.layout.slots[i].shape))
                param.grad = None
        elif bucket.grad_mode == "persistent":
            view = bucket.grad_view(i)
            if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
                view.copy_(param.grad)  # user code replaced .grad (e.g. set_to_none): adopt its value
                param.grad = view
        elif param.grad is not None:
            buf = self._transient[b]
            if buf is None:
                buf = self._transient[b] = self._new_transient(bucket)
            slot = bucket.layout.slots[i]
            buf.narrow(0, slot.offset, slot.numel).copy_(param.grad.reshape(-1))
            param.grad = None
        if not self._in_backward:
            self.stray_backward = True
            return
        if not self._reduce_now:
            return
        self._ready[b] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next].params):
            self._launch(self._next)
            self._next += 1

    def _new_transient(self, bucket: FlatBucket) -> torch.Tensor:
        return self._pool.zeros(bucket.layout.padded_numel, bucket.grad_dtype, bucket.device)

    # -- collectives -----------------------------------------------------------------------------
    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        if bucket.grad_mode == "transient":
            full = self._transient[b]
            if full is None:  # no parameter of this bucket got a gradient this micro-step
                full = self._new_transient(bucket)
            self._transient[b] = None
        else:
            assert bucket.grad_buffer is not None
            full = bucket.grad_buffer
        sent = full if self.comm_dtype in (None, full.dtype) else full.to(self.comm_dtype)
        if sent is not full:
            self._pool.give_back(full)  # read by the conversion only
        if self.prescale != 1.0:
            sent.mul_(self.prescale)
        group = getattr(bucket, "comm_group", self.dp_group)  # expert buckets: their expert-dp group
        if self.op == "all_reduce":
            work = comm.all_reduce(sent, group=group, async_op=True)
            received = None
        else:
            if sent is bucket.grad_buffer:  # stage 1: reduce in place into this rank's range of the buffer
                received = bucket.reduced_grad()
            else:
                received = torch.empty(bucket.layout.shard_numel, dtype=sent.dtype, device=sent.device)
            work = comm.reduce_scatter(received, sent, group=group, async_op=True)
        self._pending.append(_Pending(bucket, work, sent, received))
        in_flight = sum(p.sent.numel() * p.sent.element_size() for p in self._pending
                        if p.sent is not p.bucket.grad_buffer)
        self.peak_comm_buffer_bytes = max(self.peak_comm_buffer_bytes, in_flight)
        if not self.overlap:
            self._complete(self._pending.pop())
        elif bucket.grad_mode == "transient" and len(self._pending) > self.max_in_flight:
            self._complete(self._pending.pop(0))

    def _complete(self, p: _Pending) -> None:
        p.work.wait()
        bucket = p.bucket
        if self.op == "all_reduce":
            if p.sent is not bucket.grad_buffer:
                assert bucket.grad_buffer is not None
                bucket.grad_buffer.copy_(p.sent)
            return
        assert p.received is not None
        if bucket.grad_mode == "transient":
            assert bucket.grad_shard is not None
            bucket.grad_shard.add_(p.received)
            self._pool.give_back(p.sent)  # the reduction is done: the full-size buffer is free
        elif p.received.data_ptr() != bucket.reduced_grad().data_ptr():
            bucket.reduced_grad().copy_(p.received)  # stage 1 with a different communication dtype
