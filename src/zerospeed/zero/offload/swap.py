"""NVMe swap files for offloaded optimizer states (ZeRO-Infinity's optimizer swapping).

One folder per rank and process, ``<nvme_path>/zerospeed_swap/optimizer_rank<r>_<pid>_<random>/``,
holding one file per state (``exp_avg.swp``, ``exp_avg_sq.swp``, and ``max_exp_avg_sq.swp`` with
amsgrad). Sub-group ``i`` (one offloaded bucket shard of ``numel_i`` fp32 elements) occupies
elements ``[offset_i, offset_i + aligned_i)`` of every file, where regions are rounded up to
4096 bytes so each read and write is O_DIRECT-aligned.

I/O is done per *swap group*: consecutive sub-groups whose regions add up to at most
``sub_group_size`` elements (DeepSpeed's tile size; a larger sub-group is a group of its own), so
a model of many small buckets (stage 3: one per module) costs one read and one write per state
and group, not per bucket. Memory is bounded by ``min(buffer_count, groups)`` swap buffers, each
holding one group's states (``x states x 4`` bytes, allocated once, 4096-aligned, pinned when a
GPU is present). :meth:`NvmeStateSwapper.run` drives them as a ring: group ``g`` uses buffer
``g % buffers``; reads are issued ``lookahead`` groups ahead of the update and a buffer is re-read
only after its previous write-back finished.

Failure handling: the folder and files come from :mod:`zerospeed.zero.offload.swapfiles`
(reserved up front, so a full disk fails at start naming the path; checked against their inode
before every pass, so a deleted file is reported by path; removed on close, at exit and when a
multiprocessing child ends). I/O errors are :class:`~zerospeed.ops.aio.AIOError` naming the
path, raised after every request in flight has finished (no buffer is left half-read).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from zerospeed.ops.aio import AIOError, AsyncIOHandle
from zerospeed.zero.offload.swapfiles import SwapFile, SwapFolder

#: the switch that decides O_DIRECT for the swap files (named in its errors)
DIRECT_IO_KEY = "fast_paths.direct_io"
#: every sub-group region starts on a 4096-byte boundary of the file (O_DIRECT alignment)
ALIGN_BYTES = 4096
_FP32 = 4
_ALIGN_NUMEL = ALIGN_BYTES // _FP32


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_groups(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Consecutive indices whose ``sizes`` add up to at most ``limit`` (a larger one alone)."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(sizes):
        if current and used + n > limit:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        groups.append(current)
    return groups


class NvmeStateSwapper:
    """Element-wise optimizer states of ``len(numels)`` sub-groups, kept in swap files.

    ``keys``: the state names swapped (``exp_avg``, ``exp_avg_sq``...); ``numels``: each
    sub-group's element count (fp32). Not thread-safe; one per optimizer.
    """

    def __init__(self, nvme_path: str, keys: Sequence[str], numels: Sequence[int], aio_config: Any,
                 buffer_count: int, rank: int, pin_memory: bool = False, group_numel: int = 1_000_000_000,
                 direct_io: str = "auto") -> None:
        if buffer_count < 1:
            raise ValueError("zero_optimization.offload_optimizer.buffer_count must be >= 1 for NVMe offload "
                             f"(one swap buffer per sub-group in flight), got {buffer_count}")
        self.keys = list(keys)
        self.numels = [int(n) for n in numels]
        self.aligned = [_round_up(max(n, 1), _ALIGN_NUMEL) for n in self.numels]
        self.offsets = [0] * len(self.numels)
        total = 0
        for i, n in enumerate(self.aligned):
            self.offsets[i] = total
            total += n
        self.file_numel = total
        self.handle = AsyncIOHandle.from_config(aio_config, direct_io=direct_io, direct_io_source=DIRECT_IO_KEY)
        self._folder = SwapFolder(nvme_path, "optimizer", rank, "zero_optimization.offload_optimizer.nvme_path",
                                  on_close=self.handle.close)
        self.folder = self._folder.path
        self.files: dict[str, SwapFile] = {}
        try:
            self.handle.prepare(self.folder)  # direct_io decided (or refused, when forced) before any file
            for key in self.keys:
                self.files[key] = self._folder.create_file(f"{key}.swp", self.file_numel * _FP32,
                                                           f"optimizer state {key!r}")
        except BaseException:
            self.close()
            raise
        self.paths = {k: f.path for k, f in self.files.items()}
        self.groups = plan_groups(self.aligned, group_numel)
        self.spans = [sum(self.aligned[i] for i in g) for g in self.groups]
        max_numel = max(self.spans, default=_ALIGN_NUMEL)
        self.buffer_count = max(1, min(buffer_count, len(self.groups)))
        self.buffers = [{k: self.handle.new_aligned_tensor(max_numel, torch.float32, pin_memory=pin_memory)
                         for k in self.keys} for _ in range(self.buffer_count)]
        self._writes: dict[int, list[Any]] = {}

    # -- facts ------------------------------------------------------------------------------------
    @property
    def buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self.buffers for t in b.values())

    @property
    def disk_bytes(self) -> int:
        return self.file_numel * _FP32 * len(self.paths)

    def check_files(self) -> None:
        """Raise AIOError naming a swap file that no longer is the one created at start."""
        for f in self.files.values():
            f.check()

    # -- one pass over every sub-group ------------------------------------------------------------
    def _io(self, op: str, g: int, buf: dict[str, torch.Tensor]) -> list[Any]:
        submit = self.handle.async_pread if op == "read" else self.handle.async_pwrite
        offset = self.offsets[self.groups[g][0]] * _FP32
        return [submit(buf[k].narrow(0, 0, self.spans[g]), self.paths[k], offset) for k in self.keys]

    def lookahead(self) -> int:
        """How many groups ahead reads are issued: a ring slot is re-read only after the
        write-back of its previous group, issued one update earlier, had that update to finish."""
        return {1: 0, 2: 1}.get(self.buffer_count, self.buffer_count - 2)

    def run(self, update: Callable[[int, dict[int, dict[str, torch.Tensor]]], None]) -> None:
        """For each group ``g``: read its states, ``update(g, {sub-group: {state: view}})``, write back."""
        self.check_files()
        ahead = self.lookahead()
        count = self.buffer_count
        reads: dict[int, list[Any]] = {}

        def issue_read(g: int) -> None:
            if g >= len(self.groups) or g in reads:
                return
            for w in self._writes.pop(g - count, []):  # the slot's previous occupant must be on disk
                w.wait()
            reads[g] = self._io("read", g, self.buffers[g % count])

        failed = True
        try:
            for g in range(min(ahead, len(self.groups))):
                issue_read(g)
            for g, members in enumerate(self.groups):
                issue_read(g + ahead)
                issue_read(g)
                for r in reads.pop(g):
                    r.wait()
                buf = self.buffers[g % count]
                base = self.offsets[members[0]]
                update(g, {i: {k: t.narrow(0, self.offsets[i] - base, self.numels[i]) for k, t in buf.items()}
                           for i in members})
                self._writes[g] = self._io("write", g, buf)
            failed = False
        finally:
            self._drain(raise_errors=not failed)

    def _drain(self, raise_errors: bool) -> None:
        self._writes.clear()
        try:
            self.handle.wait()  # every request of this pass, also those waited for one by one
        except AIOError:
            if raise_errors:
                raise

    # -- whole sub-groups, for checkpoints --------------------------------------------------------
    def read(self, i: int) -> dict[str, torch.Tensor]:
        """Fresh CPU tensors with sub-group ``i``'s states."""
        out = {}
        for k in self.keys:
            buf = self.handle.new_aligned_tensor(self.aligned[i], torch.float32, pin_memory=False)
            self.handle.sync_pread(buf, self.paths[k], self.offsets[i] * _FP32)
            out[k] = buf.narrow(0, 0, self.numels[i]).clone()
        return out

    def write(self, i: int, states: dict[str, torch.Tensor | None]) -> None:
        """Replace sub-group ``i``'s states (a missing or ``None`` state is written as zeros)."""
        self.check_files()
        buf = self.buffers[0]  # at least as long as any sub-group's region
        for k in self.keys:
            dst = buf[k].narrow(0, 0, self.aligned[i])
            dst.zero_()
            src = states.get(k)
            if src is not None:
                if src.numel() != self.numels[i]:
                    raise ValueError(f"optimizer state {k!r} of sub-group {i} has {src.numel()} elements, "
                                     f"expected {self.numels[i]}")
                dst.narrow(0, 0, self.numels[i]).copy_(src.reshape(-1))
            self.handle.sync_pwrite(dst, self.paths[k], self.offsets[i] * _FP32)

    def write_key(self, i: int, key: str, values: torch.Tensor) -> None:
        """Replace one state of sub-group ``i`` (e.g. its master after a ``GatheredParameters`` edit)."""
        self.check_files()
        if values.numel() != self.numels[i]:
            raise ValueError(f"{key!r} of sub-group {i} has {values.numel()} elements, expected {self.numels[i]}")
        dst = self.buffers[0][key].narrow(0, 0, self.aligned[i])
        if self.aligned[i] > self.numels[i]:  # the tail of the aligned region is written too: keep it as on disk
            self.handle.sync_pread(dst, self.paths[key], self.offsets[i] * _FP32)
        dst.narrow(0, 0, self.numels[i]).copy_(values.reshape(-1))
        self.handle.sync_pwrite(dst, self.paths[key], self.offsets[i] * _FP32)

    def close(self) -> None:
        """Stop the I/O threads and delete the swap folder (idempotent)."""
        self._folder.close()
