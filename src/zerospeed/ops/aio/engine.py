"""The I/O threads behind :class:`~zerospeed.ops.aio.AsyncIOHandle`, and the system calls.

``IOEngine`` owns a FIFO of ``(request, block)`` items and ``num_workers`` daemon threads that
take one item at a time and do its ``pread``/``pwrite`` (both release the GIL, so the threads
really run in parallel). The engine, not the handle, is what the threads reference, so a handle
that is dropped without ``close()`` is still garbage collected and its threads stopped.

The system calls are module functions (``sys_open``, ``sys_pwrite``, ``sys_pread``) so tests can
substitute them to simulate a file system that refuses O_DIRECT.
"""

from __future__ import annotations

import errno as _errno
import os
import queue
import threading
from typing import Any

import torch

from zerospeed.ops.aio.aligned import byte_view, new_aligned_tensor
from zerospeed.ops.aio.errors import AIOError
from zerospeed.ops.aio.request import BOUNCE, BUFFERED, DIRECT, AIORequest, Block

__all__ = ["IOEngine", "O_DIRECT", "sys_open", "sys_pread", "sys_pwrite"]

O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def sys_open(path: str, flags: int) -> int:
    return os.open(path, flags | _O_CLOEXEC, 0o644)


def sys_pwrite(fd: int, mv: memoryview, offset: int) -> int:
    return os.pwrite(fd, mv, offset)


def sys_pread(fd: int, mv: memoryview, offset: int) -> int:
    return os.preadv(fd, [mv], offset)


class DirectIOUnsupported(Exception):
    """A direct block got EINVAL: the file system does not take O_DIRECT after all."""


class IOEngine:
    """Worker threads, per-thread bounce buffers, counters and the O_DIRECT refusal record."""

    def __init__(self, num_workers: int, block_size: int, alignment: int) -> None:
        self.num_workers = num_workers
        self.block_size = block_size
        self.alignment = alignment
        self.lock = threading.Lock()
        #: st_dev -> (first path seen on it, reason) for file systems that refused O_DIRECT.
        self.no_direct: dict[int, tuple[str, str]] = {}
        #: the switch's name when O_DIRECT is forced (``direct_io: on``): a refusal is then an error
        self.require_direct: str | None = None
        self.stats = {"bytes_read": 0, "bytes_written": 0, DIRECT: 0, BOUNCE: 0, BUFFERED: 0}
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._pid = os.getpid()
        self._local = threading.local()

    def enqueue(self, request: AIORequest, block: Block) -> None:
        self._ensure_started()
        self._queue.put((request, block))

    def stop(self) -> None:
        """Stop the threads (after they finish the items already queued)."""
        with self.lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(None)
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=10)

    def _ensure_started(self) -> None:
        if self._pid != os.getpid():  # a forked child has none of the parent's threads
            self._threads, self._queue, self._pid = [], queue.SimpleQueue(), os.getpid()
        if self._threads:
            return
        with self.lock:
            if self._threads:
                return
            for i in range(self.num_workers):
                t = threading.Thread(target=self._worker, name=f"zerospeed-aio-{i}", daemon=True)
                t.start()
                self._threads.append(t)

    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            request, block = item
            moved, error = 0, None
            if not request.failed:  # after a failure the rest of the request is skipped
                try:
                    moved = self._run_block(request, block)
                except AIOError as exc:
                    error = exc
                except OSError as exc:
                    error = io_error(request, block, exc)
                except Exception as exc:  # noqa: BLE001 - a worker must never die silently
                    error = AIOError(request.op, request.path, None, detail=repr(exc),
                                     file_offset=request.file_offset, num_bytes=request.num_bytes)
            request.block_done(block, moved, error)

    def _run_block(self, request: AIORequest, block: Block) -> int:
        if block.mode != BUFFERED:
            try:
                moved = self._direct_block(request, block)
                self._count(request.op, block.mode, moved)
                return moved
            except DirectIOUnsupported as exc:
                if self.require_direct:
                    raise AIOError(request.op, request.path, _errno.EINVAL, file_offset=request.file_offset,
                                   num_bytes=request.num_bytes,
                                   detail=f"{self.require_direct} is 'on' but {exc}") from exc
                st_dev = os.fstat(request.fds["direct"]).st_dev
                with self.lock:
                    self.no_direct.setdefault(st_dev, (request.path, str(exc)))
                # and redo this block through the page cache
        mv = request.buffer[block.start : block.stop]
        moved = full_io(request, request.fds["buffered"], mv, block.file_offset)
        self._count(request.op, BUFFERED, moved)
        return moved

    def _direct_block(self, request: AIORequest, block: Block) -> int:
        fd = request.fds["direct"]
        n = block.num_bytes
        user = request.buffer[block.start : block.stop]
        try:
            if block.mode == DIRECT:
                return full_io(request, fd, user, block.file_offset)
            bounce = self._bounce(n)[:n]
            if request.op == "write":
                bounce[:] = user
                return full_io(request, fd, bounce, block.file_offset)
            moved = full_io(request, fd, bounce, block.file_offset)
            user[:] = bounce
            return moved
        except OSError as exc:
            if exc.errno == _errno.EINVAL:
                raise DirectIOUnsupported(f"O_DIRECT {request.op} failed: {exc.strerror}") from exc
            raise

    def _bounce(self, num_bytes: int) -> memoryview:
        mv = getattr(self._local, "bounce", None)
        if mv is None or len(mv) < num_bytes:
            tensor = new_aligned_tensor(max(num_bytes, self.block_size), torch.uint8,
                                        alignment=self.alignment)
            self._local.tensor = tensor
            mv = self._local.bounce = byte_view(tensor)
        return mv

    def _count(self, op: str, mode: str, num_bytes: int) -> None:
        with self.lock:
            self.stats["bytes_read" if op == "read" else "bytes_written"] += num_bytes
            self.stats[mode] += 1


def full_io(request: AIORequest, fd: int, mv: memoryview, file_offset: int) -> int:
    """pread/pwrite all of ``mv``, looping over short transfers; a short file is an error."""
    done, n = 0, len(mv)
    write = request.op == "write"
    while done < n:
        if write:
            k = sys_pwrite(fd, mv[done:], file_offset + done)
        else:
            k = sys_pread(fd, mv[done:], file_offset + done)
        if k <= 0:
            if not write:
                size = os.fstat(fd).st_size
                raise AIOError("read", request.path, None, file_offset=request.file_offset,
                               num_bytes=request.num_bytes,
                               detail=f"the file ends at {size} bytes, before the requested range "
                                      f"(truncated or replaced while in use?)")
            raise AIOError("write", request.path, _errno.EIO, file_offset=request.file_offset,
                           num_bytes=request.num_bytes, detail="pwrite wrote 0 bytes")
        done += k
    return done


def io_error(request: AIORequest, block: Block, exc: OSError) -> AIOError:
    err = AIOError(request.op, request.path, exc.errno, file_offset=request.file_offset,
                   num_bytes=request.num_bytes,
                   detail=f"in the block of {block.num_bytes} bytes at file offset {block.file_offset}")
    err.__cause__ = exc
    return err
