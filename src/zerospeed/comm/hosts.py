"""Which ranks share a host: the mesh's host grouping (hierarchical collectives and hpZ need it).

Read from the launcher's environment, with no collective. torchrun (and zerospeed's launcher, which runs it)
gives every worker ``LOCAL_WORLD_SIZE`` (the workers on its node), ``LOCAL_RANK`` and ``GROUP_RANK`` (its node's
rank), and numbers global ranks node by node: ``rank = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``, every node
running the same number of workers. :func:`zerospeed.testing.run_distributed` sets ``LOCAL_WORLD_SIZE`` to the
world (one host). A world started without ``LOCAL_WORLD_SIZE`` is taken as one host: nothing says otherwise.

Validated once, when the mesh is built: ``LOCAL_WORLD_SIZE`` must be a positive int dividing the world, and this
rank's ``LOCAL_RANK`` / ``GROUP_RANK``, where set, must agree with that numbering; otherwise a
:class:`~zerospeed.comm.topology.MeshError` names the numbers (a hierarchical collective would pair the wrong
ranks).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from zerospeed.comm.topology import MeshError

__all__ = ["HostLayout", "host_layout"]


@dataclass(frozen=True)
class HostLayout:
    """The world's ranks by host, and this rank's place: host ``host_rank``, position ``local_rank`` in it."""

    hosts: tuple[tuple[int, ...], ...]
    host_rank: int
    local_rank: int

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def ranks_per_host(self) -> int:
        return len(self.hosts[0])

    @property
    def host_ranks(self) -> list[int]:
        """Global ranks on this rank's host (the intra-host group of a hierarchical collective)."""
        return list(self.hosts[self.host_rank])

    @property
    def cross_host_ranks(self) -> list[int]:
        """Global ranks at this rank's position on every host (the inter-host group)."""
        return [host[self.local_rank] for host in self.hosts]


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name)
    if text is None or not text.strip():
        return None
    try:
        return int(text)
    except ValueError:
        raise MeshError(f"hosts: {name}={text!r} is not an integer") from None


def host_layout(world_size: int, rank: int, environ: Mapping[str, str] | None = None) -> HostLayout:
    """The host grouping of a world of ``world_size`` ranks, seen from ``rank`` (see the module docstring)."""
    env = os.environ if environ is None else environ
    per_host = _env_int(env, "LOCAL_WORLD_SIZE")
    if per_host is None:
        per_host = world_size
    if per_host < 1 or world_size % per_host:
        raise MeshError(f"hosts: LOCAL_WORLD_SIZE={per_host} does not divide the world size {world_size} (every "
                        "host must run the same number of ranks)")
    local_rank, host_rank = rank % per_host, rank // per_host
    for name, expected in (("LOCAL_RANK", local_rank), ("GROUP_RANK", host_rank)):
        given = _env_int(env, name)
        if per_host != world_size and given is not None and given != expected:
            raise MeshError(f"hosts: rank {rank} has {name}={given}, but with LOCAL_WORLD_SIZE={per_host} ranks are "
                            f"numbered host by host ({name} {expected}); a launcher that numbers them otherwise "
                            "cannot be grouped by host")
    hosts = tuple(tuple(range(h * per_host, (h + 1) * per_host)) for h in range(world_size // per_host))
    return HostLayout(hosts=hosts, host_rank=host_rank, local_rank=local_rank)
