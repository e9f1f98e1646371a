"""The training data loader ``initialize`` returns: each data-parallel rank reads its own slice, resumably.

As DeepSpeed does, the loader yields micro-batches of ``train_micro_batch_size_per_gpu`` and
shards the data set over data-parallel ranks with a :class:`DistributedSampler` (shuffled with a
fixed seed, a new order per epoch).

Resume (a zerospeed addition): the loader knows its position, ``(epoch, micro-batches already
yielded in that epoch)``; ``engine.save_checkpoint`` stores it and ``engine.load_checkpoint``
restores it (the engine holds the loader as ``engine.training_dataloader``). The next iteration then
starts at the first micro-batch the saved run had not yet trained on, skipping the consumed ones by
index (their samples are never loaded), so a resumed run sees exactly the samples the
uninterrupted run would. Rules that make this exact:

* A pass that runs to its end moves the loader to the next epoch, so iterating again (with or
  without ``set_epoch``) gives the next epoch's order. ``set_epoch(e)`` with ``e`` equal to the
  current epoch keeps the position (a resumed ``for epoch in range(loader.epoch, n)`` loop calling
  ``set_epoch(epoch)`` continues mid-epoch); another ``e`` starts epoch ``e`` from its beginning.
* The position counts micro-batches *handed out*; save between a ``next()`` and the step that
  consumes it and the resumed run starts after that batch (save after the step, as usual).
* Iterable data sets have no index to skip by: their loader is a plain ``DataLoader`` and a
  resumed run starts them from the beginning (documented limitation).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable

from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset


class ResumableSampler(DistributedSampler):
    """A :class:`DistributedSampler` that can start an epoch after its first ``skip`` indices."""

    skip = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        skip, self.skip = self.skip, 0
        return iter(indices[skip:])


class ResumableDataLoader(DataLoader):
    """A :class:`DataLoader` over a :class:`ResumableSampler` that tracks and restores its position."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._epoch = 0
        self._consumed = 0  # micro-batches of the current epoch handed out (or restored as handed out)
        self._sampler_epoch = 0  # the epoch this loader last gave its sampler

    @property
    def epoch(self) -> int:
        """The epoch the next micro-batch belongs to."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning, or keep the position if it is the current epoch."""
        if epoch != self._epoch:
            self._epoch, self._consumed = int(epoch), 0
        self._sync_sampler()

    def _sync_sampler(self) -> None:
        self.sampler.set_epoch(self._epoch)  # type: ignore[attr-defined]
        self._sampler_epoch = self._epoch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "consumed_micro_batches": self._consumed,
                "micro_batch_size": int(self.batch_size or 1), "num_replicas": int(self.sampler.num_replicas)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state.get("micro_batch_size", self.batch_size)) != self.batch_size or \
                int(state.get("num_replicas", self.sampler.num_replicas)) != self.sampler.num_replicas:
            # another micro-batch size or data-parallel degree: batches do not line up; resume at the epoch start
            self._epoch, self._consumed = int(state["epoch"]), 0
        else:
            self._epoch, self._consumed = int(state["epoch"]), int(state["consumed_micro_batches"])
        self._sync_sampler()

    def __iter__(self) -> Iterator[Any]:
        sampler: ResumableSampler = self.sampler  # type: ignore[assignment]
        if sampler.epoch != self._sampler_epoch:  # the DeepSpeed idiom: loader.sampler.set_epoch(e)
            self.set_epoch(sampler.epoch)
        self._sync_sampler()
        sampler.skip = self._consumed * int(self.batch_size or 1)
        for batch in super().__iter__():
            self._consumed += 1
            yield batch
        self._epoch, self._consumed = self._epoch + 1, 0
        self._sync_sampler()


def build_dataloader(dataset: Dataset, micro_batch_size: int, dp_rank: int, dp_world_size: int,
                     collate_fn: Callable[..., Any] | None = None, drop_last: bool = False, seed: int = 0,
                     shuffle: bool = True) -> DataLoader:
    if isinstance(dataset, IterableDataset):
        return DataLoader(dataset, batch_size=micro_batch_size, collate_fn=collate_fn, drop_last=drop_last)
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise TypeError(f"training_data must be a torch Dataset (map-style or iterable), got {type(dataset).__name__}")
    sampler = ResumableSampler(dataset, num_replicas=dp_world_size, rank=dp_rank, shuffle=shuffle, seed=seed,
                               drop_last=drop_last)
    return ResumableDataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                               drop_last=drop_last)
