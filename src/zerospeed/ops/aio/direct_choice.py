"""Whether the aio engine uses O_DIRECT on a file system: the ``direct_io`` fast path, by measurement.

O_DIRECT moves a tensor's bytes between the user buffer and the device without the page cache:
no second copy, and tens of GB of offloaded optimizer state do not push everything else out of
memory. Whether it is also *faster* depends on the device, the file system and the block size, not on
a flag: so the choice is made once per process for each (file system, block size) by timing it
(:class:`~zerospeed.ops.fast_paths.FastPathChooser`), with buffered I/O - the plain path, the
reference - kept unless direct I/O is faster by more than the 5% noise margin.

* Availability is a capability probe, per handle and file system: a temporary file in the folder is
  opened with O_DIRECT and one aligned block written and read back through the engine's own system
  calls (EINVAL at either point means the file system refuses it: tmpfs before Linux 6.6, some
  FUSE/network file systems). The probe file is removed at once.
* Speed: one representative block (the handle's ``block_size``, at most 8 MiB, aligned) written and
  read back in that temporary file, each way. Both ways call ``fdatasync`` after the write, and the
  buffered way drops the range from the page cache before reading (``POSIX_FADV_DONTNEED``), so both
  read from the device: offloaded state is far larger than the page cache, so a buffered read of it in
  steady state comes from the device too, plus the copy - a read served from the cache would measure
  memory, not the path. Measured on this project's machine (ext4 on a virtio disk, three runs): 1 MiB
  blocks took 3.4-3.6 ms direct against 3.9-4.4 ms buffered (direct chosen); 64 KiB blocks 1.5-4.3 ms
  either way (buffered kept); on tmpfs both ways cost the same (0.1 ms per MiB), so the reference stays
  unless noise passes the margin. Choosing costs 25-130 ms once per file system and block size (the
  ``fdatasync`` of each timed run dominates).
* ``off`` never opens with O_DIRECT; ``on`` always does, and a file system that refuses it is an error
  naming the switch and the folder (a :class:`~zerospeed.ops.fast_paths.FastPathError` at the probe, an
  :class:`~zerospeed.ops.aio.AIOError` if it refuses later, in the middle of a request).
"""

from __future__ import annotations

import errno as _errno
import logging
import os
import uuid
from dataclasses import dataclass, field

import torch

from zerospeed.ops.aio import engine as _engine
from zerospeed.ops.aio.aligned import byte_view, new_aligned_tensor, round_up
from zerospeed.ops.fast_paths import Candidate, FastPathChooser, default_chooser

__all__ = ["DirectIOShape", "PATH", "decide_direct_io", "MAX_PROBE_BYTES"]

PATH = "direct_io"
#: the measured block is the handle's block size, capped here (a few ms per round trip)
MAX_PROBE_BYTES = 8 << 20

log = logging.getLogger("zerospeed.fast_paths")


@dataclass(frozen=True)
class DirectIOShape:
    """The shape class of a direct I/O choice: one file system (device id) and block size."""

    device: str  # "major:minor" of the file system
    block_bytes: int
    folder: str = field(default="", compare=False)  # where it was measured (for the report only)

    def __str__(self) -> str:
        return f"dev {self.device} ({self.folder}), {self.block_bytes} B blocks"


def shape_for(st_dev: int, block_bytes: int, folder: str) -> DirectIOShape:
    return DirectIOShape(f"{os.major(st_dev)}:{os.minor(st_dev)}", block_bytes, folder)


