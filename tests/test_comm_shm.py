"""Shared-memory collectives on one host (zerospeed.comm.shm): the same bits as the TCP algorithms they replace,
the fallback when set-up fails, the off switch, nothing left in /dev/shm."""

import glob
import os

import pytest
import torch
import torch.distributed as dist

from zerospeed import comm
from zerospeed.comm import algorithms, shm
from zerospeed.testing import run_distributed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _data(numel, dtype, salt):
    g = torch.Generator().manual_seed(1000 * salt + dist.get_rank())
    return (torch.randn(numel, generator=g) * torch.logspace(-4, 4, numel)).to(dtype)


def _three(group, k, n, dtype, salt, op):
    """reduce-scatter, all-gather, all-to-all over ``group`` through comm (whatever path the environment picks)."""
    x = _data(k * n, dtype, salt)
    shard = torch.empty(n, dtype=dtype)
    comm.reduce_scatter(shard, x.clone(), op=op, group=group)
    mine = _data(n, dtype, salt + 1)
    full = torch.empty(k * n, dtype=dtype)
    comm.all_gather(full, mine, group=group, async_op=True).wait()
    a2a = torch.empty(k * n, dtype=dtype)
    comm.all_to_all_single(a2a, _data(k * n, dtype, salt + 2), group=group)
    # in place: the output is this rank's own chunk of the input / the input this rank's own range of the output
    y = x.clone()
    me = dist.get_rank(group)
    comm.reduce_scatter(y.narrow(0, me * n, n), y, op=op, group=group)
    full2 = torch.empty(k * n, dtype=dtype)
    full2.narrow(0, me * n, n).copy_(mine)
    comm.all_gather(full2, full2.narrow(0, me * n, n), group=group)
    return [shard, full, a2a, y.narrow(0, me * n, n).clone(), full2]


