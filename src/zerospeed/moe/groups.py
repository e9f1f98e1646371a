"""Expert-parallel and expert-data-parallel process groups, carved out of the mesh's dp group.

With a data-parallel group of ``D`` ranks (the mesh's ``dp_group``; the world without a mesh) and
``ep_size`` dividing ``D``:

* an **expert-parallel group** is ``ep_size`` consecutive dp ranks; together they hold all
  ``num_experts`` experts (``num_experts / ep_size`` each) and exchange tokens by all-to-all;
* an **expert-data-parallel group** holds the ranks with the same position in every
  expert-parallel group (``D / ep_size`` of them): the replicas of the same experts, over which
  expert gradients are reduced.

With dp ranks [0, 1, 2, 3] and ``ep_size`` 2: expert-parallel groups [0, 1], [2, 3];
expert-data-parallel groups [0, 2], [1, 3]. This is DeepSpeed's layout. Groups are created once
per ``ep_size`` (creating a group is collective: every rank builds the same MoE layers in the same
order) and named ``ep_size_<N>`` as DeepSpeed names them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerospeed import comm
from zerospeed.comm.mesh import get_mesh, new_group


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


def _dp_ranks() -> list[int]:
    mesh = get_mesh()
    if mesh is not None and comm.is_initialized():
        return mesh.group_ranks("data")
    return list(range(comm.get_world_size()))


def expert_groups(ep_size: int) -> ExpertGroups:
    """The groups for ``ep_size`` on this rank (created on first use; collective)."""
    dp_ranks = _dp_ranks()
    dp = len(dp_ranks)
    if ep_size < 1 or dp % ep_size:
        raise ValueError(f"MoE: ep_size={ep_size} does not divide the data-parallel world size {dp}")
    key = (ep_size, hash(tuple(dp_ranks)))
    if key in _CACHE:
        return _CACHE[key]
    me = comm.get_rank()
    pos = dp_ranks.index(me) if me in dp_ranks else 0
    # every rank creates every group of the world, in one order (new_group is collective); the dp
    # groups of other mesh slices have the same shape, so enumerate them all
    mesh = get_mesh()
    all_dp = mesh.topology.get_axis_comm_lists("data") if mesh is not None and mesh.topology is not None \
        else [dp_ranks]
    mine_ep = mine_edp = None
    for ranks in all_dp:
        for start in range(0, dp, ep_size):
            members = ranks[start:start + ep_size]
            group = new_group(members) if comm.is_initialized() else None
            if me in members:
                mine_ep = group
        for offset in range(ep_size):
            members = ranks[offset::ep_size]
            group = new_group(members) if comm.is_initialized() else None
            if me in members:
                mine_edp = group
    result = ExpertGroups(name=f"ep_size_{ep_size}", ep_size=ep_size, ep_rank=pos % ep_size, ep_group=mine_ep,
                          edp_size=dp // ep_size, edp_rank=pos // ep_size, edp_group=mine_edp, dp_size=dp)
    _CACHE[key] = result
    _BY_NAME[result.name] = result
    return result


def reset_expert_groups() -> None:
    """Forget cached groups (after the process group was destroyed, e.g. between tests)."""
    _CACHE.clear()
    _BY_NAME.clear()


def reduction_group_of(param: Any) -> tuple[Any, int, int] | None:
    """``(expert-dp group, rank in it, its size)`` for an expert parameter, None for a dense one.

    The ZeRO strategies reduce (and shard) an expert parameter's gradient over this group only.
    """
    from zerospeed.moe.registry import expert_group_name

    name = expert_group_name(param)
    if name is None:
        return None
    groups = _BY_NAME.get(name)
    if groups is None:
        raise RuntimeError(f"MoE: expert parameter of group {name!r} but no such expert group was created on this "
                           "rank (was the MoE layer built before torch.distributed was initialised?)")
    return groups.edp_group, groups.edp_rank, groups.edp_size


def model_has_experts(model: Any) -> bool:
    from zerospeed.moe.registry import is_expert_param

    return any(is_expert_param(p) for p in model.parameters())


def rank_independent_names(model: Any) -> Any:
    """``module name -> label`` with each local expert named by its local index (``deepspeed_experts.
    <local i>``) instead of its global one, so that every expert-parallel rank gives the module at the
    same position the same label (ZeRO-3's watchdog compares collectives across ranks by label)."""
    from zerospeed.moe.experts import Experts

    prefixes: list[tuple[str, str]] = []
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            for i, key in enumerate(module.deepspeed_experts):
                full = f"{name}.deepspeed_experts.{key}" if name else f"deepspeed_experts.{key}"
                prefixes.append((full, full.rsplit(".", 1)[0] + f".<local {i}>"))

    def label(module_name: str) -> str:
        for full, local in prefixes:
            if module_name == full or module_name.startswith(full + "."):
                return local + module_name[len(full):]
        return module_name

    return label