class _ProbeFile:
    """A temporary file in ``folder`` opened buffered and with O_DIRECT; removed on exit.

    ``refused`` says why O_DIRECT cannot be used there ("" when one aligned block went through).
    """

    def __init__(self, folder: str, block_bytes: int, alignment: int) -> None:
        self.path = os.path.join(folder, f".zerospeed-direct-io-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.num_bytes = max(alignment, round_up(min(block_bytes, MAX_PROBE_BYTES), alignment))
        self.alignment = alignment
        self.buffered = -1
        self.direct = -1
        self.refused = ""
        self.error = ""  # the folder itself cannot hold a probe file (read-only, missing...)

    def __enter__(self) -> _ProbeFile:
        try:
            self.buffered = _engine.sys_open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        except OSError as exc:
            self.error = f"cannot create a probe file in '{os.path.dirname(self.path)}': {exc.strerror}"
            return self
        self.buf = new_aligned_tensor(self.num_bytes, torch.uint8, alignment=self.alignment)
        self.buf.copy_(torch.arange(self.num_bytes, dtype=torch.int64).remainder_(251).to(torch.uint8))
        self.mv = byte_view(self.buf)
        try:
            self.direct = _engine.sys_open(self.path, os.O_RDWR | _engine.O_DIRECT)
            unit = self.mv[: self.alignment]
            if _engine.sys_pwrite(self.direct, unit, 0) != self.alignment or \
                    _engine.sys_pread(self.direct, unit, 0) != self.alignment:
                self.refused = "a direct write or read of one aligned block came back short"
        except OSError as exc:
            if exc.errno != _errno.EINVAL:
                self.error = f"probe file '{self.path}': {exc.strerror}"
            else:
                self.refused = f"O_DIRECT refused in '{os.path.dirname(self.path)}': {exc.strerror}"
        return self

    def buffered_round_trip(self) -> None:
        fd, n = self.buffered, self.num_bytes
        _full(_engine.sys_pwrite, fd, self.mv, n)
        os.fdatasync(fd)
        if hasattr(os, "posix_fadvise"):  # the read comes from the device, as in steady state
            os.posix_fadvise(fd, 0, n, os.POSIX_FADV_DONTNEED)
        _full(_engine.sys_pread, fd, self.mv, n)

    def direct_round_trip(self) -> None:
        fd, n = self.direct, self.num_bytes
        _full(_engine.sys_pwrite, fd, self.mv, n)
        os.fdatasync(fd)
        _full(_engine.sys_pread, fd, self.mv, n)

    def __exit__(self, *exc: object) -> None:
        for fd in (self.direct, self.buffered):
            if fd >= 0:
                os.close(fd)
        if self.buffered >= 0:
            try:
                os.unlink(self.path)
            except OSError:
                pass


def _full(call, fd: int, mv: memoryview, n: int) -> None:
    done = 0
    while done < n:
        k = call(fd, mv[done:n], done)
        if k <= 0:
            raise OSError(_errno.EIO, "short transfer in the direct I/O measurement")
        done += k


def decide_direct_io(setting: str, folder: str, st_dev: int, block_bytes: int, alignment: int, source: str,
                     chooser: FastPathChooser | None = None) -> tuple[bool, str]:
    """``(use O_DIRECT?, why not)`` for files in ``folder`` (on file system ``st_dev``).

    ``setting``: ``off`` (no probe), ``on`` (probed; a refusal is a FastPathError naming ``source``
    and the folder), ``auto`` (probed, then measured through the chooser, cached per file system and
    block size). ``why not`` is the probe's reason when O_DIRECT was refused, for the handle's
    :attr:`~zerospeed.ops.aio.AsyncIOHandle.direct_io_fallbacks`.
    """
    if setting == "off":
        return False, ""
    chooser = chooser or default_chooser()
    shape = shape_for(st_dev, block_bytes, folder)
    if _engine.O_DIRECT == 0:
        chooser.choose(PATH, shape, {"off": Candidate(lambda: None), "on": Candidate(None, "this OS has no O_DIRECT")},
                       setting, source)
        return False, "this OS has no O_DIRECT"
    with _ProbeFile(folder, block_bytes, alignment) as probe:
        if probe.error:  # cannot probe here (e.g. a read-only folder): the forced value, or the reference
            log.info("zerospeed fast path direct_io[%s]: %s (%s)", shape, "on" if setting == "on" else "off",
                     probe.error)
            return setting == "on", ""
        if probe.refused:
            if setting == "on":  # forced: an error naming the switch and the folder
                chooser.choose(PATH, shape, {"off": Candidate(lambda: None), "on": Candidate(None, probe.refused)},
                               setting, source)
            log.info("zerospeed fast path direct_io[%s]: off (%s)", shape, probe.refused)
            return False, probe.refused
        chosen = chooser.choose(PATH, shape, {"off": Candidate(probe.buffered_round_trip),
                                              "on": Candidate(probe.direct_round_trip)}, setting, source)
    return chosen == "on", ""
