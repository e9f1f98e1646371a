"""How a full checkpoint keeps its inputs until the backward: as they are, partitioned over the
tensor-parallel group, and/or offloaded to host memory with a prefetch for the backward.

:class:`InputStore` is one checkpoint's saved inputs. Its tensors go through
``ctx.save_for_backward`` (so ``saved_tensors_hooks``, and the byte counter of
:mod:`zerospeed.checkpointing.measure`, see exactly what is kept).

Partitioning (``partition_activations``, TP degree > 1): a floating-point input is flattened,
padded to a multiple of the TP degree, and each rank keeps its 1/tp slice; the backward
all-gathers it over the TP group (through :mod:`zerospeed.comm`, counted). The inputs must be
replicated over the TP group, as the hidden states between Megatron-style TP layers are.

Host offload (``cpu_checkpointing``, CUDA): the kept tensors are copied to pinned host memory on a
side stream, ordered after the forward that produced them; the device copy is freed when the
copy is done (the caching allocator reuses it only after the side stream's event). Checkpoints
register in forward order; when the backward reaches checkpoint ``k`` it waits for (or starts)
``k``'s copy back and starts ``k - 1``'s on the side stream, so the next recompute finds its inputs
on the device. On CPU the tensors already live in host memory: offload keeps them as they are
(measured in bench/activation_bench.py as a no-op).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from zerospeed import comm


class _Partitioned:
    """Metadata to rebuild a tensor from this rank's slice."""

    __slots__ = ("shape", "numel", "dtype")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.numel, self.dtype = tensor.shape, tensor.numel(), tensor.dtype


def _partition(tensor: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    chunk = -(-flat.numel() // tp_size)
    start = min(tp_rank * chunk, flat.numel())
    mine = torch.zeros(chunk, dtype=flat.dtype, device=flat.device)
    piece = flat[start:start + chunk]
    mine[:piece.numel()].copy_(piece)
    return mine


def _gather(mine: torch.Tensor, meta: _Partitioned, group: Any, tp_size: int) -> torch.Tensor:
    full = torch.empty(mine.numel() * tp_size, dtype=mine.dtype, device=mine.device)
    comm.all_gather(full, mine.contiguous(), group=group)
    return full[:meta.numel].view(meta.shape)


class _HostCopy:
    """One checkpoint's tensors in pinned host memory, with the copy back to the device."""

    def __init__(self, tensors: list[torch.Tensor], device: torch.device, stream: Any) -> None:
        self.device = device
        self.stream = stream
        self.host: list[torch.Tensor] = []
        self.back: list[torch.Tensor] | None = None
        self.back_event: Any = None
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for t in tensors:
                h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                h.copy_(t, non_blocking=True)
                t.record_stream(stream)  # the device memory is reused only after this copy
                self.host.append(h)
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def prefetch(self) -> None:
        if self.back is not None:
            return
        self.stream.wait_event(self.event)
        with torch.cuda.stream(self.stream):
            self.back = [h.to(self.device, non_blocking=True) for h in self.host]
        self.back_event = torch.cuda.Event()
        self.back_event.record(self.stream)

    def fetch(self) -> list[torch.Tensor]:
        self.prefetch()
        torch.cuda.current_stream(self.device).wait_event(self.back_event)
        for t in self.back:
            t.record_stream(torch.cuda.current_stream(self.device))
        out, self.back, self.host = self.back, None, []
        return out


class _OffloadQueue:
    """Checkpoints with host copies in forward order (weakly held): the backward prefetches the previous one."""

    def __init__(self) -> None:
        self.order: list[weakref.ref] = []
        self.stream: Any = None

    def side_stream(self, device: torch.device) -> Any:
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        return self.stream

    def add(self, copy: _HostCopy) -> None:
        self.order = [r for r in self.order if r() is not None]
        self.order.append(weakref.ref(copy))

    def before_backward_of(self, copy: _HostCopy) -> None:
        alive = [r() for r in self.order]
        alive = [c for c in alive if c is not None]
        if copy in alive:
            i = alive.index(copy)
            if i > 0:
                alive[i - 1].prefetch()
            self.order = [weakref.ref(c) for c in alive if c is not copy]


OFFLOAD_QUEUE = _OffloadQueue()


class InputStore:
    """One checkpoint's inputs between its forward and its recomputation.

    ``pack(inputs)`` returns the tensors to hand to ``ctx.save_for_backward``; ``unpack(saved)``
    returns the inputs again (full, on their device), detached.
    """

    def __init__(self, settings: Any, tp: tuple[Any, int, int]) -> None:
        self.settings = settings
        self.group, self.tp_size, self.tp_rank = tp
        self.metas: list[_Partitioned | None] = []
        self.sizes: list[int] = []
        self.packed = False
        self.host: _HostCopy | None = None

    def pack(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        kept: list[torch.Tensor] = []
        for t in inputs:
            if self.settings.partition_activations and self.tp_size > 1 and t.is_floating_point():
                self.metas.append(_Partitioned(t))
                kept.append(_partition(t, self.tp_size, self.tp_rank))
            else:
                self.metas.append(None)
                kept.append(t.detach())
        if self.settings.contiguous_checkpointing and len(kept) > 1 and len({k.dtype for k in kept}) == 1 \
                and len({k.device for k in kept}) == 1:
            self.sizes = [k.numel() for k in kept]
            self.shapes = [k.shape for k in kept]
            kept = [torch.cat([k.reshape(-1) for k in kept])]
            self.packed = True
        device = kept[0].device if kept else torch.device("cpu")
        if self.settings.cpu_checkpointing and device.type == "cuda":
            self.host = _HostCopy(kept, device, OFFLOAD_QUEUE.side_stream(device))
            OFFLOAD_QUEUE.add(self.host)
            return list(self.host.host)
        return kept

    def unpack(self, saved: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        kept = list(saved)
        if self.host is not None:
            OFFLOAD_QUEUE.before_backward_of(self.host)
            kept = self.host.fetch()
            self.host = None
        if self.packed:
            kept = [piece.view(shape) for piece, shape in zip(kept[0].split(self.sizes), self.shapes)]
        out = []
        for t, meta in zip(kept, self.metas):
            out.append(t if meta is None else _gather(t, meta, self.group, self.tp_size))
        return out
