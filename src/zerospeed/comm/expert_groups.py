"""Expert-parallel and expert-data-parallel groups, carved out of a mesh's data-parallel groups.

Reached through the mesh (:meth:`zerospeed.comm.mesh.Mesh.expert_groups`); the MoE layer and the ZeRO strategies
get their groups from there (:mod:`zerospeed.moe.groups` is the MoE-facing view).

With a data-parallel group of ``D`` ranks and ``ep_size`` dividing ``D``:

* an **expert-parallel group** is ``ep_size`` consecutive dp ranks; together they hold all
  ``num_experts`` experts (``num_experts / ep_size`` each) and exchange tokens by all-to-all;
* an **expert-data-parallel group** holds the ranks with the same position in every
  expert-parallel group (``D / ep_size`` of them): the replicas of the same experts, over which
  expert gradients are reduced.

With dp ranks [0, 1, 2, 3] and ``ep_size`` 2: expert-parallel groups [0, 1], [2, 3];
expert-data-parallel groups [0, 2], [1, 3]. This is DeepSpeed's layout. Groups are created once
per ``ep_size`` and set of dp groups (creating a group is collective: every rank builds the same MoE
layers in the same order, and creates the groups of every dp group of the mesh, in one order) and
named ``ep_size_<N>`` as DeepSpeed names them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ExpertGroups", "build_expert_groups", "expert_groups_named", "reset_expert_groups"]


@dataclass(frozen=True)
class ExpertGroups:
    name: str
    ep_size: int
    ep_rank: int
    ep_group: Any
    edp_size: int
    edp_rank: int
    edp_group: Any
    dp_size: int


_CACHE: dict[tuple[int, int], ExpertGroups] = {}
_BY_NAME: dict[str, ExpertGroups] = {}


def check_expert_degree(ep_size: int, dp_size: int) -> None:
    if ep_size < 1 or dp_size % ep_size:
        raise ValueError(f"MoE: ep_size={ep_size} does not divide the data-parallel world size {dp_size}")


def build_expert_groups(ep_size: int, dp_ranks: Sequence[int], all_dp: Sequence[Sequence[int]], rank: int,
                        new_group: Callable[[list[int]], Any] | None) -> ExpertGroups:
    """The groups for ``ep_size`` seen from ``rank`` (in ``dp_ranks``, one of ``all_dp``); ``new_group`` creates a
    group (collective), None where there is no process group. Cached per (``ep_size``, dp ranks)."""
    dp_ranks = list(dp_ranks)
    dp = len(dp_ranks)
    check_expert_degree(ep_size, dp)
    key = (ep_size, hash(tuple(dp_ranks)))
    if key in _CACHE:
        return _CACHE[key]
    pos = dp_ranks.index(rank) if rank in dp_ranks else 0
    mine_ep = mine_edp = None
    for ranks in all_dp:
        ranks = list(ranks)
        for start in range(0, dp, ep_size):
            members = ranks[start:start + ep_size]
            group = new_group(members) if new_group is not None else None
            if rank in members:
                mine_ep = group
        for offset in range(ep_size):
            members = ranks[offset::ep_size]
            group = new_group(members) if new_group is not None else None
            if rank in members:
                mine_edp = group
    result = ExpertGroups(name=f"ep_size_{ep_size}", ep_size=ep_size, ep_rank=pos % ep_size, ep_group=mine_ep,
                          edp_size=dp // ep_size, edp_rank=pos // ep_size, edp_group=mine_edp, dp_size=dp)
    _CACHE[key] = result
    _BY_NAME[result.name] = result
    return result


def expert_groups_named(name: str) -> ExpertGroups | None:
    """The groups last built under DeepSpeed's name ``ep_size_<N>`` on this rank, or None."""
    return _BY_NAME.get(name)


def reset_expert_groups() -> None:
    """Forget cached groups (after the process group was destroyed, e.g. between tests)."""
    _CACHE.clear()
    _BY_NAME.clear()
