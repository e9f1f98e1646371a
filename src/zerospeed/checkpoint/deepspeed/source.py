"""The tensors of a parsed DeepSpeed folder handed to zerospeed's loader by index key
(:class:`zerospeed.checkpoint.reader.TensorSource`'s interface), read lazily, cached, released file by file."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from zerospeed.checkpoint.deepspeed.errors import DeepSpeedLayoutError
from zerospeed.checkpoint.index import CheckpointIndex


class DeepSpeedSource:
    """:class:`zerospeed.checkpoint.reader.TensorSource`'s interface over a :class:`~.layout.DeepSpeedFolder`."""

    def __init__(self, folder: Any, index: CheckpointIndex) -> None:
        self.folder = folder
        self.index = index
        self._by_key = {(s.file, f"{s.prefix}.{k}"): fn for s in folder._b.shards for k, fn in s.kinds.items()}
        self._cache: dict[tuple[str, str], torch.Tensor] = {}
        self.bytes_read = 0

    def prefetch(self, wanted: Iterable[tuple[str, str]]) -> None:
        """Check that every wanted tensor exists and has the elements its pieces need (files stay mapped)."""
        for key in sorted(set(wanted)):
            self.get(*key)

    def get(self, fname: str, key: str) -> torch.Tensor:
        hit = self._cache.get((fname, key))
        if hit is not None:
            return hit
        fn = self._by_key.get((fname, key))
        if fn is None:
            raise DeepSpeedLayoutError(f"{self.folder.files.path(fname)}: has no tensor {key!r}")
        try:
            t = fn()
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise DeepSpeedLayoutError(f"{self.folder.files.path(fname)}: cannot read {key!r} ({type(e).__name__}: "
                                       f"{e}): the file does not hold what its folder's other files describe") from None
        self.bytes_read += t.numel() * t.element_size()
        self._cache[(fname, key)] = t
        return t

    def shard(self, shard: int, kind: str) -> torch.Tensor:
        return self.get(*self.index.key(shard, kind)).reshape(-1)

    def release(self, fname: str) -> None:
        """Drop this source's tensors of file ``fname`` and its unpickled object, so its memory-mapped pages are
        given back once copied (the loader copies one source file at a time); a later ``get`` maps it again."""
        for key in [k for k in self._cache if k[0] == fname]:
            del self._cache[key]
        self.folder.files.forget(fname)

    def close(self) -> None:
        self._cache.clear()
        self.folder.files.close()