def _both_paths(dtype_name, op_name, sizes, max_bytes):
    """Every size on the world and on two subgroups used interleaved, once through TCP and once through shm."""
    dtype, op = DTYPES[dtype_name], getattr(dist.ReduceOp, op_name)
    world, rank = dist.get_world_size(), dist.get_rank()
    os.environ["ZEROSPEED_SHM_MAX_BYTES"] = str(max_bytes)
    algorithms.NATIVE_MAX_NUMEL = 4096  # TCP takes the pairwise / native algorithms below, rounds / broadcasts above
    evens = dist.new_group(list(range(0, world, 2)) if world > 2 else [0, 1])
    odds = dist.new_group(list(range(1, world, 2)) if world > 2 else [0, 1])
    results = {}
    for mode in ("0", "1"):
        os.environ["ZEROSPEED_SHM_COLLECTIVES"] = mode
        before = dict(shm.CALLS)
        out = []
        for salt, n in enumerate(sizes):
            out += _three(None, world, n, dtype, 10 * salt, op)
            if world > 2:
                mine = evens if rank % 2 == 0 else odds
                out += _three(mine, world // 2, n, dtype, 10 * salt + 5, op)
            else:
                out += _three(evens, 2, n, dtype, 10 * salt + 5, op)
                out += _three(odds, 2, n, dtype, 10 * salt + 7, op)
        results[mode] = out
        results["calls" + mode] = {key: shm.CALLS[key] - before[key] for key in before}
    return results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype_name,op_name", [("fp32", "SUM"), ("bf16", "SUM"), ("fp32", "MAX")])
def test_shm_results_equal_tcp_bit_for_bit(world, dtype_name, op_name):
    # odd sizes; 6001 elements x world ranks exceeds a 16 KiB half: pieces (and growth up to the cap)
    sizes = [1, 37, 1001, 6001]
    for rank, res in enumerate(run_distributed(_both_paths, world, dtype_name, op_name, sizes, 16384, timeout=150)):
        assert len(res["0"]) == len(res["1"])
        for i, (tcp, fast) in enumerate(zip(res["0"], res["1"])):
            assert fast.dtype == tcp.dtype and torch.equal(fast, tcp), f"rank {rank}, result {i}"
        per_kind = len(sizes) * (2 if world > 2 else 3)
        assert res["calls0"] == {"reduce_scatter": 0, "all_gather": 0, "all_to_all": 0}
        assert res["calls1"] == {"reduce_scatter": 2 * per_kind, "all_gather": 2 * per_kind, "all_to_all": per_kind}


def _left_behind():
    """Every segment file this rank's groups created is gone (unlinked right after set-up)."""
    return [p for g in shm._GROUPS.values() for p in g.paths if os.path.exists(p)]


def _fallback(world):
    import warnings

    os.environ.update(ZEROSPEED_SHM_COLLECTIVES="1", ZEROSPEED_SHM_DIR="/nonexistent/zerospeed-shm-test")
    sub = dist.new_group([0, 1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _three(None, world, 1001, torch.float32, 3, dist.ReduceOp.SUM)
        out += _three(None, world, 7, torch.float32, 4, dist.ReduceOp.SUM)
        if dist.get_rank() < 2:
            out += _three(sub, 2, 1001, torch.float32, 5, dist.ReduceOp.SUM)
    messages = [str(w.message) for w in caught if "shared-memory" in str(w.message)]
    calls = dict(shm.CALLS)
    os.environ.update(ZEROSPEED_SHM_COLLECTIVES="0")
    ref = _three(None, world, 1001, torch.float32, 3, dist.ReduceOp.SUM)
    ref += _three(None, world, 7, torch.float32, 4, dist.ReduceOp.SUM)
    if dist.get_rank() < 2:
        ref += _three(sub, 2, 1001, torch.float32, 5, dist.ReduceOp.SUM)
    return {"messages": messages, "calls": calls, "equal": all(torch.equal(a, b) for a, b in zip(out, ref)),
            "n": len(out)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_failed_set_up_warns_once_and_stays_correct_through_tcp(world):
    for res in run_distributed(_fallback, world, world, timeout=100):
        assert res["equal"] and res["n"] >= 10
        assert res["calls"] == {"reduce_scatter": 0, "all_gather": 0, "all_to_all": 0}
        assert len(res["messages"]) == 1, res["messages"]
        msg = res["messages"][0]
        assert "/nonexistent/zerospeed-shm-test/zerospeed-" in msg and "errno 2" in msg and "TCP" in msg


def _run_and_list(world):
    os.environ.pop("ZEROSPEED_SHM_COLLECTIVES", None)  # the size rule: these messages are above MIN_BYTES
    n = shm.MIN_BYTES // 4
    _three(None, world, n, torch.float32, 1, dist.ReduceOp.SUM)
    grown = _three(None, world, 3 * shm._MIN_HALF_BYTES // 4, torch.float32, 2, dist.ReduceOp.SUM)  # regrows
    small = torch.ones(world)
    before = dict(shm.CALLS)
    comm.all_reduce(small)
    comm.reduce_scatter(torch.empty(1), small.clone())  # below MIN_BYTES: TCP
    return {"left": _left_behind(), "calls": dict(shm.CALLS), "before": before,
            "paths": [p for g in shm._GROUPS.values() for p in g.paths], "ok": grown[0].numel() > 0}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_nothing_is_left_in_dev_shm_and_the_size_rule_applies(world):
    ours = set(glob.glob("/dev/shm/zerospeed-*"))
    results = run_distributed(_run_and_list, world, world, timeout=100)
    for res in results:
        assert res["left"] == [] and len(res["paths"]) == world
        assert res["calls"]["reduce_scatter"] == 4 and res["calls"]["all_gather"] == 4
        assert res["calls"]["all_to_all"] == 2 and res["before"] == res["calls"]
    created = {p for res in results for p in res["paths"]}
    assert not created & (set(glob.glob("/dev/shm/zerospeed-*")) - ours)


def test_bad_switch_values_are_named(monkeypatch):
    monkeypatch.setenv("ZEROSPEED_SHM_COLLECTIVES", "yes")
    with pytest.raises(ValueError, match="ZEROSPEED_SHM_COLLECTIVES: 'yes'"):
        shm._mode()
    monkeypatch.setenv("ZEROSPEED_SHM_MAX_BYTES", "64M")
    with pytest.raises(ValueError, match="ZEROSPEED_SHM_MAX_BYTES: '64M'"):
        shm._max_half()


def _growth_fails_on_rank_one(world):
    """Rank 1 cannot create a segment above 1 MiB per half: every rank keeps the first segment and sends the large
    message in pieces (each rank agreed), with one warning, and the results equal TCP's."""
    import warnings

    os.environ["ZEROSPEED_SHM_COLLECTIVES"] = "1"
    real = shm._map

    def refuse(path, size, create):
        if create and dist.get_rank() == 1 and size > 2 * shm._MIN_HALF_BYTES + 64:
            raise OSError(28, "No space left on device")
        return real(path, size, create)

    shm._map = refuse
    n = shm._MIN_HALF_BYTES // 4  # world x n fp32 elements: world MiB, above the 1 MiB half
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast = _three(None, world, 16, torch.float32, 1, dist.ReduceOp.SUM)
        fast += _three(None, world, n, torch.float32, 2, dist.ReduceOp.SUM)
        fast += _three(None, world, n, torch.float32, 3, dist.ReduceOp.SUM)
    g = shm._GROUPS[id(dist.group.WORLD)]
    state = {"half": g.half, "grow": g.grow, "ok": g.ok, "calls": dict(shm.CALLS)}
    os.environ["ZEROSPEED_SHM_COLLECTIVES"] = "0"
    ref = _three(None, world, 16, torch.float32, 1, dist.ReduceOp.SUM)
    ref += _three(None, world, n, torch.float32, 2, dist.ReduceOp.SUM)
    ref += _three(None, world, n, torch.float32, 3, dist.ReduceOp.SUM)
    messages = [str(w.message) for w in caught if "shared-memory" in str(w.message)]
    return {**state, "messages": messages, "equal": all(torch.equal(a, b) for a, b in zip(fast, ref))}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_a_failed_growth_keeps_the_segment_and_sends_in_pieces(world):
    for rank, res in enumerate(run_distributed(_growth_fails_on_rank_one, world, world, timeout=100)):
        assert res["equal"] and res["ok"] is True and res["grow"] is False
        assert res["half"] == shm._MIN_HALF_BYTES
        assert res["calls"] == {"reduce_scatter": 6, "all_gather": 6, "all_to_all": 3}
        assert len(res["messages"]) == 1 and "could not grow" in res["messages"][0], res["messages"]
        if rank == 1:
            assert "No space left on device" in res["messages"][0] and "errno 28" in res["messages"][0]


def _a2a_noncontiguous(world):
    os.environ["ZEROSPEED_SHM_COLLECTIVES"] = "1"
    x = _data(world * 33, torch.float32, 9)
    flat = torch.empty(world * 33)
    comm.all_to_all_single(flat, x)
    strided = torch.empty(33, world).t()  # [world, 33], not contiguous
    comm.all_to_all_single(strided, x.view(world, 33))
    return {"equal": torch.equal(strided.reshape(-1), flat), "contiguous": strided.is_contiguous(),
            "calls": shm.CALLS["all_to_all"]}


@pytest.mark.timeout(60)
def test_all_to_all_into_a_non_contiguous_output():
    for res in run_distributed(_a2a_noncontiguous, 2, 2, timeout=50):
        assert res == {"equal": True, "contiguous": False, "calls": 2}
