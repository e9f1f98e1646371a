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
