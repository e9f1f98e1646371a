"""The loader ``initialize`` returns knows its position and resumes exactly there (pure, no processes)."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from zerospeed.runtime.dataloader import ResumableDataLoader, build_dataloader


def _loader(rank: int = 0) -> ResumableDataLoader:
    data = TensorDataset(torch.arange(40))
    loader = build_dataloader(data, micro_batch_size=3, dp_rank=rank, dp_world_size=2, seed=5)
    assert isinstance(loader, ResumableDataLoader)
    return loader


def _ids(batches) -> list[list[int]]:
    return [b[0].tolist() for b in batches]


def test_a_restored_loader_continues_with_the_next_unseen_batch_of_the_same_epoch() -> None:
    full = _loader()
    epoch0 = _ids(full)
    epoch1 = _ids(full)  # a finished pass moves to the next epoch (a new order)
    assert epoch0 != epoch1 and len(epoch0) == len(epoch1) == 7  # 20 samples of this rank in batches of 3
    assert full.epoch == 2

    run = _loader()
    it = iter(run)
    first = [next(it)[0].tolist() for _ in range(3)]
    state = run.state_dict()
    assert state == {"epoch": 0, "consumed_micro_batches": 3, "micro_batch_size": 3, "num_replicas": 2}

    resumed = _loader()
    resumed.load_state_dict(state)
    assert first + _ids(resumed) == epoch0  # the rest of epoch 0, no sample twice, none skipped
    assert _ids(resumed) == epoch1


def test_set_epoch_keeps_the_position_of_the_current_epoch_and_restarts_another() -> None:
    reference = _loader()
    epoch0, epoch1 = _ids(reference), _ids(reference)
    resumed = _loader()
    resumed.load_state_dict({"epoch": 1, "consumed_micro_batches": 2, "micro_batch_size": 3, "num_replicas": 2})
    resumed.set_epoch(1)  # a resumed `for epoch in range(loader.epoch, n): loader.set_epoch(epoch)` loop
    assert _ids(resumed) == epoch1[2:]
    other = _loader()
    other.load_state_dict({"epoch": 1, "consumed_micro_batches": 2, "micro_batch_size": 3, "num_replicas": 2})
    other.sampler.set_epoch(0)  # DeepSpeed's idiom on the sampler: epoch 0 from its start
    assert _ids(other) == epoch0


def test_a_position_saved_at_another_batch_size_or_world_restarts_its_epoch() -> None:
    reference = _loader()
    _ids(reference)
    epoch1 = _ids(reference)
    resumed = _loader()
    resumed.load_state_dict({"epoch": 1, "consumed_micro_batches": 2, "micro_batch_size": 4, "num_replicas": 2})
    assert _ids(resumed) == epoch1
