"""Which link a collective's bytes cross: this rank's host, or the network to another host.

A group's members are placed on hosts by the launcher's numbering (:mod:`zerospeed.comm.hosts`, no
collective). For each algorithm zerospeed runs, :func:`sent_bytes` gives the exact bytes *this rank sends*,
split into ``(intra_host, inter_host)``:

* ``ring`` (gloo's all-reduce, all-gather; NCCL's rings): a rank sends everything to its successor in group
  order, ``(k-1)/k`` of the message for an all-gather or reduce-scatter, ``2(k-1)/k`` for an all-reduce. The
  bytes are inter-host when the successor sits on another host. This models the algorithm (gloo may choose
  another schedule for small messages); the multi-host test reads the veth counters to check it.
* ``pairwise`` (all-to-all, and zerospeed's reduce-scatter through it): ``1/k`` of the message to every other
  member, split by each peer's host.

The counts are what the comms logger reports as ``intra_host_bytes`` / ``inter_host_bytes``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zerospeed.comm.hosts import host_layout

__all__ = ["group_hosts", "sent_bytes"]

_CACHE: dict[Any, tuple[tuple[int, ...], tuple[int, ...]]] = {}
_CACHE_WORLD: list[Any] = [None]


def group_hosts(group: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(global ranks in group order, host index of each)`` for ``group`` (None: the world). Local, cached."""
    if dist.group.WORLD is not _CACHE_WORLD[0]:  # a new world: group objects (and maybe hosts) changed
        _CACHE.clear()
        _CACHE_WORLD[0] = dist.group.WORLD
    key = id(group) if group is not None else None
    hit = _CACHE.get(key)
    if hit is None:
        world, rank = dist.get_world_size(), dist.get_rank()
        layout = host_layout(world, rank)
        host_of = {r: h for h, ranks in enumerate(layout.hosts) for r in ranks}
        ranks = tuple(range(world)) if group is None else tuple(dist.get_process_group_ranks(group))
        hit = _CACHE[key] = (ranks, tuple(host_of[r] for r in ranks))
    return hit


def sent_bytes(group: Any, algorithm: str, message_bytes: int, passes: int = 1) -> tuple[int, int]:
    """``(intra_host, inter_host)`` bytes this rank sends for one collective over ``group``.

    ``message_bytes`` is the full (unsharded) message; ``passes`` is 2 for a ring all-reduce (a reduce-scatter
    then an all-gather), 1 otherwise. ``algorithm`` is ``"ring"`` or ``"pairwise"``.
    """
    if not dist.is_initialized():
        return (0, 0)
    ranks, hosts = group_hosts(group)
    k = len(ranks)
    if k == 1:
        return (0, 0)
    me = ranks.index(dist.get_rank())
    if algorithm == "ring":
        total = passes * (k - 1) * message_bytes // k
        return (0, total) if hosts[(me + 1) % k] != hosts[me] else (total, 0)
    if algorithm == "pairwise":
        per_peer = message_bytes // k
        remote = sum(1 for i, h in enumerate(hosts) if i != me and h != hosts[me])
        return ((k - 1 - remote) * per_peer, remote * per_peer)
    raise ValueError(f"algorithm: {algorithm!r} is not 'ring' or 'pairwise'")
