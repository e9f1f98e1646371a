"""``RepeatingLoader``: iterate a data loader forever (DeepSpeed's pipeline-training helper)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class RepeatingLoader:
    """Wrap an iterable so that ``next()`` restarts it when it is exhausted, instead of stopping.

    When the wrapped loader's sampler has ``set_epoch`` (a ``DistributedSampler``, as
    ``initialize``'s loader has), it is called with the number of completed passes before each
    restart, so a shuffling sampler gives a new order every pass. An empty loader is an error on
    the first ``next()`` rather than an endless loop.
    """

    def __init__(self, loader: Iterable[Any]) -> None:
        if not hasattr(loader, "__iter__"):
            raise TypeError(f"RepeatingLoader: {type(loader).__name__} is not iterable")
        self.loader = loader
        self.epoch = 0
        self.data_iter = iter(loader)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.epoch += 1
            sampler = getattr(self.loader, "sampler", None)
            if sampler is not None and hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            self.data_iter = iter(self.loader)
            try:
                return next(self.data_iter)
            except StopIteration:
                raise ValueError("RepeatingLoader: the wrapped loader yields no batches") from None
