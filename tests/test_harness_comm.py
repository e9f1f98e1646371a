"""The multi-process harness (failures and hangs are reported, never hang) and comm counting."""

import time

import pytest
import torch
import torch.distributed as dist

from zerospeed import comm
from zerospeed.testing import DistributedTestError, run_distributed


def _rank_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    comm.all_reduce(t)
    return t.item()


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 would block here forever without the harness
    return t.item()


def _hang():
    time.sleep(600)


def _count_collectives(native=False):
    if native:
        import os

        os.environ["ZEROSPEED_NATIVE_COLLECTIVES"] = "1"
    comm.COUNTER.reset()
    world = dist.get_world_size()
    x = torch.arange(8 * world, dtype=torch.float32)
    comm.all_reduce(x.clone())
    out = torch.empty(8)
    comm.reduce_scatter(out, x.clone())
    full = torch.empty(8 * world)
    comm.all_gather(full, torch.full((8,), float(dist.get_rank())))
    return comm.COUNTER.snapshot(), comm.COUNTER.traffic_elements(), out, full


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_results_come_back_in_rank_order(world):
    assert run_distributed(_rank_sum, world) == [world * (world + 1) / 2] * world


@pytest.mark.timeout(60)
def test_a_failing_rank_is_reported_and_its_peer_does_not_hang():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError, match="deliberate failure on rank 1"):
        run_distributed(_raise_on_rank_one, 2, timeout=50)
    assert time.monotonic() - t0 < 30


@pytest.mark.timeout(60)
def test_a_hang_is_killed_at_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError, match="timed out"):
        run_distributed(_hang, 2, timeout=3)
    assert time.monotonic() - t0 < 20


@pytest.mark.timeout(60)
def test_collectives_are_counted_with_elements_and_bytes():
    snap, traffic, out, full = run_distributed(_count_collectives, 2)[1]
    # small messages on gloo: an all-to-all reduce-scatter and the native all-gather, once the message on the wire
    # (large single-host ones run in point-to-point rounds / broadcasts: tests/test_sp_collectives.py); one host, so every
    # byte this rank sent (the (N-1)/N share) stayed on it
    links = {"intra_host_bytes": 32, "inter_host_bytes": 0}
    assert snap["all_reduce"] == {"count": 1, "elements": 16, "bytes": 64, "wire_elements": 32,
                                  "intra_host_bytes": 64, "inter_host_bytes": 0}
    assert snap["reduce_scatter"] == {"count": 1, "elements": 16, "bytes": 64, "wire_elements": 16, **links}
    assert snap["all_gather"] == {"count": 1, "elements": 16, "bytes": 64, "wire_elements": 16, **links}
    assert traffic == 2 * 16 + 16 + 16  # an all-reduce moves twice its size
    assert out.tolist() == [2.0 * v for v in range(8, 16)]  # rank 1's half of the sum of two copies
    assert full.tolist() == [0.0] * 8 + [1.0] * 8


@pytest.mark.timeout(60)
def test_native_gloo_collectives_give_the_same_results():
    snap, traffic, out, full = run_distributed(_count_collectives, 2, True)[1]
    assert snap["reduce_scatter"]["wire_elements"] == 16 and snap["all_gather"]["wire_elements"] == 16
    assert out.tolist() == [2.0 * v for v in range(8, 16)]
    assert full.tolist() == [0.0] * 8 + [1.0] * 8


def _in_place_reduce_scatter(native):
    import os

    os.environ["ZEROSPEED_NATIVE_COLLECTIVES"] = "1" if native else "0"
    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.arange(4 * world, dtype=torch.float32) + rank
    mine = x.narrow(0, 4 * rank, 4)  # the output is this rank's own chunk of the input
    comm.reduce_scatter(mine, x, async_op=True).wait()
    return mine.tolist()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("native", [False, True])
def test_in_place_reduce_scatter_on_both_paths(native):
    results = run_distributed(_in_place_reduce_scatter, 2, native)
    # chunk r of sum over ranks of (arange(8) + rank) = 2 * arange(8) + 1
    assert results[0] == [1.0, 3.0, 5.0, 7.0] and results[1] == [9.0, 11.0, 13.0, 15.0]


def test_rendezvous_port_is_bound_before_the_ranks_start():
    """The store's port is bound by the caller when it is chosen, so another job cannot take it in between."""
    import errno
    import socket
    import threading

    from zerospeed.testing.distributed import _rendezvous_store

    store = _rendezvous_store(10.0)
    with socket.socket() as s:
        with pytest.raises(OSError) as err:
            s.bind(("127.0.0.1", int(store.port)))
        assert err.value.errno == errno.EADDRINUSE
    del store
    # two runs at once, each with its own store, both succeed
    out = {}
    threads = [threading.Thread(target=lambda k=k: out.__setitem__(k, run_distributed(_rank_sum, 2, timeout=60)))
               for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert out == {0: [3.0, 3.0], 1: [3.0, 3.0]}
