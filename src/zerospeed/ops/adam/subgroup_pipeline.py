"""The sub-group pipeline of offloaded Adam: d2h of the next, update of this, h2d of the previous.

ZeRO-Offload keeps fp32 master parameters and Adam moments in host memory, split into
sub-groups of at most ``sub_group_size`` elements. Per step, for each sub-group ``i``::

    copy its gradient device -> host   (grad buffer, pinned)          \
    Adam update on the CPU             (master param, moments)          > pipelined over i
    copy the updated param host -> device (the device's param shard)  /

:func:`run_subgroup_pipeline` issues them so that while the CPU updates sub-group ``i``, the
device-to-host copy of ``i + 1`` and the host-to-device copy of ``i - 1`` are in flight::

    start_d2h(0)
    for i: start_d2h(i + 1); wait_d2h(i); update(i); start_h2d(i)
    finish()

The copies are done by a *copy engine*:

* :class:`CudaStreamCopies` - two CUDA streams (one per direction) and one event per sub-group;
  the d2h stream first waits for the current (compute) stream, so gradients are complete; host
  buffers should be pinned (``zerospeed.ops.aio.new_aligned_tensor(..., pin_memory=True)``) or
  the "async" copies serialise. ``finish`` makes the compute stream wait for the h2d stream and
  then synchronises the h2d stream, because the caller may modify host params right after.
  **This path is unmeasured: the project's machine has no GPU.** It is written from the CUDA
  stream semantics; on a GPU box, check overlap with a profiler before trusting it.
* :class:`SyncCopies` - plain ``copy_`` at the same points, for CPU-only runs (where "device"
  tensors are CPU tensors; a copy is skipped when source and destination are the same memory).

The same loop runs either way, which is what the CPU tests exercise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["SubGroup", "SyncCopies", "CudaStreamCopies", "copies_for", "run_subgroup_pipeline"]


@dataclass(eq=False)  # identity: fields are tensors
class SubGroup:
    """One sub-group's host buffers (flat, same ``numel``) and optional device endpoints.

    ``param``/``exp_avg``/``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad) are updated in
    place; ``step`` is a float32 scalar tensor, incremented by the update. ``grad`` is read by the
    update; when ``device_grad`` is given it is first filled from it (d2h). When
    ``device_param`` is given it receives ``param`` after the update (h2d, cast to its dtype).
    """

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    max_exp_avg_sq: torch.Tensor | None = None
    device_grad: torch.Tensor | None = None
    device_param: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls,
        numel: int,
        *,
        dtype: torch.dtype = torch.float32,
        pin_memory: bool = False,
        amsgrad: bool = False,
    ) -> SubGroup:
        """Zeroed host buffers for ``numel`` elements (pinned only when CUDA is available)."""
        pin = pin_memory and torch.cuda.is_available()

        def zeros() -> torch.Tensor:
            return torch.zeros(numel, dtype=dtype, pin_memory=pin)

        return cls(param=zeros(), grad=zeros(), exp_avg=zeros(), exp_avg_sq=zeros(),
                   step=torch.zeros((), dtype=torch.float32),
                   max_exp_avg_sq=zeros() if amsgrad else None)

    @property
    def numel(self) -> int:
        return self.param.numel()

    def check(self, index: int) -> None:
        n = self.param.numel()
        named = [("grad", self.grad), ("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq),
                 ("max_exp_avg_sq", self.max_exp_avg_sq), ("device_grad", self.device_grad),
                 ("device_param", self.device_param)]
        for name, t in named:
            if t is not None and t.numel() != n:
                raise ValueError(f"sub-group {index}: {name} has {t.numel()} elements, param has {n}")
        for name, t in [("param", self.param), *named[:4]]:
            if t is not None and t.device.type != "cpu":
                raise ValueError(f"sub-group {index}: host buffer {name} is on {t.device}, must be on CPU")


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype


class SyncCopies:
    """Copy engine without streams: copies happen inline (CPU-only machines)."""

    def __init__(self, subgroups: Sequence[SubGroup]) -> None:
        self.subgroups = subgroups

    def start_d2h(self, i: int) -> None:
        sg = self.subgroups[i]
        if sg.device_grad is not None and not _same_memory(sg.device_grad, sg.grad):
            sg.grad.view(-1).copy_(sg.device_grad.reshape(-1))

    def wait_d2h(self, i: int) -> None:
        pass

    def start_h2d(self, i: int) -> None:
        sg = self.subgroups[i]
        if sg.device_param is not None and not _same_memory(sg.device_param, sg.param):
            sg.device_param.view(-1).copy_(sg.param.view(-1))

    def finish(self) -> None:
        pass


class CudaStreamCopies:
    """Copy engine with one CUDA stream per direction and an event per d2h (unmeasured here)."""

    def __init__(self, subgroups: Sequence[SubGroup], device: torch.device) -> None:
        self.subgroups = subgroups
        self.device = device
        self.compute = torch.cuda.current_stream(device)
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self.d2h.wait_stream(self.compute)  # gradients were produced on the compute stream
        self.h2d.wait_stream(self.compute)  # do not overwrite params the compute stream still reads
        self.events: list[torch.cuda.Event | None] = [None] * len(subgroups)

    def start_d2h(self, i: int) -> None:
        sg = self.subgroups[i]
        if sg.device_grad is None:
            return
        with torch.cuda.stream(self.d2h):
            sg.grad.view(-1).copy_(sg.device_grad.reshape(-1), non_blocking=True)
            sg.device_grad.record_stream(self.d2h)  # keep it alive if the caller frees it early
            event = torch.cuda.Event()
            event.record(self.d2h)
        self.events[i] = event

    def wait_d2h(self, i: int) -> None:
        event = self.events[i]
        if event is not None:
            event.synchronize()  # the CPU reads the host grad next

    def start_h2d(self, i: int) -> None:
        sg = self.subgroups[i]
        if sg.device_param is None:
            return
        with torch.cuda.stream(self.h2d):
            sg.device_param.view(-1).copy_(sg.param.view(-1), non_blocking=True)
            sg.device_param.record_stream(self.h2d)

    def finish(self) -> None:
        self.compute.wait_stream(self.h2d)  # later kernels see the new params
        self.h2d.synchronize()  # host params may be modified as soon as we return


def copies_for(subgroups: Sequence[SubGroup]) -> SyncCopies | CudaStreamCopies:
    """CUDA streams when any device endpoint is a CUDA tensor, inline copies otherwise."""
    for sg in subgroups:
        for t in (sg.device_grad, sg.device_param):
            if t is not None and t.device.type == "cuda":
                return CudaStreamCopies(subgroups, t.device)
    return SyncCopies(subgroups)


def run_subgroup_pipeline(
    subgroups: Sequence[SubGroup],
    update: Callable[[SubGroup], None],
    copies: SyncCopies | CudaStreamCopies | None = None,
) -> None:
    """Run ``update`` on every sub-group with d2h(i+1) / update(i) / h2d(i-1) overlap."""
    for i, sg in enumerate(subgroups):
        sg.check(i)
    if not subgroups:
        return
    copies = copies if copies is not None else copies_for(subgroups)
    copies.start_d2h(0)
    for i, sg in enumerate(subgroups):
        if i + 1 < len(subgroups):
            copies.start_d2h(i + 1)
        copies.wait_d2h(i)
        update(sg)
        copies.start_h2d(i)
    copies.finish()
