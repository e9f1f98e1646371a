"""Topology-aware collectives: a bucket's reduce-scatter, all-gather and all-reduce in two levels.

When a group's ranks span ``H > 1`` hosts with ``L > 1`` ranks on each (numbered host by host, as torchrun and
zerospeed's launcher number them), a flat ring crosses the network once per host boundary in the ring and, on
gloo, the reduce-scatter and all-gather run as all-reduces. Here each collective is split in two levels, so that
every element crosses the network once per direction, the ZeRO formula:

* reduce-scatter (``N = H*L`` chunks of ``n``; group rank ``g = h*L + l`` gets chunk ``g``): the input is
  reordered ``[H, L, n] -> [L, H, n]``, reduce-scattered inside the host (local rank ``l`` gets the ``H`` chunks
  its peers on the other hosts need), then reduce-scattered across hosts on ``1/L`` of the data;
* all-gather: across hosts on ``1/L`` of the data, then inside the host, then reordered back;
* all-reduce: reduce-scatter then all-gather (padded to a multiple of ``N``), i.e. inside the host, across hosts
  on ``1/L``, inside the host again.

Per rank, the inter-host leg sends ``(H-1)/H`` of ``1/L`` of the message, so a host's link carries ``(H-1)/H``
of the message per direction: for ZeRO-2, 2Ψ x 4 B (rx + tx, 2 hosts) per step, for ZeRO-3 3Ψ x 4 B.

Reduction order (why hierarchical and flat agree to the bit on exactly representable sums, and otherwise to the
bound below): with the pairwise reduce-scatter (:mod:`zerospeed.comm.algorithms`) the flat result for chunk
``g`` is ``((x_0 + x_1) + ...) + x_{N-1}``; the hierarchical one is the host sums ``s_h = (x_{hL} + ...) +
x_{hL+L-1}`` added in host order. Both are sums of the same ``N`` terms, each within ``(N-1) u sum|x_i|`` of
the exact sum (``u`` the unit roundoff), so they differ by at most ``2 (N-1) u sum|x_i|``; when every partial
sum is exactly representable (integers below 2^24 in fp32) they are equal.

The two groups per split (this rank's host, and its position across hosts) are created on the group's first
large collective, by that group's members only (``use_local_synchronization``: hashed names, no world-wide
call), which every member reaches in the same order. ``ZEROSPEED_HIERARCHICAL=0`` turns the split off.
Messages under :data:`MIN_NUMEL` elements stay flat (latency-bound: three legs cost more than they save).
Only SUM, PRODUCT, MAX and MIN split (an average of averages rounds differently).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zerospeed.comm import algorithms
from zerospeed.comm.algorithms import Started
from zerospeed.comm.links import group_hosts

__all__ = ["HostSplit", "MIN_NUMEL", "all_gather", "all_reduce", "consecutive_subgroup", "reduce_scatter",
           "split_for"]

#: Messages smaller than this (elements) are not split.
MIN_NUMEL = 4096

_SPLIT_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MAX, dist.ReduceOp.MIN)


@dataclass(frozen=True)
class HostSplit:
    """A group of ``num_hosts * local_size`` ranks, host-major; this rank is ``(host_index, local_rank)``."""

    num_hosts: int
    local_size: int
    host_index: int
    local_rank: int
    intra: Any  # this rank's host's members of the group
    inter: Any  # the members at this rank's local position on every host


_SPLITS: dict[Any, HostSplit | None] = {}
_CREATED: dict[tuple[int, ...], Any] = {}
_WORLD: list[Any] = [None]


def _layout(group: Any) -> tuple[int, int, int, int, list[int], list[int]] | None:
    """``(H, L, h, l, intra ranks, inter ranks)`` when ``group`` splits evenly by host, else None."""
    ranks, hosts = group_hosts(group)
    order: list[int] = []
    for h in hosts:
        if h not in order:
            order.append(h)
    num_hosts = len(order)
    if num_hosts < 2 or len(ranks) % num_hosts:
        return None
    local = len(ranks) // num_hosts
    if local < 2 or any(hosts[i] != order[i // local] for i in range(len(ranks))):
        return None  # one rank per host (flat is already optimal), or not numbered host by host
    if list(ranks) != sorted(ranks):
        return None  # the sub-groups are made in ascending rank order: keep the group's order
    me = ranks.index(dist.get_rank())
    h, l = divmod(me, local)
    intra = list(ranks[h * local:(h + 1) * local])
    inter = [ranks[j * local + l] for j in range(num_hosts)]
    return num_hosts, local, h, l, intra, inter


def _new_group(ranks: list[int]) -> Any:
    if dist.group.WORLD is not _WORLD[0]:
        _SPLITS.clear()
        _CREATED.clear()
        _WORLD[0] = dist.group.WORLD
    key = tuple(ranks)
    if key not in _CREATED:
        _CREATED[key] = dist.new_group(ranks=ranks, use_local_synchronization=True)
    return _CREATED[key]


def split_for(group: Any, numel: int, op: Any = dist.ReduceOp.SUM) -> HostSplit | None:
    """The host split of ``group`` for a message of ``numel`` elements, or None to run it flat."""
    if numel < MIN_NUMEL or op not in _SPLIT_OPS or os.environ.get("ZEROSPEED_HIERARCHICAL", "1") == "0":
        return None
    if dist.group.WORLD is not _WORLD[0]:
        _SPLITS.clear()
        _CREATED.clear()
        _WORLD[0] = dist.group.WORLD
    key = id(group) if group is not None else None
    if key not in _SPLITS:
        found = _layout(group)
        if found is None:
            _SPLITS[key] = None
        else:
            num_hosts, local, h, l, intra, inter = found
            _SPLITS[key] = HostSplit(num_hosts, local, h, l, _new_group(intra), _new_group(inter))
    return _SPLITS[key]


def consecutive_subgroup(group: Any, size: int, what: str = "zero_optimization.zero_hpz_partition_size") -> Any:
    """The sub-group of ``size`` consecutive members of ``group`` (in group order) that holds this rank: ZeRO++'s
    secondary partition (hpZ), which with ``size`` = ranks per host is this rank's host. Made by its members
    (collective among them); ``group`` itself when ``size`` is its size."""
    ranks, _ = group_hosts(group)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or len(ranks) % size:
        raise ValueError(f"{what}: {size!r} must divide the data-parallel degree {len(ranks)}")
    if size == len(ranks):
        return group
    start = ranks.index(dist.get_rank()) // size * size
    return _new_group(list(ranks[start:start + size]))


def _links_sum(*legs: Started) -> tuple[int, int]:
    return (sum(s.links[0] for s in legs), sum(s.links[1] for s in legs))


class _Chain:
    """Legs run one after the other: the first is started now, the rest at ``wait()`` (in the same order on every
    rank, so each sub-group sees the same sequence of collectives everywhere)."""

    def __init__(self, first: Started, rest: Any) -> None:
        self._first, self._rest, self._done = first, rest, False
        self.wire_numel, self.links = first.wire_numel, first.links
        self._extra: list[Started] = []

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            self._first.wait(timeout)
            self._rest(self)
            self._done = True
        return True

    def is_completed(self) -> bool:
        """The first leg is done (the others run in ``wait()``, which a poller calls next)."""
        return self._done or self._first.is_completed()


def _expected(split: HostSplit, message_numel: int, element_size: int, kind: str,
              op: Any = None) -> tuple[int, tuple[int, int]]:
    """(wire elements, (intra, inter) bytes) the legs of ``kind`` send, known before they run (for the counter)."""
    H, L = split.num_hosts, split.local_size
    nbytes = message_numel * element_size
    # leg sizes: intra legs move the whole message among L ranks, inter legs 1/L of it among H ranks; a large
    # intra-host reduce-scatter runs as an all-reduce (twice the bytes) only for an op without an ordered combine
    intra_alg = algorithms.choose(split.intra, message_numel)
    intra_factor = 2 if intra_alg == "emulate" and op is not None and algorithms._combine(op) is None else 1
    intra = intra_factor * (L - 1) * nbytes // L
    inter = (H - 1) * (nbytes // L) // H
    wire_intra = intra_factor * message_numel
    wire_inter = message_numel // L
    if kind == "all_reduce":
        return 2 * (wire_intra + wire_inter), (2 * intra, 2 * inter)
    return wire_intra + wire_inter, (intra, inter)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Any, split: HostSplit) -> tuple[_Chain, int, tuple]:
    """Two-level reduce-scatter (see the module docstring); ``input`` is left unspecified. Returns the handle, the
    wire elements and the link bytes."""
    H, L = split.num_hosts, split.local_size
    n = output.numel()
    reordered = input.reshape(H, L, n).transpose(0, 1).contiguous().view(-1)  # [L, H, n]: local rank l's part first
    mid = torch.empty(H * n, dtype=input.dtype, device=input.device)
    first = algorithms.start_reduce_scatter(mid, reordered, op, split.intra)

    def rest(chain: _Chain) -> None:
        algorithms.start_reduce_scatter(output, mid, op, split.inter, algorithm="native").wait()

    wire, links = _expected(split, input.numel(), input.element_size(), "reduce_scatter", op)
    return _Chain(first, rest), wire, links


def all_gather(output: torch.Tensor, input: torch.Tensor, split: HostSplit) -> tuple[_Chain, int, tuple]:
    """Two-level all-gather: across hosts first (``1/L`` of the message), then inside the host."""
    H, L = split.num_hosts, split.local_size
    n = input.numel()
    mid = torch.empty(H * n, dtype=input.dtype, device=input.device)
    first = algorithms.start_all_gather(mid, input.reshape(-1), split.inter, algorithm="native")

    def rest(chain: _Chain) -> None:
        gathered = torch.empty(L * H * n, dtype=input.dtype, device=input.device)  # [L, H, n]
        algorithms.start_all_gather(gathered, mid, split.intra).wait()
        output.view(H, L, n).copy_(gathered.view(L, H, n).transpose(0, 1))

    wire, links = _expected(split, output.numel(), output.element_size(), "all_gather")
    return _Chain(first, rest), wire, links


def all_reduce(tensor: torch.Tensor, op: Any, split: HostSplit) -> tuple[_Chain, int, tuple]:
    """Two-level all-reduce: intra-host reduce-scatter, inter-host reduce-scatter and all-gather on ``1/L``,
    intra-host all-gather. Padded to a multiple of the group size with the op's identity-free trick: the padding
    is reduced too and dropped."""
    N = split.num_hosts * split.local_size
    flat = tensor.view(-1)
    numel = flat.numel()
    padded = -(-numel // N) * N
    work_buf = torch.zeros(padded, dtype=tensor.dtype, device=tensor.device)
    work_buf.narrow(0, 0, numel).copy_(flat)
    shard = torch.empty(padded // N, dtype=tensor.dtype, device=tensor.device)
    rs, _, _ = reduce_scatter(shard, work_buf, op, split)

    def rest(chain: _Chain) -> None:
        gathered = torch.empty(padded, dtype=tensor.dtype, device=tensor.device)
        ag, _, _ = all_gather(gathered, shard, split)
        ag.wait()
        flat.copy_(gathered.narrow(0, 0, numel))

    wire, links = _expected(split, padded, tensor.element_size(), "all_reduce", op)
    return _Chain(rs, rest), wire, links  # type: ignore[arg-type]
