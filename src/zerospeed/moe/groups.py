"""Expert-parallel and expert-data-parallel process groups for MoE layers: the mesh's.

The groups are the mesh's (:meth:`zerospeed.comm.mesh.Mesh.expert_groups`, carved out of its dp groups,
DeepSpeed's layout; :mod:`zerospeed.comm.expert_groups` says how): the current mesh, or the world as one dp
group when none was built. This module is the MoE-facing view: the groups of an ``ep_size``, the group an
expert parameter's gradient is reduced over, and the names ZeRO-3's watchdog compares.
"""

from __future__ import annotations

from typing import Any

from zerospeed.comm.expert_groups import ExpertGroups, expert_groups_named, reset_expert_groups
from zerospeed.comm.mesh import current_mesh

__all__ = ["ExpertGroups", "expert_groups", "model_has_experts", "rank_independent_names", "reduction_group_of",
           "reset_expert_groups"]


def expert_groups(ep_size: int) -> ExpertGroups:
    """The groups for ``ep_size`` on this rank, from the current mesh (created on first use; collective)."""
    return current_mesh().expert_groups(ep_size)


def reduction_group_of(param: Any) -> tuple[Any, int, int] | None:
    """``(expert-dp group, rank in it, its size)`` for an expert parameter, None for a dense one.

    The ZeRO strategies reduce (and shard) an expert parameter's gradient over this group only.
    """
    from zerospeed.moe.registry import expert_group_name

    name = expert_group_name(param)
    if name is None:
        return None
    groups = expert_groups_named(name)
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
