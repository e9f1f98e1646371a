"""ZeRO-3 gradients: bucketed reduce-scatter into the owning rank's gradient shard, every micro-step.

Each parameter that requires a gradient gets a post-accumulate-grad hook. Autograd runs a leaf's
accumulation once per backward, after every use has contributed (a module called twice, a tied
embedding / LM head), so the hook sees the parameter's whole gradient for this micro-step. The
hook copies it into its bucket's flat gradient buffer (full bucket size, model dtype, alive only
until the bucket's reduce-scatter completes) and frees ``param.grad``. When every gradient of a
bucket is in, the bucket's one reduce-scatter starts (asynchronously) and the runtime is told the
bucket's backward use is over, so its gathered parameters can be released.

The reduced shard is added into ``bucket.grad_shard`` (summed over ranks and micro-batches,
multiplied by the loss scale: the optimizer step divides). Buckets whose gradients did not all
arrive (a parameter unused this micro-step) are reduce-scattered by :meth:`finish`, in bucket
order; every rank thus issues the same collectives. So are the buckets inside a ZeRO-3 leaf module
(``deferred``), whose gradients complete in a data-dependent order. Gradients of parameters that require grad but
are not in the optimizer are dropped (they would be full-size, unsharded tensors).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from zerospeed import comm
from zerospeed.zero import zeropp
from zerospeed.zero.grad_buffer_pool import GradBufferPool
from zerospeed.zero.stage3.bucket import Stage3Bucket
from zerospeed.zero.stage3.watchdog import Watchdog


class _Pending:
    __slots__ = ("bucket", "work", "sent", "received")

    def __init__(self, bucket: Stage3Bucket, work: Any, sent: torch.Tensor, received: torch.Tensor) -> None:
        self.bucket, self.work, self.sent, self.received = bucket, work, sent, received


class Stage3GradReducer:
    #: ZeRO++ qgZ (set by the strategy from zero_quantized_gradients)
    quantized_gradients = False

    def __init__(self, buckets: list[Stage3Bucket], dp_group: dist.ProcessGroup | None, watchdog: Watchdog,
                 on_bucket_done: Callable[[Stage3Bucket], None], comm_dtype: torch.dtype | None = None,
                 overlap: bool = True, max_in_flight: int = 2, prescale: float = 1.0) -> None:
        self.buckets = [b for b in buckets if b.num_grad_params]
        self.dp_group = dp_group
        self.watchdog = watchdog
        self.on_bucket_done = on_bucket_done
        self.comm_dtype = comm_dtype
        self.overlap = overlap
        self.max_in_flight = max(1, max_in_flight)
        self.prescale = prescale
        self._where: dict[int, tuple[Stage3Bucket, int]] = {}
        self._handles = []
        for b in self.buckets:
            for pos, p in b.live_params():
                if p.requires_grad:
                    self._where[id(p)] = (b, pos)
                    self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        self._buffers: dict[int, torch.Tensor] = {}
        self._reported: dict[int, int] = {}
        self._launched: set[int] = set()
        self._pending: list[_Pending] = []
        #: buckets inside a ZeRO-3 leaf module (set by the strategy): their gradients arrive in a data-dependent
        #: order (mixture-of-experts experts), which may differ between ranks, so their reduce-scatters are not
        #: started as they complete but in bucket order by finish()
        self.deferred: set[int] = set()
        self._in_backward = False
        self.stray_backward = False
        self.peak_comm_buffer_bytes = 0
        self._pool = GradBufferPool()  # the full-size buffers, reused across micro-steps (zero/grad_buffer_pool.py)

    def begin(self) -> None:
        self._in_backward = True
        self._reported.clear()
        self._launched.clear()

    def finish(self) -> None:
        """After backward: reduce what is left (in bucket order) and wait for every reduction."""
        try:
            for b in self.buckets:
                if b.index not in self._launched:
                    self._launched.add(b.index)
                    if b.trainable:
                        self._launch(b)
            while self._pending:
                self._complete(self._pending.pop(0))
        finally:
            for buf in self._buffers.values():  # never launched (an error above): nothing reads them
                self._pool.give_back(buf)
            self._buffers.clear()
            self._in_backward = False

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        b, pos = self._where[id(param)]
        grad, param.grad = param.grad, None
        if not self._in_backward:
            self.stray_backward = True
            return
        if b.index in self._launched:  # a second accumulation in one backward (reentrant checkpointing):
            self._launched.discard(b.index)  # reduce the bucket again; the shard sums both
            self._reported[b.index] = 0
        if grad is not None and b.trainable:
            buf = self._buffers.get(b.index)
            if buf is None:
                buf = self._buffers[b.index] = self._pool.zeros(b.padded_numel, b.dtype, b.device)
            slot = b.layout.slots[pos]
            part = buf.narrow(0, slot.offset, slot.numel)
            if b.index in self.deferred and self._reported.get(b.index, 0) >= b.num_grad_params:
                part.add_(grad.reshape(-1))  # a deferred bucket's second accumulation (reentrant checkpointing)
            else:
                part.copy_(grad.reshape(-1))
        self._reported[b.index] = self._reported.get(b.index, 0) + 1
        if self._reported[b.index] == b.num_grad_params and b.index in self.deferred:
            self.on_bucket_done(b)  # its reduction waits for finish(), which launches in bucket order
        elif self._reported[b.index] == b.num_grad_params:
            self._launched.add(b.index)
            if b.trainable:
                self._launch(b)
            self.on_bucket_done(b)

    def _launch(self, b: Stage3Bucket) -> None:
        full = self._buffers.pop(b.index, None)
        if full is None:  # no gradient arrived for this bucket in this micro-step
            full = self._pool.zeros(b.padded_numel, b.dtype, b.device)
        sent = full if self.comm_dtype in (None, full.dtype) else full.to(self.comm_dtype)
        if sent is not full:
            self._pool.give_back(full)  # read by the conversion only
        if self.prescale != 1.0:
            sent.mul_(self.prescale)
        received = torch.empty(b.layout.shard_numel, dtype=sent.dtype, device=sent.device)
        self.watchdog.note_collective("reduce_scatter", b.name)
        if self.quantized_gradients:  # ZeRO++ qgZ: int4 blocks through all-to-all (zero/zeropp.py)
            work = zeropp.reduce_scatter_quantized(received, sent, b.group)
        else:
            work = comm.reduce_scatter(received, sent, group=b.group, async_op=True)  # experts: expert-dp
        self._pending.append(_Pending(b, work, sent, received))
        in_flight = sum(p.sent.numel() * p.sent.element_size() + p.received.numel() * p.received.element_size()
                        for p in self._pending)
        in_flight += sum(t.numel() * t.element_size() for t in self._buffers.values())
        self.peak_comm_buffer_bytes = max(self.peak_comm_buffer_bytes, in_flight)
        if not self.overlap:
            self._complete(self._pending.pop())
        elif len(self._pending) > self.max_in_flight:
            self._complete(self._pending.pop(0))

    def _complete(self, p: _Pending) -> None:
        self.watchdog.wait(p.work, "reduce_scatter", p.bucket.name)
        assert p.bucket.grad_shard is not None
        p.bucket.grad_shard.add_(p.received)
        self._pool.give_back(p.sent)  # the reduction is done: the full-size buffer is free
