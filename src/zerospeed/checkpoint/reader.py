"""Reading the tensors a load needs from a checkpoint's files, in parallel, with integrity checks.

Every file a load touches is checked against the size in the index when opened, and every tensor
against its CRC-32 when read. Reads run on a few threads (file reads and CRC computation release
the GIL), each tensor exactly once; the result is held in memory until the load has checked
everything and every rank has agreed, so a bad file never leaves a model half-loaded.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import torch

from zerospeed.checkpoint.index import CheckpointIndex
from zerospeed.checkpoint.tensor_io import SafetensorsReader

NUM_READ_THREADS = 4


class TensorSource:
    """Tensors of one checkpoint by ``(file, key)`` or ``(shard, kind)``, read once and cached."""

    def __init__(self, index: CheckpointIndex) -> None:
        self.index = index
        self._readers: dict[str, SafetensorsReader] = {}
        self._cache: dict[tuple[str, str], torch.Tensor] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    def _reader(self, fname: str) -> SafetensorsReader:
        with self._lock:
            if fname not in self._readers:
                self._readers[fname] = SafetensorsReader(self.index.file_path(fname), self.index.file_bytes(fname))
            return self._readers[fname]

    def _load(self, fname: str, key: str) -> torch.Tensor:
        t = self._reader(fname).read(key, self.index.crc32(fname, key))
        with self._lock:
            self.bytes_read += t.numel() * t.element_size()
            self._cache[(fname, key)] = t
        return t

    def prefetch(self, wanted: Iterable[tuple[str, str]]) -> None:
        """Read all of ``wanted`` (deduplicated) on a few threads; re-raises the first error."""
        todo = sorted({w for w in wanted if w not in self._cache})
        if not todo:
            return
        for fname in {f for f, _ in todo}:  # open (and size-check) every file first, in this thread
            self._reader(fname)
        if len(todo) == 1:
            self._load(*todo[0])
            return
        with ThreadPoolExecutor(max_workers=min(NUM_READ_THREADS, len(todo))) as pool:
            for future in [pool.submit(self._load, f, k) for f, k in todo]:
                future.result()

    def get(self, fname: str, key: str) -> torch.Tensor:
        hit = self._cache.get((fname, key))
        return hit if hit is not None else self._load(fname, key)

    def shard(self, shard: int, kind: str) -> torch.Tensor:
        """The 1-D tensor of kind ``kind`` of global shard ``shard``."""
        return self.get(*self.index.key(shard, kind)).reshape(-1)

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()
        self._cache.clear()
