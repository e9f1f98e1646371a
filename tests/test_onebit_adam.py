"""1-bit Adam (issue #28): the compressed all-reduce and the optimizer against one-process references.

* sign packing exact; the compressed all-reduce equals its one-process simulation bit for bit (errors included);
* OneBitAdam during warm-up equals torch.optim.Adam (foreach=False) on the averaged gradient exactly (gradients
  chosen so that every sum is exact), and after warm-up equals the simulated 1-bit algorithm bit for bit;
* a checkpoint taken after warm-up resumes bit for bit at the same world size.
"""

from __future__ import annotations

import pytest
import torch

from onebit_cases import FREEZE, STEPS, reference, train
from zerospeed.comm.compressed import pack_signs, simulate_compressed_all_reduce, unpack_signs
from zerospeed.testing import run_distributed


def test_sign_packing_is_exact():
    x = torch.tensor([1.0, -1.0, 0.0, -0.0, 3.0, -2.0, 5.0, -7.0, -1, -1, -1, -1, 1, 1, 1, 1])
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.tolist() == [1 + 4 + 8 + 16 + 64, 16 + 32 + 64 + 128]
    assert unpack_signs(packed).tolist() == [1, -1, 1, 1, 1, -1, 1, -1, -1, -1, -1, -1, 1, 1, 1, 1]
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(pack_signs(unpack_signs(every)), every)
    with pytest.raises(ValueError, match="need a multiple of 8"):
        pack_signs(torch.ones(7))


def _compressed(n: int, rounds: int) -> list:
    import torch.distributed as dist

    from zerospeed.comm.compressed import compressed_all_reduce

    world, rank = dist.get_world_size(), dist.get_rank()
    werr, serr = torch.zeros(n), torch.zeros(n // world)
    out = []
    for k in range(rounds):
        x = torch.randn(n, generator=torch.Generator().manual_seed(10 * k + rank))
        compressed_all_reduce(x, werr, serr)
        out.append((x, werr.clone(), serr.clone()))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_compressed_all_reduce_equals_its_simulation(world):
    n, rounds = 8 * world * 5, 3
    got = run_distributed(_compressed, world, n, rounds, timeout=100)
    werr = [torch.zeros(n) for _ in range(world)]
    serr = [torch.zeros(n // world) for _ in range(world)]
    for k in range(rounds):
        xs = [torch.randn(n, generator=torch.Generator().manual_seed(10 * k + r)) for r in range(world)]
        want = simulate_compressed_all_reduce(xs, werr, serr)
        for r in range(world):
            x, we, se = got[r][k]
            assert torch.equal(x, want) and torch.equal(we, werr[r]) and torch.equal(se, serr[r])
        # error feedback: what was sent plus what is kept is what was to be sent (to rounding)
        mean = sum(xs) / world
        assert float((want - mean).abs().max()) < 4 * float(mean.abs().max()) + 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_warm_up_is_adam_and_then_the_1bit_algorithm_exactly(world):
    got = run_distributed(train, world, timeout=100)
    want = reference(world)
    for step in range(STEPS):
        for r in range(world):
            for a, b in zip(got[r]["history"][step], want[step]):
                assert torch.equal(a, b), (world, r, step, "warm-up" if step < FREEZE else "1-bit")


@pytest.mark.timeout(120)
def test_checkpoint_after_warm_up_resumes_bit_for_bit():
    full = run_distributed(train, 2, STEPS, FREEZE, 0.0, FREEZE + 2, timeout=100)
    resumed = [run_distributed(_resume, 2, full[0]["saved"], full[1]["saved"], timeout=100)]
    for r in range(2):
        for a, b in zip(resumed[0][r]["history"][-1], full[r]["history"][-1]):
            assert torch.equal(a, b)
    assert "worker_error" in next(iter(full[0]["saved"]["opt"]["state"].values()))


def _resume(saved0: dict, saved1: dict) -> dict:
    import torch.distributed as dist

    return train(state=saved0 if dist.get_rank() == 0 else saved1)
