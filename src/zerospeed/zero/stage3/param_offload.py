"""ZeRO-Infinity parameter offload (``zero_optimization.offload_param``): where stage-3 shards live
between uses.

A :class:`ParamSwapper` owns the residency of the parameter shards (``bucket.shard``) of the
non-persistent buckets of one :class:`~zerospeed.zero.stage3.strategy.Stage3Strategy`. A shard is
needed only (a) while its bucket's all-gather reads it, (b) while something writes into it (the
optimizer step, ``write_back_shard`` after a ``GatheredParameters`` edit, a checkpoint load) and
(c) while a checkpoint save reads it. In between it can live elsewhere:

* ``device: "nvme"`` - every managed shard has a 4096-byte aligned region in one per-rank swap file
  ``<nvme_path>/zerospeed_swap/param_rank<r>_<pid>_<random>/params.swp``, written and read through
  :class:`~zerospeed.ops.aio.AsyncIOHandle` (the ``aio`` block; O_DIRECT or not by the
  ``fast_paths.direct_io`` switch, decided for the swap folder at start-up). The file is preallocated with
  ``posix_fallocate`` so a full disk fails at start-up, naming the path and the bytes needed.
* ``device: "cpu"`` - the shard lives in host memory (pinned when ``pin_memory`` and CUDA are
  available). When the model runs on an accelerator, the host copy is the backing store and the
  device-side ``bucket.shard`` is the staging tensor the all-gather reads (allocated before the
  gather, freed after). When the model runs on the CPU the shard already is in host memory: the
  swapper manages nothing and every call is a no-op.

The shard tensor object never changes: swapping out frees its storage in place
(``shard.untyped_storage().resize_(0)``) and swapping in resizes the same storage back and reads
into it. So every alias of the tensor keeps working: the optimizer's fp32 master in fp32 training
(the same object), its ``optimizer.state`` key, and any view made of it.

NVMe I/O goes through a small pool of 4096-aligned host *swap buffers* (``max(1, buffer_count)``
of them, each the largest managed shard rounded up to 4096 bytes, allocated on first use), never
straight from the shard: the aio engine hands a buffer to ``pread``/``pwrite`` through numpy, which
makes its storage non-resizable, and the shard's storage must stay resizable. Whole aligned regions
move, so O_DIRECT applies to every byte. A read-ahead holds a swap buffer until it is waited for;
when all are taken, the oldest pending read is completed (copied into its shard) to free one.

Invariants, for a managed bucket ``b`` with entry ``e``:

* ``e.resident`` <=> ``b.shard``'s storage has its full size (its values are valid once ``e.read``
  is None, i.e. the read was waited for);
* not resident => the backing store (file region or host tensor) holds the authoritative values;
  resident and ``e.dirty`` => the shard is newer than the backing store (written back on eviction);
* ``e.users > 0`` => resident and never evicted; users are the bucket's in-flight all-gather, a
  ``write_back_shard``, the optimizer step and checkpoint holds;
* with NVMe, idle resident shards (``users == 0``) are a cache of at most ``max_in_cpu`` resident
  managed elements in all (DeepSpeed's meaning: parameter elements kept in CPU memory), least
  recently used evicted first; with ``device: cpu`` (a model on an accelerator) at most
  ``buffer_count`` idle device copies stay. Shards in use are never counted against the bound.
  Read-ahead (:meth:`prefetch`) may exceed it by the buckets the stage-3 prefetcher starts at
  once (bounded by ``stage3_prefetch_bucket_size``) until they are used.

``buffer_size`` (elements) bounds one swapped shard: a managed bucket whose shard is larger fails
at construction with a :class:`~zerospeed.config.ConfigError` naming
``zero_optimization.offload_param.buffer_size``, the bucket and its parameters (as DeepSpeed
refuses a parameter larger than its swap buffers). With the defaults (``max_in_cpu`` 1e9) a model
that fits stays in host memory after its first read and NVMe is only its backing store, as in
DeepSpeed; a smaller ``max_in_cpu`` trades reads for memory.

Errors: a swap file that disappeared or was replaced (another inode) while in use raises an
:class:`~zerospeed.ops.aio.AIOError` naming its path before any read or write touches it, so a
deleted file is never silently re-created with garbage. The swap folder is removed by
:meth:`close`, by ``weakref.finalize`` (garbage collection and interpreter exit) and, in
``multiprocessing`` children (which leave through ``os._exit`` without atexit), by a
``multiprocessing.util.Finalize``; only ``SIGKILL`` leaves it behind. After :meth:`close` the
swapped-out values are gone: using the parameters raises a RuntimeError saying so.

Persistent buckets (``stage3_param_persistence_threshold``) are never swapped: their full buffer
is resident anyway. Gradient shards and optimizer states are not this module's business
(``offload_optimizer``).

The optimizer step swaps shards in as it updates them
(:attr:`ShardedOptimizerState.residency <zerospeed.zero.partitioned_optimizer.ShardedOptimizerState>`
is this swapper): with ``offload_optimizer`` one swap group (``sub_group_size``) at a time, the
next group's shards read ahead; buckets left on the device optimizer (``ratio`` < 1, or no
optimizer offload) are held together around the torch optimizer's step.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from zerospeed.config import ConfigError
from zerospeed.ops.aio import AIOError, AsyncIOHandle, new_aligned_tensor
from zerospeed.ops.aio.aligned import DEFAULT_ALIGNMENT, round_up
from zerospeed.zero.offload.swapfiles import SWAP_DIR_NAME, SwapFile, SwapFolder

logger = logging.getLogger(__name__)

KEY = "zero_optimization.offload_param"


@dataclass
class _Entry:
    """The swap state of one managed bucket (see the module docstring for the invariants)."""

    bucket: Any
    numel: int
    nbytes: int
    file_offset: int = 0  # nvme: start of the bucket's aligned region
    host: torch.Tensor | None = None  # cpu offload on an accelerator: the backing host tensor
    resident: bool = True
    dirty: bool = True  # nothing written to the backing store yet
    users: int = 0
    read: Any = None  # pending AIORequest (nvme) of a read-ahead
    staging: torch.Tensor | None = None  # the swap buffer (uint8) the pending read fills

    @property
    def region_bytes(self) -> int:
        return round_up(self.nbytes, DEFAULT_ALIGNMENT)


class ParamSwapper:
    """Residency of the shards of ``buckets`` (non-persistent stage-3 buckets) under ``offload_param``.

    ``offload`` is the :class:`~zerospeed.config.zero.OffloadParamConfig` (device ``cpu`` or
    ``nvme``), ``aio`` the ``aio`` block, ``rank`` this process's data-parallel rank (names the
    swap folder), ``direct_io`` the ``fast_paths.direct_io`` switch. Construction writes every
    managed shard to its backing store and frees it.
    """

    def __init__(self, buckets: Iterable[Any], offload: Any, aio: Any, rank: int, direct_io: str = "auto") -> None:
        self.direct_io = direct_io
        self.device_kind = str(offload.device)
        if self.device_kind not in ("cpu", "nvme"):
            raise ValueError(f"ParamSwapper: offload_param.device must be 'cpu' or 'nvme', got {self.device_kind!r}")
        self.buffer_count = int(offload.buffer_count)
        self.buffer_size = int(offload.buffer_size)
        self.max_in_cpu = int(offload.max_in_cpu)
        self.pin_memory = bool(offload.pin_memory) and torch.cuda.is_available()
        self.rank = rank
        self.entries: dict[int, _Entry] = {}  # id(bucket) -> entry
        self._idle: OrderedDict[int, _Entry] = OrderedDict()  # resident, unused; oldest first
        self._reading: OrderedDict[int, _Entry] = OrderedDict()  # entries with a pending read, oldest first
        self._free_buffers: list[torch.Tensor] = []
        self._num_buffers = 0
        self._buffer_bytes = 0  # bytes of one swap buffer
        self._closed = False
        self.swap_dir: str | None = None
        self.swap_file: str | None = None
        self.handle: AsyncIOHandle | None = None
        self._file: SwapFile | None = None
        self.nvme_bytes = 0
        self.host_bytes = 0
        self.resident_peak_bytes = 0
        self.num_reads = 0
        self.num_writes = 0
        self._folder: SwapFolder | None = None

        managed = [b for b in buckets if not b.persistent and b.shard.numel() > 0]
        if self.device_kind == "cpu":
            managed = [b for b in managed if b.shard.device.type != "cpu"]  # host shards are already offloaded
        if self.device_kind == "nvme":
            for b in managed:
                if b.shard.numel() > self.buffer_size:
                    names = ", ".join(s.name for s in b.layout.slots[:8]) + (" ..." if len(b.layout.slots) > 8 else "")
                    raise ConfigError(f"{KEY}.buffer_size",
                                      f"{self.buffer_size} elements is smaller than the {b.shard.numel()}-element "
                                      f"shard of ZeRO-3 bucket {b.name!r} (parameters: {names}); raise buffer_size "
                                      "to at least the largest bucket shard")
        for b in managed:
            self.entries[id(b)] = _Entry(b, b.shard.numel(), b.shard.numel() * b.shard.element_size())
        if not self.entries:
            return
        if self.device_kind == "nvme":
            self._create_swap_file(str(offload.nvme_path), aio)
        else:
            for e in self.entries.values():
                e.host = torch.empty(e.numel, dtype=e.bucket.shard.dtype, pin_memory=self.pin_memory)
                self.host_bytes += e.nbytes
        for b in managed:
            b.swapper = self
        self._note_peak()
        self._evict(list(self.entries.values()))  # everything starts swapped out

    # -- set-up and tear-down -------------------------------------------------------------------------
    def _create_swap_file(self, nvme_path: str, aio: Any) -> None:
        offset = 0
        for e in self.entries.values():
            e.file_offset = offset
            offset += round_up(e.nbytes, DEFAULT_ALIGNMENT)
        total = offset
        switch = {"direct_io": self.direct_io, "direct_io_source": "fast_paths.direct_io"}
        self.handle = AsyncIOHandle.from_config(aio, **switch) if aio is not None else AsyncIOHandle(**switch)
        self._folder = SwapFolder(nvme_path, "param", self.rank, f"{KEY}.nvme_path", on_close=self.handle.close)
        self.swap_dir = self._folder.path
        try:
            self.handle.prepare(self.swap_dir)  # direct_io decided (or refused, when forced) before any file
            self._file = self._folder.create_file("params.swp", total, "ZeRO-3 parameter")
        except BaseException:
            self.close()
            raise
        self.swap_file = self._file.path
        self.nvme_bytes = total
        logger.debug("zerospeed: ZeRO-3 parameter swap file %s (%d bytes, %d shards)", self.swap_file, total,
                     len(self.entries))
        self._buffer_bytes = max(e.region_bytes for e in self.entries.values())

    def close(self) -> None:
        """Remove the swap folder. Swapped-out shards are lost: a later use raises a RuntimeError."""
        if self._closed:
            return
        self._closed = True
        if self._folder is not None:
            self._folder.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def forget(self, bucket: Any) -> None:
        """Stop managing ``bucket`` (it was discarded); its backing region is simply left unused."""
        e = self.entries.pop(id(bucket), None)
        if e is not None:
            self._finish_read(e)
            self._idle.pop(id(bucket), None)

    # -- residency --------------------------------------------------------------------------------
    def manages(self, bucket: Any) -> bool:
        return id(bucket) in self.entries

    def prefetch(self, buckets: Iterable[Any]) -> None:
        """Start reading the swapped-out shards of ``buckets`` (all in flight together; NVMe only
        is asynchronous). The reads are waited for by :meth:`acquire`."""
        for b in buckets:
            e = self.entries.get(id(b))
            if e is not None and not e.resident:
                self._start_read(e)
                self._idle[id(b)] = e
                self._idle.move_to_end(id(b))

    def acquire(self, bucket: Any, overwrite: bool = False) -> None:
        """Make ``bucket.shard`` resident and valid and count a user (never evicted until
        :meth:`release`). ``overwrite``: the caller writes the whole shard, so nothing is read."""
        e = self.entries.get(id(bucket))
        if e is None:
            return
        if not e.resident:
            if overwrite:
                self._check_file("write")
                self._allocate(e)
            else:
                self._start_read(e)
        self._finish_read(e)
        self._idle.pop(id(bucket), None)
        e.users += 1

    def release(self, bucket: Any, dirty: bool = False) -> None:
        """Drop a user of ``bucket``'s shard (``dirty``: it was written); an unused shard becomes
        idle and the least recently used idle shards beyond the bounds are swapped out."""
        e = self.entries.get(id(bucket))
        if e is None:
            return
        if e.users <= 0:
            raise RuntimeError(f"ParamSwapper: release of bucket {bucket.name!r} without acquire")
        e.dirty = e.dirty or dirty
        e.users -= 1
        if e.users == 0:
            self._idle[id(bucket)] = e
            self._idle.move_to_end(id(bucket))
            self.trim()

    def mark_dirty(self, bucket: Any) -> None:
        e = self.entries.get(id(bucket))
        if e is not None:
            if not e.resident:
                raise RuntimeError(f"ParamSwapper: bucket {bucket.name!r} written while swapped out")
            e.dirty = True

    @contextlib.contextmanager
    def hold(self, buckets: Iterable[Any], dirty: bool = False) -> Iterator[None]:
        """Keep the shards of ``buckets`` resident (reads all in flight together) for the block.

        ``dirty``: the block writes them (a bool, or a callable evaluated on exit). Afterwards they
        are released; those beyond the bounds are written back (if dirty) and freed, all writes in
        flight together.
        """
        held = [b for b in buckets if id(b) in self.entries]
        self.prefetch(held)
        acquired = []
        try:
            for b in held:
                self.acquire(b)
                acquired.append(b)
            yield
        finally:
            is_dirty = dirty() if callable(dirty) else dirty
            for b in acquired:
                e = self.entries[id(b)]
                e.dirty = e.dirty or bool(is_dirty)
                e.users -= 1
                if e.users == 0:
                    self._idle[id(b)] = e
                    self._idle.move_to_end(id(b))
            self.trim()

    def trim(self) -> None:
        """Swap out idle shards (least recently used first) until the bounds hold."""
        victims: list[_Entry] = []
        idle = list(self._idle.values())
        num_idle = len(idle)
        resident_numel = sum(e.numel for e in self.entries.values() if e.resident)
        for e in idle:
            if self.device_kind == "nvme":  # DeepSpeed's max_in_cpu: the host-memory cache of parameters
                over = resident_numel > self.max_in_cpu
            else:  # host-backed shards of a device model: staging copies, buffer_count of them idle
                over = num_idle > self.buffer_count
            if not over:
                break
            victims.append(e)
            num_idle -= 1
            resident_numel -= e.numel
        self._evict(victims)

    def swap_out_all(self) -> None:
        """Swap out every idle shard (e.g. before a memory measurement)."""
        self._evict(list(self._idle.values()))

    # -- accounting -------------------------------------------------------------------------------
    def resident_bytes(self) -> int:
        """Bytes of managed shards now resident (in use or cached), in the bucket's device memory."""
        return sum(e.nbytes for e in self.entries.values() if e.resident)

    def num_resident(self) -> int:
        return sum(1 for e in self.entries.values() if e.resident)

    def num_idle_resident(self) -> int:
        return len(self._idle)

    def swap_buffer_bytes(self) -> int:
        return self._num_buffers * self._buffer_bytes

    def memory_bytes(self) -> dict[str, int]:
        """``params_swapped_in``: managed shards resident now (part of the strategy's ``params``);
        ``param_swap_buffers``: the aligned NVMe staging buffers; ``params_on_nvme``: the swap file;
        ``params_on_host``: host copies (``device: cpu`` from an accelerator)."""
        return {"params_swapped_in": self.resident_bytes(), "param_swap_buffers": self.swap_buffer_bytes(),
                "params_on_nvme": self.nvme_bytes, "params_on_host": self.host_bytes}

    # -- the moves --------------------------------------------------------------------------------
    def _alive(self) -> None:
        if self._closed:
            raise RuntimeError("ZeRO-3 parameter offload was closed (strategy.close()): the offloaded parameter "
                               "shards and their swap files are gone")

    def _check_file(self, op: str) -> None:
        """The swap file must still be the one created: a deleted / replaced file is not re-created."""
        self._alive()
        if self._file is not None:
            self._file.check(op)

    def _allocate(self, e: _Entry) -> None:
        storage = e.bucket.shard.untyped_storage()
        if storage.nbytes() != e.nbytes:
            storage.resize_(e.nbytes)
        e.resident = True
        e.dirty = False
        self._note_peak()

    def _take_buffer(self, writes: list[tuple[Any, torch.Tensor]] | None = None) -> torch.Tensor:
        """A free swap buffer: a new one while fewer than ``max(1, buffer_count)`` exist, else one
        freed by completing the oldest write in ``writes`` or the oldest pending read."""
        while not self._free_buffers:
            if self._num_buffers < max(1, self.buffer_count):
                self._num_buffers += 1
                self._free_buffers.append(new_aligned_tensor(self._buffer_bytes, torch.uint8,
                                                             pin_memory=self.pin_memory))
            elif writes:
                request, buf = writes.pop(0)
                try:
                    request.wait()
                finally:
                    self._free_buffers.append(buf)
            elif self._reading:
                self._finish_read(next(iter(self._reading.values())))
            else:
                raise RuntimeError("ParamSwapper: no swap buffer free and nothing in flight")
        return self._free_buffers.pop()

    def _start_read(self, e: _Entry) -> None:
        if e.resident:
            return
        self._check_file("read")
        self.num_reads += 1
        if self.device_kind == "cpu":
            self._allocate(e)
            assert e.host is not None
            e.bucket.shard.copy_(e.host, non_blocking=self.pin_memory)
            return
        assert self.handle is not None and self.swap_file is not None
        buf = self._take_buffer()
        self._allocate(e)
        e.staging = buf
        e.read = self.handle.async_pread(buf[:e.region_bytes], self.swap_file, e.file_offset)
        self._reading[id(e.bucket)] = e

    def _finish_read(self, e: _Entry) -> None:
        """Wait for ``e``'s pending read and copy it from its swap buffer into the shard."""
        if e.read is None:
            return
        request, buf = e.read, e.staging
        e.read, e.staging = None, None
        self._reading.pop(id(e.bucket), None)
        try:
            request.wait()
            assert buf is not None
            shard = e.bucket.shard
            with torch.no_grad():
                shard.copy_(buf[:e.nbytes].view(shard.dtype))  # blocking: the buffer is reused next
        finally:
            if buf is not None:
                self._free_buffers.append(buf)
            self._forget_finished_requests()

    def _forget_finished_requests(self) -> None:
        """The handle tracks every async request until its ``wait()``: call it once nothing is pending."""
        if not self._reading and self.handle is not None:
            try:
                self.handle.wait()
            except AIOError:
                pass  # raised (or about to be) by the request it belongs to

    def _evict(self, victims: list[_Entry]) -> None:
        """Write back the dirty ``victims`` (writes in flight together, as many as there are swap
        buffers), then free their storage."""
        if not victims:
            return
        for e in victims:
            self._finish_read(e)
        dirty = [e for e in victims if e.dirty]
        if dirty:
            self._check_file("write")
        if self.device_kind == "cpu":
            for e in dirty:
                assert e.host is not None
                e.host.copy_(e.bucket.shard)
        elif dirty:
            assert self.handle is not None and self.swap_file is not None
            writes: list[tuple[Any, torch.Tensor]] = []
            error: AIOError | None = None
            for e in dirty:
                buf = self._take_buffer(writes)
                shard = e.bucket.shard
                with torch.no_grad():
                    buf[:e.nbytes].view(shard.dtype).copy_(shard)
                writes.append((self.handle.async_pwrite(buf[:e.region_bytes], self.swap_file, e.file_offset), buf))
            for request, buf in writes:
                try:
                    request.wait()
                except AIOError as exc:
                    error = error or exc
                finally:
                    self._free_buffers.append(buf)
            self._forget_finished_requests()
            if error is not None:
                raise error
        self.num_writes += len(dirty)
        for e in victims:
            self._free(e)

    def _free(self, e: _Entry) -> None:
        try:
            e.bucket.shard.untyped_storage().resize_(0)
        except RuntimeError as exc:
            raise RuntimeError(f"ZeRO-3 parameter offload cannot free the shard of bucket {e.bucket.name!r}: its "
                               "storage is not resizable (was it exported with .numpy() or shared?)") from exc
        e.dirty = False
        e.resident = False
        self._idle.pop(id(e.bucket), None)

    def _note_peak(self) -> None:
        self.resident_peak_bytes = max(self.resident_peak_bytes, self.resident_bytes())


def build_param_swapper(buckets: Iterable[Any], offload: Any, aio: Any, rank: int,
                        direct_io: str = "auto") -> ParamSwapper | None:
    """A :class:`ParamSwapper` for ``offload`` (an enabled OffloadParamConfig), or None when off or
    when there is nothing to move (``cpu`` offload of a model that is on the CPU already, or only
    persistent buckets)."""
    if offload is None or not getattr(offload, "enabled", True):
        return None
    swapper = ParamSwapper(buckets, offload, aio, rank, direct_io)
    return swapper if swapper.entries else None


__all__ = ["KEY", "ParamSwapper", "SWAP_DIR_NAME", "build_param_swapper"]
