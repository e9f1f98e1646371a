"""NVMe swap files for offloaded optimizer states (ZeRO-Infinity's optimizer swapping).

One folder per rank and process, ``<nvme_path>/zerospeed_swap/optimizer_rank<r>_<pid>_<random>/``,
holding one file per state (``exp_avg.swp``, ``exp_avg_sq.swp``, and ``max_exp_avg_sq.swp`` with
amsgrad). Sub-group ``i`` (one offloaded bucket shard of ``numel_i`` fp32 elements) occupies
elements ``[offset_i, offset_i + aligned_i)`` of every file, where regions are rounded up to
4096 bytes so each read and write is O_DIRECT-aligned.

Memory is bounded by ``buffer_count`` swap buffers, each holding one sub-group's states
(``buffer_count x max sub-group numel x states x 4`` bytes, all allocated once, 4096-aligned and
pinned when a GPU is present). :meth:`NvmeStateSwapper.run` drives them as a ring: sub-group
``i`` uses buffer ``i % buffer_count``; reads are issued ``lookahead`` sub-groups ahead of the
update and a buffer is re-read only after its previous write-back finished.

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

#: every sub-group region starts on a 4096-byte boundary of the file (O_DIRECT alignment)
ALIGN_BYTES = 4096
_FP32 = 4
_ALIGN_NUMEL = ALIGN_BYTES // _FP32


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class NvmeStateSwapper:
    """Element-wise optimizer states of ``len(numels)`` sub-groups, kept in swap files.

    ``keys``: the state names swapped (``exp_avg``, ``exp_avg_sq``...); ``numels``: each
    sub-group's element count (fp32). Not thread-safe; one per optimizer.
    """

    def __init__(self, nvme_path: str, keys: Sequence[str], numels: Sequence[int], aio_config: Any,
                 buffer_count: int, rank: int, pin_memory: bool = False) -> None:
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
        self.handle = AsyncIOHandle.from_config(aio_config)
        self._folder = SwapFolder(nvme_path, "optimizer", rank, "zero_optimization.offload_optimizer.nvme_path",
                                  on_close=self.handle.close)
        self.folder = self._folder.path
        self.files: dict[str, SwapFile] = {}
        try:
            for key in self.keys:
                self.files[key] = self._folder.create_file(f"{key}.swp", self.file_numel * _FP32,
                                                           f"optimizer state {key!r}")
        except BaseException:
            self.close()
            raise
        self.paths = {k: f.path for k, f in self.files.items()}
        max_numel = max(self.aligned, default=_ALIGN_NUMEL)
        self.buffer_count = buffer_count
        self.buffers = [{k: self.handle.new_aligned_tensor(max_numel, torch.float32, pin_memory=pin_memory)
                         for k in self.keys} for _ in range(buffer_count)]
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
    def views(self, i: int) -> dict[str, torch.Tensor]:
        """Sub-group ``i``'s states in its ring buffer (valid while it is being processed)."""
        buf = self.buffers[i % self.buffer_count]
        return {k: t.narrow(0, 0, self.numels[i]) for k, t in buf.items()}

    def _io(self, op: str, i: int, buf: dict[str, torch.Tensor]) -> list[Any]:
        submit = self.handle.async_pread if op == "read" else self.handle.async_pwrite
        offset = self.offsets[i] * _FP32
        return [submit(buf[k].narrow(0, 0, self.aligned[i]), self.paths[k], offset) for k in self.keys]

    def lookahead(self) -> int:
        """How many sub-groups ahead reads are issued: a ring slot is re-read only after the
        write-back of its previous sub-group, issued one update earlier, had that update to finish."""
        return {1: 0, 2: 1}.get(self.buffer_count, self.buffer_count - 2)

    def run(self, order: Sequence[int], update: Callable[[int, dict[str, torch.Tensor]], None]) -> None:
        """For each sub-group in ``order``: read its states, ``update(i, states)``, write them back."""
        self.check_files()
        ahead = self.lookahead()
        reads: dict[int, list[Any]] = {}
        slots: list[int] = list(order)

        def issue_read(pos: int) -> None:
            if pos >= len(slots) or pos in reads:
                return
            prev = pos - self.buffer_count
            for w in self._writes.pop(prev, []):  # the slot's previous occupant must be on disk
                w.wait()
            reads[pos] = self._io("read", slots[pos], self.buffers[pos % self.buffer_count])

        failed = True
        try:
            for pos in range(min(ahead, len(slots))):
                issue_read(pos)
            for pos, i in enumerate(slots):
                issue_read(pos + ahead)
                issue_read(pos)
                for r in reads.pop(pos):
                    r.wait()
                buf = self.buffers[pos % self.buffer_count]
                update(i, {k: t.narrow(0, 0, self.numels[i]) for k, t in buf.items()})
                self._writes[pos] = self._io("write", i, buf)
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
        buf = self.buffers[0]
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

    def close(self) -> None:
        """Stop the I/O threads and delete the swap folder (idempotent)."""
        self._folder.close()
