"""``AsyncIOHandle``: asynchronous reads and writes of tensors to files, DeepSpeed-``aio``-style.

What it is: a pool of I/O threads doing ``pread``/``pwrite`` (which release the GIL) on
block-sized pieces of each request, with O_DIRECT where the file system allows. A request is
submitted with :meth:`AsyncIOHandle.async_pwrite` / :meth:`async_pread` (returns at once) and
completed with :meth:`AsyncIOHandle.wait` (all outstanding requests) or ``request.wait()`` (one).
It is a public API of its own: DeepSpeed users drive ``aio_handle`` directly for fast checkpoint
I/O, and :func:`aio_handle` gives them the same constructor and method names.

Why threads and not io_uring/libaio: measured with ``bench/offload_ops_bench.py`` on this project's
machine (one shared virtio disk, ext4, kernel 6.18; 512 MiB requests, O_DIRECT, fresh files), this
engine, ``dd`` with direct I/O, DeepSpeed's libaio ``aio_handle`` and a raw io_uring loop over the
PyPI ``liburing`` binding (2026.3.30) all land at 0.8-1.2 GB/s, and which one is ahead changes
from run to run (+-30%): the device is the limit, not the submission path. ``liburing`` therefore
did not measurably help and is not a dependency (its ``prep_read``/``prep_write`` also refuse
memoryviews; zero-copy needs ``readv``/``writev`` over an ``Iovec``). Python overhead per block is
~20 us (measured with 16 KiB blocks on tmpfs) against ~1 ms of disk I/O per MiB. The engine needs
nothing outside the standard library and torch, and ``os.pread``/``os.pwrite`` release the GIL.

The ``aio`` config block, mapped onto a thread pool (DeepSpeed's meanings are for libaio):

* ``block_size`` - bytes per ``pread``/``pwrite`` (DeepSpeed: bytes per iocb).
* ``queue_depth`` x ``thread_count`` - I/O threads, i.e. blocks in flight at once (DeepSpeed:
  ``thread_count`` threads each keeping ``queue_depth`` iocbs in flight). ``intra_op_parallelism``
  is the other name of ``thread_count``.
* ``overlap_events`` - True: a new block is issued as soon as one completes (sliding window).
  False: a request is issued in waves of ``queue_depth x thread_count`` blocks and the next wave
  starts when the whole previous one completed (DeepSpeed's non-overlapped submit/reap).
* ``single_submit`` - libaio batches iocbs into one ``io_submit`` unless this is set; a thread pool
  issues every block with its own system call anyway, so the flag is recorded and has no effect.

O_DIRECT keeps offloaded tensors out of the page cache. Whether a handle uses it is the
``direct_io`` fast path (``auto``, ``off``, ``on``; :mod:`zerospeed.ops.aio.direct_choice`): ``auto``
(the default) probes each file system at its first file there and times one block each way,
keeping buffered I/O unless direct I/O is measurably faster; ``on`` always uses it (a file system
that refuses it is an error naming the switch - ``direct_io_source``, e.g. ``fast_paths.direct_io``
- and the folder); ``off``, or ``use_direct_io=False``, never does. Direct I/O is used per block
when the file offset, length and buffer address are aligned to ``alignment`` (4096); an unaligned
buffer goes through an aligned per-thread bounce buffer; unaligned heads/tails of a request (and
requests shorter than one unit) go through the page cache. Under ``auto``, a file system that
refuses O_DIRECT (EINVAL at the probe, at ``open`` or at the first direct ``pread``/``pwrite``;
e.g. tmpfs before Linux 6.6, some FUSE/network file systems) gets buffered I/O, and the reason is
recorded in :attr:`direct_io_fallbacks`. :meth:`stats` counts the blocks of each mode, so which path
ran is observable.

Errors: anything detectable at submission (CPU/contiguity of the tensor, a missing directory or
file, a parent that is not a directory, a read-only file system) raises :class:`AIOError` naming
the path right away; failures during I/O (full disk, file-size limit, a file truncated while
being read) are raised by ``wait()`` - only once every block has stopped touching the buffer.
Files are created when missing and never truncated: a write covers exactly its byte range.
"""

from __future__ import annotations

import errno as _errno
import os
import threading
import weakref
from typing import Any

import torch

from zerospeed.ops.aio import engine as _engine
from zerospeed.ops.aio.aligned import DEFAULT_ALIGNMENT, byte_view, new_aligned_tensor
from zerospeed.ops.aio.direct_choice import decide_direct_io
from zerospeed.ops.aio.errors import AIOError
from zerospeed.ops.aio.request import AIORequest, plan_blocks
from zerospeed.ops.fast_paths import FastPathError, resolve_setting

__all__ = ["AsyncIOHandle", "aio_handle"]

_MAX_WORKERS = 256


