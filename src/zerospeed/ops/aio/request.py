"""One asynchronous read or write of a tensor's bytes: its blocks, its files, its completion.

A request covers ``num_bytes`` bytes of one file starting at ``file_offset``. It is cut into
blocks of at most ``block_size`` bytes, each done by one ``pread``/``pwrite`` in a worker thread:

* ``direct``  - O_DIRECT on the user's buffer (file offset, length and address all aligned);
* ``bounce``  - O_DIRECT through the worker's aligned scratch buffer (offset and length aligned,
  the user's buffer is not): one memcpy per block, still no page-cache traffic;
* ``buffered`` - ordinary page-cache I/O: the unaligned head (up to the first aligned file offset)
  and tail (the last partial alignment unit) of a request, every block when the file system
  refused O_DIRECT, and every block when O_DIRECT is off.

Head and tail never share an alignment unit with a direct block, so buffered and direct I/O of
one request touch disjoint pages (Linux flushes/invalidates the page cache around direct I/O for
the range it covers, so later requests see each other's data either way).

Completion: each finished block decrements the request's counter; the last one closes the file
descriptors and sets the event. The first error is kept (blocks not yet started are skipped) and
raised by :meth:`AIORequest.wait` as an :class:`~zerospeed.ops.aio.errors.AIOError` naming the
path, only after every block has stopped touching the buffer.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from zerospeed.ops.aio.errors import AIOError

__all__ = ["AIORequest", "Block", "plan_blocks"]

DIRECT, BOUNCE, BUFFERED = "direct", "bounce", "buffered"


@dataclass(frozen=True)
class Block:
    """Bytes ``[start, stop)`` of the request's buffer <-> file bytes at ``file_offset``."""

    start: int
    stop: int
    file_offset: int
    mode: str  # DIRECT, BOUNCE or BUFFERED

    @property
    def num_bytes(self) -> int:
        return self.stop - self.start


def plan_blocks(
    num_bytes: int,
    file_offset: int,
    buffer_address: int,
    block_size: int,
    alignment: int,
    direct: bool,
) -> list[Block]:
    """Cut a request into blocks; see the module docstring for the three modes."""
    blocks: list[Block] = []

    def chunks(start: int, stop: int, mode: str, size: int) -> None:
        for s in range(start, stop, size):
            e = min(s + size, stop)
            blocks.append(Block(s, e, file_offset + s, mode))

    if not direct:
        chunks(0, num_bytes, BUFFERED, block_size)
        return blocks
    head = min(num_bytes, (-file_offset) % alignment)
    body_stop = head + ((num_bytes - head) // alignment) * alignment
    direct_block = max(alignment, (block_size // alignment) * alignment)
    mode = DIRECT if (buffer_address + head) % alignment == 0 else BOUNCE
    chunks(0, head, BUFFERED, block_size)
    chunks(head, body_stop, mode, direct_block)
    chunks(body_stop, num_bytes, BUFFERED, block_size)
    return blocks


class AIORequest:
    """A submitted read or write; returned by ``async_pread`` / ``async_pwrite``.

    ``wait()`` blocks until every block finished and returns the number of bytes moved, or raises
    the request's :class:`AIOError`. ``done()`` polls. The request keeps the tensor's memory alive
    until it completes.
    """

    def __init__(
        self,
        op: str,
        path: str,
        buffer: memoryview,
        file_offset: int,
        blocks: list[Block],
        fds: dict[str, int],
        wave_size: int,
        enqueue: Callable[[AIORequest, Block], None],
        keepalive: object = None,
    ) -> None:
        self.op = op
        self.path = path
        self.file_offset = file_offset
        self.num_bytes = len(buffer)
        self.buffer = buffer
        self.blocks = blocks
        self.fds = fds  # {"direct": fd, "buffered": fd}; closed on completion
        self._keepalive = keepalive
        self._enqueue = enqueue
        self._wave_size = max(1, wave_size)
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._remaining = len(blocks)
        self._next = 0
        self._wave_left = 0
        self._error: AIOError | None = None
        self.bytes_done = 0

    # ----------------------------------------------------------------- scheduling

    def start(self) -> None:
        """Enqueue the first wave (all blocks when waves are unbounded)."""
        if not self.blocks:
            self._finish()
            return
        with self._lock:
            wave = self._take_wave()
        for block in wave:
            self._enqueue(self, block)

    def _take_wave(self) -> list[Block]:
        wave = self.blocks[self._next : self._next + self._wave_size]
        self._next += len(wave)
        self._wave_left = len(wave)
        return wave

    def block_done(self, block: Block, num_bytes: int, error: AIOError | None) -> None:
        """Called by a worker after ``block`` finished (or was skipped after an error)."""
        wave: list[Block] = []
        with self._lock:
            self.bytes_done += num_bytes
            if error is not None and self._error is None:
                self._error = error
            self._remaining -= 1
            self._wave_left -= 1
            if self._wave_left == 0 and self._next < len(self.blocks):
                if self._error is None:
                    wave = self._take_wave()
                else:  # stop issuing: account for the blocks never started
                    self._remaining -= len(self.blocks) - self._next
                    self._next = len(self.blocks)
            last = self._remaining == 0
        for b in wave:
            self._enqueue(self, b)
        if last:
            self._finish()

    def _finish(self) -> None:
        for fd in set(self.fds.values()):
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = {}
        self._event.set()

    # ----------------------------------------------------------------- user API

    @property
    def failed(self) -> bool:
        return self._error is not None

    def done(self) -> bool:
        return self._event.is_set()

    def exception(self, timeout: float | None = None) -> AIOError | None:
        if not self._event.wait(timeout):
            raise TimeoutError(f"aio {self.op} on '{self.path}' still running after {timeout}s")
        return self._error

    def wait(self, timeout: float | None = None) -> int:
        """Block until complete; return bytes moved or raise the :class:`AIOError`."""
        error = self.exception(timeout)
        if error is not None:
            raise error
        self.buffer = memoryview(b"")  # drop the tensor reference as soon as we can
        self._keepalive = None
        return self.num_bytes

    def __repr__(self) -> str:
        state = "failed" if self.failed else ("done" if self.done() else "pending")
        return (f"AIORequest({self.op} {self.num_bytes} B at {self.file_offset} "
                f"'{self.path}', {len(self.blocks)} blocks, {state})")
