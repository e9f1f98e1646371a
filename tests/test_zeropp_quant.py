"""ZeRO++ quantization (issue #28): block-wise int8 / int4 kernels and the quantized collectives built on them.

* round trip within the analytic bound per block, for several block sizes: |x - q s| <= s/2 + 2u|x|, s = absmax/qmax;
* int4 packing exact on every code;
* the quantized all-gather gives every rank the dequantized shards of every rank (its own too);
* the int4 reduce-scatter (flat and two-level over 2 simulated hosts) equals its single-process simulation bit for
  bit, and the exact sum within the per-level bound.
"""

from __future__ import annotations

import pytest
import torch

from zerospeed.ops.block_quant import dequantize, pack_int4, quantize, unpack_int4, wire_bytes
from zerospeed.testing import run_distributed
from zerospeed.zero.zeropp import simulate_reduce_scatter_quantized

U = torch.finfo(torch.float32).eps / 2


def _inputs(numel: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g) * torch.logspace(-4, 2, numel)


@pytest.mark.parametrize("bits,qmax", [(8, 127), (4, 7)])
@pytest.mark.parametrize("block", [2, 32, 128, 256, 1000])
def test_round_trip_within_the_bound_per_block(bits, qmax, block):
    x = _inputs(10_007)
    x[:block] = 0.0  # an all-zero block round-trips exactly
    q = quantize(x, bits, block)
    back = dequantize(q)
    assert back.shape == x.shape and q.scales.numel() == -(-x.numel() // block)
    padded = torch.zeros(q.scales.numel() * block)
    padded[: x.numel()] = x
    scale = padded.view(-1, block).abs().amax(1) / qmax
    per_elem = scale.repeat_interleave(block)[: x.numel()]
    bound = per_elem / 2 + 2 * U * x.abs()
    assert bool(((back - x).abs() <= bound).all())
    assert torch.equal(back[:block], torch.zeros(block))
    assert torch.equal(q.scales, scale)
    # the bound is attained up to a few percent somewhere (not a vacuous test)
    assert ((back - x).abs() / per_elem.clamp_min(1e-30)).max() > 0.45
    assert q.codes.numel() * q.codes.element_size() + 4 * q.scales.numel() == wire_bytes(x.numel(), block, bits)


def test_int4_packing_is_exact():
    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(3)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == codes.numel() // 2
    assert torch.equal(unpack_int4(packed), codes)
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(pack_int4(unpack_int4(every_byte)), every_byte)
    assert packed[0].item() == (-8 + 8) | ((-7 + 8) << 4)  # element 0 low nibble, element 1 high
    with pytest.raises(ValueError, match="bits: 3 is not 8 or 4"):
        quantize(torch.ones(4), 3, 2)
    with pytest.raises(ValueError, match="block_size: 3 must be an even number"):
        quantize(torch.ones(4), 8, 3)


def _collectives(per_host: int, n: int) -> dict:
    import os

    import torch.distributed as dist

    from zerospeed.zero.zeropp import all_gather_quantized, reduce_scatter_quantized

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(LOCAL_WORLD_SIZE=str(per_host), LOCAL_RANK=str(rank % per_host), GROUP_RANK=str(rank // per_host))
    full = torch.empty(world * n)
    all_gather_quantized(full, _inputs(n, seed=rank), None).wait()
    shard = torch.empty(n)
    reduce_scatter_quantized(shard, _inputs(world * n, seed=100 + rank), None).wait()
    return {"full": full, "shard": shard}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,per_host", [(2, 2), (4, 4), (4, 2)])
def test_quantized_collectives_equal_their_simulation(world, per_host):
    n = 3001  # 4 x 3001 > hierarchical.MIN_NUMEL; not a multiple of any block
    got = run_distributed(_collectives, world, per_host, n, timeout=100)
    shards = [_inputs(n, seed=r) for r in range(world)]
    want_full = torch.cat([dequantize(quantize(s, 8, 256)) for s in shards])
    inputs = [_inputs(world * n, seed=100 + r) for r in range(world)]
    want = simulate_reduce_scatter_quantized(inputs, world // per_host)
    exact = sum(inputs)
    levels = 1 if per_host in (1, world) else 2
    for r in range(world):
        assert torch.equal(got[r]["full"], want_full)
        assert torch.equal(got[r]["shard"], want[r])
        mine = exact[r * n:(r + 1) * n]
        # per level, each of at most `world` senders adds at most absmax(block)/14 <= max|x|/14 of its block
        bound = levels * world * max(x.abs().max() for x in inputs) / 14 * (1 + 1e-5) * (2 if levels == 2 else 1)
        assert float((got[r]["shard"] - mine).abs().max()) <= bound
