"""ZeRO++ communication: quantized weight all-gathers (qwZ) and quantized gradient reduce-scatters (qgZ).

* :func:`all_gather_quantized` (``zero_quantized_weights``): every rank quantizes its shard block-wise to int8
  (:mod:`zerospeed.ops.block_quant`, one fp32 scale per block), the codes and scales travel as one uint8
  all-gather (two-level across hosts, :mod:`zerospeed.comm.hierarchical`), and every rank dequantizes all the
  shards, its own included, so every rank computes with the same weights. The fp32 (or bf16) shards the
  optimizer updates are untouched: only the gathered copy used by forward and backward is quantized. Error per
  element: at most ``absmax(block) / 254`` plus two roundings.
* :func:`reduce_scatter_quantized` (``zero_quantized_gradients``): int4 blocks through all-to-all, in two levels
  when the group spans hosts. Inside the host each rank quantizes, per destination, the chunk that destination
  needs; the chunks arrive by all-to-all, are dequantized and summed in rank order (fp32); the partial sums are
  quantized again and exchanged across hosts on 1/local_size of the data, then dequantized and summed in host
  order. Each element is quantized once per level, so the error is at most ``sum over the level's senders of
  absmax(block) / 14`` per level (plus roundings), and the result is a deterministic function of the inputs: a
  single-process simulation (:func:`simulate_reduce_scatter_quantized`) reproduces it bit for bit.

* hpZ (``zero_hpz_partition_size``): a stage-3 bucket keeps, from each primary gather, a secondary partition of
  its full buffer over ``size`` consecutive ranks (one host when ``size`` is the ranks per host); the next gather
  (backward's) is an all-gather inside that group, as long as the shard was not written since (torch's version
  counter says). It yields the very values of the primary gather, so hpZ alone is exact against ZeRO-3.

All return a Work-like handle whose ``wait()`` finishes the dequantization, so they slot in where the plain
collectives were started asynchronously.

Kernels: the payloads are made and read by :mod:`zerospeed.ops.block_quant` (torch, the reference) or by its C twin
:mod:`zerospeed.ops.block_quant_kernel` (one pass per block, written into the send buffer in place), which gives
the same bytes and the same sums bit for bit; the ``block_quant`` fast path picks one per process
(``ZEROSPEED_FAST_PATHS=block_quant=torch`` forces the reference). Ranks may pick differently without any effect
on the numbers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zerospeed import comm
from zerospeed.comm import hierarchical
from zerospeed.ops import block_quant_kernel
from zerospeed.ops.block_quant import Quantized, dequantize, num_blocks, quantize

__all__ = ["KeepSecondary", "GRAD_BITS", "GRAD_BLOCK", "WEIGHT_BLOCK", "all_gather_quantized", "reduce_scatter_quantized",
           "simulate_reduce_scatter_quantized"]

WEIGHT_BLOCK = 256  # elements per int8 scale (1.6% overhead in bytes)
GRAD_BLOCK = 128  # elements per int4 scale (6% overhead)
GRAD_BITS = 4


def _payload(q: Quantized) -> torch.Tensor:
    """codes and scales as one uint8 tensor (what goes on the wire)."""
    return torch.cat([q.codes.view(torch.uint8), q.scales.view(torch.uint8)])


def _unpayload(raw: torch.Tensor, numel: int, block: int, bits: int) -> Quantized:
    blocks = num_blocks(numel, block)
    code_bytes = blocks * block * bits // 8
    codes = raw.narrow(0, 0, code_bytes)
    scales = raw.narrow(0, code_bytes, 4 * blocks).clone().view(torch.float32)
    return Quantized(codes.view(torch.int8) if bits == 8 else codes, scales, numel, block, bits)


def _payload_bytes(numel: int, block: int, bits: int) -> int:
    blocks = num_blocks(numel, block)
    return blocks * block * bits // 8 + 4 * blocks


_PATH: list[str] = []


def kernel_path(setting: str = "auto") -> str:
    """``"torch"`` or ``"c"``: which block-quantization kernel this process uses. ``setting`` is the config's
    ``fast_paths.block_quant`` (``auto`` defers to ``ZEROSPEED_FAST_PATHS``, then to a timing, once per process);
    a forced setting replaces the previous choice (a new engine with another config)."""
    if not _PATH or setting != "auto":
        _PATH[:] = [block_quant_kernel.choose(setting)]
    return _PATH[0]


def _quantize_into(x: torch.Tensor, bits: int, block: int, out: torch.Tensor) -> None:
    """``out`` (uint8, the payload's bytes) = the quantized form of ``x`` (flat)."""
    x = x.detach().reshape(-1)
    if kernel_path() == "c":
        block_quant_kernel.quantize_payload(x.float().contiguous(), bits, block, out)
    else:
        out.copy_(_payload(quantize(x, bits, block)))


def _dequantize_into(raw: torch.Tensor, numel: int, bits: int, block: int, out: torch.Tensor,
                     accumulate: bool = False) -> None:
    """``out`` (flat, ``numel``) = (or fp32 ``+=``) the values of the payload ``raw``."""
    if kernel_path() == "c" and out.dtype == torch.float32 and out.is_contiguous():
        block_quant_kernel.dequantize_payload(raw, numel, bits, block, out, accumulate)
    elif accumulate:
        out.add_(dequantize(_unpayload(raw, numel, block, bits)))
    else:
        dequantize(_unpayload(raw, numel, block, bits), out=out)


class _Then:
    def __init__(self, work: Any, then: Any) -> None:
        self._work, self._then, self._done = work, then, False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            if self._work is not None:
                self._work.wait()
            self._then()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or self._work is None or bool(self._work.is_completed())


class KeepSecondary(_Then):
    """hpZ: a primary gather's handle that, once waited for, has the bucket keep its secondary partition."""

    def __init__(self, work: Any, bucket: Any, key: Any) -> None:
        super().__init__(work, lambda: bucket.keep_secondary(key))


def all_gather_quantized(full: torch.Tensor, shard: torch.Tensor, group: Any,
                         block_size: int = WEIGHT_BLOCK) -> _Then:
    """Start the int8 all-gather of every rank's ``shard`` into ``full`` (``world * shard.numel()`` elements)."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    n = shard.numel()
    mine = torch.empty(_payload_bytes(n, block_size, 8), dtype=torch.uint8, device=shard.device)
    _quantize_into(shard, 8, block_size, mine)
    gathered = torch.empty(world * mine.numel(), dtype=torch.uint8, device=shard.device)
    work = comm.all_gather(gathered, mine, group=group, async_op=True)

    def finish() -> None:
        flat = full.view(-1)
        for r, raw in enumerate(gathered.view(world, -1)):
            _dequantize_into(raw, n, 8, block_size, flat.narrow(0, r * n, n))

    return _Then(work, finish)


def _exchange_level(chunks: torch.Tensor, group: Any, size: int, block: int, bits: int) -> torch.Tensor:
    """``chunks``: ``[size, m]`` fp32, row ``j`` for member ``j``; quantize each row, all-to-all, dequantize what
    arrived and sum it in member order. Returns ``[m]`` fp32 (this member's reduced row)."""
    m = chunks.shape[1]
    sent = _level_payload(chunks, block, bits)
    received = torch.empty_like(sent)
    comm.all_to_all_single(received.view(-1), sent.view(-1), group=group)
    return _sum_rows(received, m, block, bits)


def _level_payload(chunks: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """``[rows, payload bytes]`` uint8: row ``j`` is ``chunks[j]`` quantized (each element quantized once)."""
    rows, m = chunks.shape
    sent = torch.empty(rows, _payload_bytes(m, block, bits), dtype=torch.uint8, device=chunks.device)
    for j in range(rows):
        _quantize_into(chunks[j], bits, block, sent[j])
    return sent


def _sum_rows(rows: torch.Tensor, m: int, block: int, bits: int) -> torch.Tensor:
    """The sum of the payload rows' values in row order, fp32."""
    acc = torch.empty(m, dtype=torch.float32, device=rows.device)
    for j in range(rows.shape[0]):
        _dequantize_into(rows[j], m, bits, block, acc, accumulate=j > 0)
    return acc


def reduce_scatter_quantized(output: torch.Tensor, input: torch.Tensor, group: Any, block_size: int = GRAD_BLOCK,
                             bits: int = GRAD_BITS) -> _Then:
    """Sum ``input`` (``world * output.numel()`` elements) over ``group`` through int4 all-to-alls; this rank's
    chunk goes to ``output`` (in its dtype). Synchronous transfers; the handle's ``wait()`` is a no-op kept for
    the callers' async protocol."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    n = output.numel()
    x = input.detach().reshape(-1).float()
    split = hierarchical.split_for(group, x.numel()) if world > 1 else None
    if world == 1:  # the same rounding as the distributed path's level
        result = _sum_rows(_level_payload(x.view(1, n), block_size, bits), n, block_size, bits)
    elif split is None:
        result = _exchange_level(x.view(world, n), group, world, block_size, bits)
    else:
        H, L = split.num_hosts, split.local_size
        by_local = x.view(H, L, n).transpose(0, 1).reshape(L, H * n)  # local rank l's row: the H chunks it reduces
        partial = _exchange_level(by_local, split.intra, L, block_size, bits)
        result = _exchange_level(partial.view(H, n), split.inter, H, block_size, bits)
    return _Then(None, lambda: output.view(-1).copy_(result))


def simulate_reduce_scatter_quantized(inputs: list[torch.Tensor], num_hosts: int, block_size: int = GRAD_BLOCK,
                                      bits: int = GRAD_BITS) -> list[torch.Tensor]:
    """What :func:`reduce_scatter_quantized` gives every rank of a group of ``len(inputs)`` ranks on ``num_hosts``
    hosts (host-major), computed in one process with the same operations in the same order."""
    world = len(inputs)
    n = inputs[0].numel() // world
    rows = [x.reshape(-1).float() for x in inputs]

    def level(senders: list[torch.Tensor]) -> torch.Tensor:
        acc = dequantize(quantize(senders[0], bits, block_size))
        for s in senders[1:]:
            acc.add_(dequantize(quantize(s, bits, block_size)))
        return acc

    if world == 1:
        return [level([rows[0]])]
    if num_hosts == 1 or num_hosts == world:
        return [level([r[g * n:(g + 1) * n] for r in rows]) for g in range(world)]
    L = world // num_hosts
    out = []
    for g in range(world):
        h, l = divmod(g, L)
        partials = []
        for hh in range(num_hosts):  # local rank l of host hh reduces the row [:, l] of its host's ranks
            row = level([rows[hh * L + ll].view(num_hosts, L, n)[:, l].reshape(-1) for ll in range(L)])
            partials.append(row.view(num_hosts, n)[h])
        out.append(level(partials))
    return out