class AsyncIOHandle:
    """Asynchronous tensor <-> file I/O with submit/wait semantics (see the module docstring).

    Buffers must be contiguous CPU tensors (any dtype); pinned tensors from
    :meth:`new_aligned_tensor` are the fastest (O_DIRECT straight into them).
    """

    def __init__(
        self,
        block_size: int = 1 << 20,
        *,
        queue_depth: int = 8,
        thread_count: int = 1,
        single_submit: bool = False,
        overlap_events: bool = True,
        use_direct_io: bool = True,
        alignment: int = DEFAULT_ALIGNMENT,
        direct_io: str = "auto",
        direct_io_source: str | None = None,
    ) -> None:
        source = direct_io_source or "AsyncIOHandle(direct_io=...)"
        setting = resolve_setting("direct_io", direct_io, source)
        if not use_direct_io:
            if setting == "on":
                raise FastPathError(f"{source}: 'on' conflicts with use_direct_io=False; set one")
            setting = "off"
        if setting == "on" and _engine.O_DIRECT == 0:
            raise FastPathError(f"{source}: 'on' cannot run on this machine: this OS has no O_DIRECT")
        for name, value in (("block_size", block_size), ("queue_depth", queue_depth),
                            ("thread_count", thread_count), ("alignment", alignment)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"aio.{name} must be a positive integer, got {value!r}")
        if alignment & (alignment - 1):
            raise ValueError(f"aio alignment must be a power of two, got {alignment}")
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.thread_count = thread_count
        self.single_submit = bool(single_submit)
        self.overlap_events = bool(overlap_events)
        self.alignment = alignment
        #: the ``direct_io`` setting in force (after ``ZEROSPEED_FAST_PATHS``) and the name errors give it
        self.direct_io = setting
        self.direct_io_source = source
        self.use_direct_io = setting != "off" and _engine.O_DIRECT != 0
        self.num_workers = min(_MAX_WORKERS, queue_depth * thread_count)
        self._engine = _engine.IOEngine(self.num_workers, block_size, alignment)
        self._engine.require_direct = source if setting == "on" else None
        self._direct_ok: dict[int, bool] = {}  # st_dev -> use O_DIRECT there (decided at the first file)
        self._lock = threading.Lock()
        self._pending: list[AIORequest] = []
        self._closed = False
        # Stops the threads when the handle is garbage collected without close().
        self._finalizer = weakref.finalize(self, self._engine.stop)

    @classmethod
    def from_config(cls, aio_config: Any, **overrides: Any) -> AsyncIOHandle:
        """Build from a :class:`zerospeed.config.AioConfig` (the ``aio`` block).

        ``use_gds`` must be off (GPUDirect Storage is not supported; the config layer already
        refuses it). ``overrides`` (e.g. ``direct_io="off"``, ``direct_io_source="fast_paths.direct_io"``)
        win over the config.
        """
        if getattr(aio_config, "use_gds", False):
            raise ValueError("aio.use_gds: GPUDirect Storage is not supported by zerospeed")
        kwargs = dict(
            block_size=aio_config.block_size,
            queue_depth=aio_config.queue_depth,
            thread_count=aio_config.thread_count,
            single_submit=aio_config.single_submit,
            overlap_events=aio_config.overlap_events,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    # ------------------------------------------------------------------ submission

    def async_pwrite(self, buffer: torch.Tensor, filename: str | os.PathLike[str],
                     file_offset: int = 0) -> AIORequest:
        """Start writing ``buffer``'s bytes to ``filename`` at ``file_offset``; return at once."""
        return self._submit("write", buffer, filename, file_offset)

    def async_pread(self, buffer: torch.Tensor, filename: str | os.PathLike[str],
                    file_offset: int = 0) -> AIORequest:
        """Start reading ``buffer.nbytes`` bytes of ``filename`` at ``file_offset`` into it."""
        return self._submit("read", buffer, filename, file_offset)

    def sync_pwrite(self, buffer: torch.Tensor, filename: str | os.PathLike[str],
                    file_offset: int = 0) -> int:
        """Write and wait for this request only; return the number of bytes written."""
        return self._submit("write", buffer, filename, file_offset, track=False).wait()

    def sync_pread(self, buffer: torch.Tensor, filename: str | os.PathLike[str],
                   file_offset: int = 0) -> int:
        """Read and wait for this request only; return the number of bytes read."""
        return self._submit("read", buffer, filename, file_offset, track=False).wait()

    def wait(self) -> int:
        """Wait for every request submitted by ``async_*`` since the last ``wait()`` (also those
        already waited for one by one); return how many there were. ``sync_*`` calls are not
        counted: they waited for themselves.

        If any failed, raise the first failure's :class:`AIOError` (the others are attached as
        notes) after all of them have finished, so no buffer is still being read or written.
        """
        with self._lock:
            pending, self._pending = self._pending, []
        errors = [e for e in (r.exception() for r in pending) if e is not None]
        if errors:
            first = errors[0]
            for other in errors[1:]:
                first.add_note(f"also failed: {other}")
            raise first
        return len(pending)

    def _submit(self, op: str, buffer: torch.Tensor, filename: str | os.PathLike[str],
                file_offset: int, track: bool = True) -> AIORequest:
        path = os.fspath(filename)
        if self._closed:
            raise RuntimeError("this AsyncIOHandle is closed")
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"aio {op} needs a torch.Tensor buffer, got {type(buffer).__name__}")
        if not isinstance(file_offset, int) or file_offset < 0:
            raise ValueError(f"aio {op} on '{path}': file_offset must be an int >= 0, got {file_offset!r}")
        mv = byte_view(buffer)
        fds = self._open_files(op, path, file_offset, len(mv))
        direct = "direct" in fds
        blocks = plan_blocks(len(mv), file_offset, buffer.data_ptr(), self.block_size,
                             self.alignment, direct)
        wave = len(blocks) if self.overlap_events else self.num_workers
        request = AIORequest(op, path, mv, file_offset, blocks, fds, wave, self._engine.enqueue,
                             buffer)
        if track:  # counted by wait(); sync calls wait for their own request
            with self._lock:
                self._pending.append(request)
        request.start()
        return request

    def _open_files(self, op: str, path: str, file_offset: int, num_bytes: int) -> dict[str, int]:
        flags = os.O_RDONLY if op == "read" else (os.O_WRONLY | os.O_CREAT)
        direct, st_dev = False, None
        if self.use_direct_io and num_bytes >= self.alignment:
            folder = os.path.dirname(os.path.abspath(path))
            try:
                st_dev = os.stat(folder).st_dev
            except OSError:  # a missing folder: the open below names it
                pass
            if st_dev is not None:  # decided before the file is created (a forced 'on' may refuse)
                direct = self._direct_on(st_dev, folder, path)
        try:
            fd = _engine.sys_open(path, flags)
        except OSError as exc:
            detail = _open_detail(op, path, exc.errno)
            raise AIOError("open for " + op, path, exc.errno, detail=detail,
                           file_offset=file_offset, num_bytes=num_bytes) from exc
        fds = {"buffered": fd}
        if not direct or st_dev in self._engine.no_direct:
            return fds
        try:
            fds["direct"] = _engine.sys_open(path, flags | _engine.O_DIRECT)
        except OSError as exc:
            if exc.errno != _errno.EINVAL or self.direct_io == "on":
                os.close(fd)
                detail = f"{self.direct_io_source} is 'on'" if exc.errno == _errno.EINVAL else ""
                raise AIOError("open (O_DIRECT) for " + op, path, exc.errno, detail=detail,
                               file_offset=file_offset, num_bytes=num_bytes) from exc
            with self._engine.lock:
                self._engine.no_direct.setdefault(st_dev, (path, f"open(O_DIRECT) failed: {exc.strerror}"))
        return fds

    def _direct_on(self, st_dev: int, folder: str, path: str) -> bool:
        """Whether files on ``st_dev`` get O_DIRECT: decided at the first one (probe, then the
        setting or a measurement; see :mod:`~zerospeed.ops.aio.direct_choice`)."""
        with self._lock:
            known = self._direct_ok.get(st_dev)
        if known is not None:
            return known
        use, refused = decide_direct_io(self.direct_io, folder, st_dev, self.block_size, self.alignment,
                                        self.direct_io_source)
        with self._lock:
            self._direct_ok.setdefault(st_dev, use)
        if refused:
            with self._engine.lock:
                self._engine.no_direct.setdefault(st_dev, (path, refused))
        return use

    def prepare(self, folder: str | os.PathLike[str]) -> bool:
        """Decide now whether files in ``folder`` get O_DIRECT (else at the first request there), so
        a forced ``direct_io: on`` that the file system refuses fails here, naming the switch and the
        folder. Returns the decision."""
        folder = os.path.abspath(os.fspath(folder))
        if not self.use_direct_io:
            return False
        return self._direct_on(os.stat(folder).st_dev, folder, folder)

    # ------------------------------------------------------------------ facts, buffers, lifecycle

    def direct_io_choices(self) -> dict[str, bool]:
        """``{"major:minor": uses O_DIRECT}`` for each file system this handle has decided on."""
        with self._lock:
            return {f"{os.major(d)}:{os.minor(d)}": use for d, use in self._direct_ok.items()}

    @property
    def direct_io_fallbacks(self) -> dict[str, str]:
        """``{path: reason}``: one path per file system that refused O_DIRECT, and why."""
        with self._engine.lock:
            return {path: reason for path, reason in self._engine.no_direct.values()}

    def stats(self) -> dict[str, int]:
        """Bytes read/written and blocks done per mode (``direct``, ``bounce``, ``buffered``)."""
        with self._engine.lock:
            return dict(self._engine.stats)

    def new_aligned_tensor(self, numel: int, dtype: torch.dtype = torch.float32, *,
                           pin_memory: bool = True) -> torch.Tensor:
        """A ``numel``-element CPU tensor aligned for O_DIRECT (pinned when CUDA is present)."""
        return new_aligned_tensor(numel, dtype, alignment=self.alignment, pin_memory=pin_memory)

    def close(self) -> None:
        """Wait for outstanding requests (errors are not raised here) and stop the threads."""
        if self._closed:
            return
        with self._lock:
            pending = list(self._pending)
        for r in pending:
            r.exception()
        self._closed = True
        self._finalizer()

    def __enter__(self) -> AsyncIOHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ DeepSpeed aio_handle names

    def get_block_size(self) -> int:
        return self.block_size

    def get_queue_depth(self) -> int:
        return self.queue_depth

    def get_single_submit(self) -> bool:
        return self.single_submit

    def get_overlap_events(self) -> bool:
        return self.overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self.thread_count

    def get_thread_count(self) -> int:
        return self.thread_count

    def get_alignment(self) -> int:
        return self.alignment

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's name: an aligned (pinned when CUDA is present) tensor of ``example_tensor``'s dtype."""
        return self.new_aligned_tensor(num_elem, example_tensor.dtype)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> None:
        """DeepSpeed's name; memory is freed when the tensor is garbage collected."""

    def pread(self, buffer: torch.Tensor, filename: str | os.PathLike[str], validate: bool = False,
              async_op: bool = False, file_offset: int = 0) -> AIORequest | int:
        """DeepSpeed's ``pread``: async returns the request, sync returns bytes read."""
        if async_op:
            return self.async_pread(buffer, filename, file_offset)
        moved = self.sync_pread(buffer, filename, file_offset)
        if validate:
            _validate(buffer, os.fspath(filename), file_offset)
        return moved

    def pwrite(self, buffer: torch.Tensor, filename: str | os.PathLike[str], validate: bool = False,
               async_op: bool = False, file_offset: int = 0) -> AIORequest | int:
        """DeepSpeed's ``pwrite``: async returns the request, sync returns bytes written."""
        if async_op:
            return self.async_pwrite(buffer, filename, file_offset)
        moved = self.sync_pwrite(buffer, filename, file_offset)
        if validate:
            _validate(buffer, os.fspath(filename), file_offset)
        return moved

    def read(self, buffer: torch.Tensor, filename: str | os.PathLike[str], validate: bool = False,
             file_offset: int = 0) -> int:
        return int(self.pread(buffer, filename, validate, False, file_offset))

    def write(self, buffer: torch.Tensor, filename: str | os.PathLike[str], validate: bool = False,
              file_offset: int = 0) -> int:
        return int(self.pwrite(buffer, filename, validate, False, file_offset))

    def __repr__(self) -> str:
        return (f"AsyncIOHandle(block_size={self.block_size}, queue_depth={self.queue_depth}, "
                f"thread_count={self.thread_count}, single_submit={self.single_submit}, "
                f"overlap_events={self.overlap_events}, direct_io={self.direct_io!r})")


