"""The training data loader ``initialize`` returns: each data-parallel rank reads its own slice.

As DeepSpeed does, the loader yields micro-batches of ``train_micro_batch_size_per_gpu`` and
shards the data set over data-parallel ranks with a :class:`DistributedSampler` (shuffled with a
fixed seed, re-shuffled per epoch by ``loader.sampler.set_epoch``).
"""

from __future__ import annotations

from typing import Any, Callable

from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset


def build_dataloader(dataset: Dataset, micro_batch_size: int, dp_rank: int, dp_world_size: int,
                     collate_fn: Callable[..., Any] | None = None, drop_last: bool = False, seed: int = 0,
                     shuffle: bool = True) -> DataLoader:
    if isinstance(dataset, IterableDataset):
        return DataLoader(dataset, batch_size=micro_batch_size, collate_fn=collate_fn, drop_last=drop_last)
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise TypeError(f"training_data must be a torch Dataset (map-style or iterable), got {type(dataset).__name__}")
    sampler = DistributedSampler(dataset, num_replicas=dp_world_size, rank=dp_rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=drop_last)
