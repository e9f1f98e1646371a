"""The gloo collectives ZeRO runs over dp x sp ranks on one host for large buckets (issue #29: the SP step's CPU
time): the reduce-scatter in rounds and the all-gather by broadcasts (zerospeed.comm.algorithms, "emulate").

Both only move and add: the reduce-scatter must give the pairwise algorithm's rank-ordered sum bit for bit, the
all-gather the exact concatenation, and an SP x DP training run through them must still equal one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zerospeed.testing import run_distributed

import sp_cases


def _rounds_and_broadcasts(numel: int) -> dict:
    from zerospeed import comm
    from zerospeed.comm import algorithms

    torch.set_num_threads(1)
    k, r = dist.get_world_size(), dist.get_rank()
    numel -= numel % k
    n = numel // k
    x = torch.randn(numel, generator=torch.Generator().manual_seed(r))
    want = torch.empty(n)
    algorithms.start_reduce_scatter(want, x.clone(), dist.ReduceOp.SUM, None, "native").wait()
    got = {}
    out = torch.empty(n)
    algorithms.start_reduce_scatter(out, x.clone(), dist.ReduceOp.SUM, None, "emulate").wait()
    got["rounds"] = torch.equal(out, want)
    y = x.clone()
    mine = y.narrow(0, r * n, n)  # in place: the output is this rank's chunk of the input
    work = algorithms.start_reduce_scatter(mine, y, dist.ReduceOp.SUM, None, "emulate")
    got["in_place"] = work.is_completed() and torch.equal(mine, want)
    o1, o2 = torch.empty(n), torch.empty(n)  # two in flight, waited in reverse order
    w1 = algorithms.start_reduce_scatter(o1, x.clone(), dist.ReduceOp.SUM, None, "emulate")
    w2 = algorithms.start_reduce_scatter(o2, 2 * x, dist.ReduceOp.SUM, None, "emulate")
    w2.wait()
    w1.wait()
    got["two_in_flight"] = torch.equal(o1, want) and torch.equal(o2, 2 * want)
    peak = torch.empty(n)  # an op without an ordered combine keeps the all-reduce
    algorithms.start_reduce_scatter(peak, x.clone(), dist.ReduceOp.MAX, None, "emulate").wait()
    everyone = [None] * k
    dist.all_gather_object(everyone, x)
    got["max"] = torch.equal(peak, torch.stack(everyone).max(0).values[r * n:(r + 1) * n])
    gathered = torch.empty(numel)
    algorithms.start_all_gather(gathered, x[:n], None, "emulate").wait()
    got["all_gather"] = torch.equal(gathered, torch.cat([t[:n] for t in everyone]))
    saved = algorithms.NATIVE_MAX_NUMEL
    algorithms.NATIVE_MAX_NUMEL = 0  # the size rule picks them for any message: what the counter records
    try:
        comm.COUNTER.reset()
        comm.reduce_scatter(out, x.clone())
        comm.all_gather(gathered, x[:n])
        got["counted"] = comm.COUNTER.snapshot()
    finally:
        algorithms.NATIVE_MAX_NUMEL = saved
    return got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_in_rounds_and_all_gather_by_broadcasts_are_exact(world):
    numel = 4096
    for r in run_distributed(_rounds_and_broadcasts, world, numel, timeout=100):
        counted = r.pop("counted")
        assert all(r.values()), r
        sent = (world - 1) * numel * 4 // world  # (k-1)/k of the message, all inside the host
        for op in ("reduce_scatter", "all_gather"):
            assert counted[op] == {"count": 1, "elements": numel, "bytes": numel * 4, "wire_elements": numel,
                                   "intra_host_bytes": sent, "inter_host_bytes": 0}, counted


def _rounds_over_subgroups() -> bool:
    """Ranks 0-1 reduce-scatter twice on their pair, ranks 2-3 once on theirs, then all four on the world (passed
    as None on even ranks and as the group object on odd ones): the tags are counted per group, so nothing hangs."""
    from zerospeed.comm import algorithms

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    x = torch.arange(8, dtype=torch.float32) + rank
    out = torch.empty(4)
    for _ in range(2 if rank < 2 else 1):
        algorithms.start_reduce_scatter(out, x.clone(), dist.ReduceOp.SUM, mine, "emulate").wait()
    world = None if rank % 2 == 0 else dist.group.WORLD
    algorithms.start_reduce_scatter(out[:2], x.clone(), dist.ReduceOp.SUM, world, "emulate").wait()
    return out[:2].tolist() == [4 * float(2 * rank + i) + 6 for i in range(2)]


@pytest.mark.timeout(120)
def test_rounds_count_their_tags_per_group():
    assert run_distributed(_rounds_over_subgroups, 4, timeout=60) == [True] * 4


def _parity_through_rounds(*args) -> dict:
    from zerospeed.comm import algorithms

    algorithms.NATIVE_MAX_NUMEL = 0  # every bucket's reduce-scatter and all-gather take the large-message path
    return sp_cases.parity_body(*args)


@pytest.mark.timeout(400)
def test_llama_sp2_dp2_zero2_through_rounds_equals_one_process():
    results = run_distributed(_parity_through_rounds, 4, "llama", 2, [1, 2], ["all_gather", "all_reduce"],
                              timeout=360)
    for r in results:
        for run in r["runs"]:
            assert run["sp_dp_size"] == 4, run
            for got, ref in zip(run["losses"], run["ref_losses"]):
                assert abs(got - ref) <= sp_cases.RTOL * abs(ref), run
    assert all(run["excess"] <= 0 for run in results[0]["runs"]), results[0]["runs"]


@pytest.mark.timeout(200)
def test_two_level_collectives_count_the_intra_host_legs_they_run():
    # 4 ranks as 2 hosts x 2 (tests/comm_cases.py): a message above NATIVE_MAX_NUMEL takes the rounds and the
    # broadcasts inside the host, (L-1)/L of it each, no longer the all-reduce's 2(L-1)/L
    from comm_cases import collectives, rank_input

    world, per_host, numel = 4, 2, 300_000
    results = run_distributed(collectives, world, per_host, numel, True, True, timeout=180)
    inputs = [rank_input(world * numel, True, rank=r) for r in range(world)]
    total = torch.stack(inputs).sum(0)  # integer-valued: every order of the sum is exact
    message = world * numel * 4
    for rank, r in enumerate(results):
        assert torch.equal(r["shard"], total[rank * numel:(rank + 1) * numel])
        assert torch.equal(r["gathered"], torch.cat([rank_input(numel, True, rank=q) for q in range(world)]))
        assert torch.equal(r["summed"], total[: world * numel - 3])
        for op in ("reduce_scatter", "all_gather"):
            assert r["comms"][op]["intra_host_bytes"] == message // 2, (op, r["comms"][op])