def aio_handle(block_size: int = 1 << 20, queue_depth: int = 128, single_submit: bool = False,
               overlap_events: bool = False, intra_op_parallelism: int = 1) -> AsyncIOHandle:
    """DeepSpeed's ``AsyncIOBuilder().load().aio_handle(...)`` signature and defaults.

    ``queue_depth`` is capped with ``thread_count`` at 256 I/O threads in total.
    """
    return AsyncIOHandle(block_size, queue_depth=queue_depth, thread_count=intra_op_parallelism,
                         single_submit=single_submit, overlap_events=overlap_events)


# ---------------------------------------------------------------------- helpers


def _open_detail(op: str, path: str, err: int | None) -> str:
    parent = os.path.dirname(os.path.abspath(path)) or "/"
    if err == _errno.ENOENT:
        if op == "read" and os.path.isdir(parent):
            return "the file does not exist (never written, or deleted while in use?)"
        return f"directory '{parent}' does not exist"
    if err == _errno.ENOTDIR:
        return "a parent of the file is not a directory"
    if err in (_errno.EROFS, _errno.EACCES, _errno.EPERM):
        return f"cannot {'read' if op == 'read' else 'write'} in '{parent}'"
    return ""


def _validate(buffer: torch.Tensor, path: str, file_offset: int) -> None:
    expected = bytes(byte_view(buffer))
    with open(path, "rb") as f:
        f.seek(file_offset)
        got = f.read(len(expected))
    if got != expected:
        raise AIOError("validate", path, None, file_offset=file_offset, num_bytes=len(expected),
                       detail="file contents differ from the buffer")
