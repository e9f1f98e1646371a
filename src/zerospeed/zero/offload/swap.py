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

Failure handling:

* the files are preallocated with ``posix_fallocate``, so a disk too small fails at start with
  the path and the bytes needed (not with ENOSPC in the middle of a step);
* before each swap pass every file is checked against the inode it was created with, so a file
  deleted or replaced mid-run is reported by path (a write would otherwise re-create it silently
  and later reads would return zeros);
* I/O errors are :class:`~zerospeed.ops.aio.AIOError` naming the path, raised after every request
  in flight has finished (no buffer is left half-read);
* the folder is removed by :meth:`close`, and by a ``weakref.finalize`` that also runs at
  interpreter exit, so swap files do not outlive the process (a SIGKILL still leaves them; they
  are in a folder named after the pid).
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from zerospeed.ops.aio import AIOError, AsyncIOHandle

#: every sub-group region starts on a 4096-byte boundary of the file (O_DIRECT alignment)
ALIGN_BYTES = 4096
_FP32 = 4
_ALIGN_NUMEL = ALIGN_BYTES // _FP32


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    parent = os.path.dirname(path)
    try:
        os.rmdir(parent)  # the shared zerospeed_swap folder, when this was its last user
    except OSError:
        pass


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
        root = os.path.join(os.fspath(nvme_path), "zerospeed_swap")
        self.folder = os.path.join(root, f"optimizer_rank{rank}_{os.getpid()}_{secrets.token_hex(4)}")
        try:
            os.makedirs(self.folder)
        except OSError as exc:
            raise AIOError("mkdir", self.folder, exc.errno, detail="cannot create the swap folder") from exc
        self._finalizer = weakref.finalize(self, _remove_tree, self.folder)
        self.paths = {k: os.path.join(self.folder, f"{k}.swp") for k in self.keys}
        self._inodes: dict[str, int] = {}
        try:
            self._preallocate()
            self.handle = AsyncIOHandle.from_config(aio_config)
        except BaseException:
            self.close()
            raise
        max_numel = max(self.aligned, default=_ALIGN_NUMEL)
        self.buffer_count = buffer_count
        self.buffers = [{k: self.handle.new_aligned_tensor(max_numel, torch.float32, pin_memory=pin_memory)
                         for k in self.keys} for _ in range(buffer_count)]
        self._writes: dict[int, list[Any]] = {}

    # -- set-up -----------------------------------------------------------------------------------
    def _preallocate(self) -> None:
        nbytes = self.file_numel * _FP32
        for key, path in self.paths.items():
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
            try:
                if nbytes:
                    try:
                        os.posix_fallocate(fd, 0, nbytes)
                    except OSError as exc:
                        free = shutil.disk_usage(self.folder).free
                        need = nbytes * len(self.paths)
                        detail = (f"cannot reserve {nbytes} bytes for optimizer state {key!r} "
                                  f"({need} bytes in all for {len(self.paths)} files; {free} bytes free)")
                        raise AIOError("fallocate", path, exc.errno, detail=detail, num_bytes=nbytes) from exc
                self._inodes[path] = os.fstat(fd).st_ino
            finally:
                os.close(fd)

    # -- facts ------------------------------------------------------------------------------------
    @property
    def buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self.buffers for t in b.values())

    @property
    def disk_bytes(self) -> int:
        return self.file_numel * _FP32 * len(self.paths)

    def check_files(self) -> None:
        """Raise AIOError naming a swap file that no longer is the one created at start."""
        for path, inode in self._inodes.items():
            try:
                st = os.stat(path)
            except OSError as exc:
                raise AIOError("check", path, exc.errno,
                               detail="the optimizer-state swap file disappeared during training; the offloaded "
                                      "optimizer states are lost: restart from the last checkpoint") from exc
            if st.st_ino != inode or st.st_size < self.file_numel * _FP32:
                raise AIOError("check", path, errno.ESTALE,
                               detail="the optimizer-state swap file was replaced or truncated during training; "
                                      "the offloaded optimizer states are lost: restart from the last checkpoint")

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
        handle = getattr(self, "handle", None)
        if handle is not None:
            handle.close()
        self._finalizer()
