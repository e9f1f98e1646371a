"""Measuring activation memory on any device, for tests and bench/activation_bench.py.

* :class:`SavedTensorBytes`: a ``saved_tensors_hooks`` context that adds up the bytes of the
  distinct storages autograd saves for the backward while it is active (the graph's activation
  memory after a forward), split by device type. Torch's non-reentrant checkpoint keeps its
  inputs by reference rather than as saved tensors, so :func:`~zerospeed.checkpointing.checkpoint`
  reports them to the active counters (:func:`note_kept`); what a *selective* policy caches is
  invisible to it: measure those with :func:`peak_allocated_bytes`.
* :func:`peak_allocated_bytes`: the peak of bytes allocated above the starting point while a
  function runs: ``torch.cuda.max_memory_allocated`` on CUDA, and on CPU the running sum of the
  allocation / free events torch's profiler records (``profile_memory=True``), in the order they
  happened, which covers every mode, torch's non-reentrant and selective checkpoints included.
  (Each op's *net* bytes, placed at the op's start, would miss every temporary an op frees
  before it returns: ``cross_entropy`` frees its 16 MB ``log_softmax`` inside, and would count 4 bytes.)
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch


_ACTIVE: list["SavedTensorBytes"] = []


def note_kept(tensors: list[torch.Tensor]) -> None:
    """Count tensors a checkpoint keeps by reference in every active :class:`SavedTensorBytes`."""
    for counter in _ACTIVE:
        for t in tensors:
            counter._pack(t)


class SavedTensorBytes(torch.autograd.graph.saved_tensors_hooks):
    """``ignore``: tensors whose storages are not activations (pass ``model.parameters()``: a
    matmul saves its weight, which is model state, not activation memory)."""

    def __init__(self, ignore: Any = ()) -> None:
        self.by_device: dict[str, int] = defaultdict(int)
        self._seen: set[tuple[str, int]] = {(t.device.type, t.untyped_storage().data_ptr()) for t in ignore}
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> "SavedTensorBytes":
        super().__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        super().__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = (tensor.device.type, storage.data_ptr())
        if key not in self._seen:
            self._seen.add(key)
            self.by_device[tensor.device.type] += storage.nbytes()
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @property
    def total(self) -> int:
        return sum(self.by_device.values())


def peak_allocated_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> int:
    """Peak bytes allocated while ``fn()`` runs, above what was allocated when it started."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - start)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    results = getattr(prof.profiler, "kineto_results", None)
    if results is None:
        raise RuntimeError("peak_allocated_bytes: this torch build's profiler recorded no allocation events "
                           "(profile_memory=True gave no kineto results)")
    allocations = [e for e in results.events()
                   if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    live = peak = 0
    for event in sorted(allocations, key=lambda e: e.start_ns()):  # stable: equal stamps keep record order
        live += event.nbytes()
        peak = max(peak, live)
    return int(peak)
