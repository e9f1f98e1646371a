"""Per-rank bodies of the mesh-dimension tests (importable by name for run_distributed)."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from zerospeed import comm
from zerospeed.moe.groups import expert_groups, reset_expert_groups


def _sum_over(group: Any) -> float:
    t = torch.tensor([float(dist.get_rank())])
    comm.all_reduce(t, group=group)
    return t.item()


def mesh_with_sequence_axis(pp: int, sp: int, tp: int) -> dict[str, Any]:
    """The (pp, dp, sp, tp) grid: coordinates, each axis's ranks, and that each group communicates among them."""
    mesh = comm.build_mesh(pp=pp, tp=tp, sp=sp)
    out: dict[str, Any] = {"sizes": mesh.sizes, "coord": (mesh.pp_rank, mesh.dp_rank, mesh.sp_rank, mesh.tp_rank),
                           "mpu_sp": (mesh.get_sequence_parallel_world_size(), mesh.get_sequence_parallel_rank())}
    for axis, group in (("pipe", mesh.pp_group), ("data", mesh.dp_group), ("sequence", mesh.sp_group),
                        ("model", mesh.tp_group)):
        out[axis] = mesh.group_ranks(axis)
        out[f"sum_{axis}"] = _sum_over(group)
    comm.reset_mesh()
    return out


def expert_groups_of_meshes(ep_size: int) -> dict[str, Any]:
    """Expert groups from the world mesh (no mesh built), then from a built mesh with tp=2: both the mesh's."""
    reset_expert_groups()
    world = comm.world_mesh()
    plain = expert_groups(ep_size)
    out: dict[str, Any] = {"world_dp_group_is_default": world.dp_group is None and comm.get_mesh() is None,
                           "plain": (plain.name, plain.ep_rank, plain.edp_rank, _sum_over(plain.ep_group),
                                     _sum_over(plain.edp_group))}
    mesh = comm.build_mesh(tp=2)
    split = mesh.expert_groups(1)
    out["tp2"] = (split.dp_size, split.ep_size, _sum_over(split.edp_group))
    try:
        mesh.expert_groups(3)
    except ValueError as exc:
        out["bad"] = str(exc)
    comm.reset_mesh()
    reset_expert_groups()
    return out


def host_groups_from_the_launcher(per_host: int) -> dict[str, Any]:
    """torchrun's numbering (GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK) with ``per_host`` ranks a host."""
    rank = dist.get_rank()
    os.environ.update(LOCAL_WORLD_SIZE=str(per_host), LOCAL_RANK=str(rank % per_host), GROUP_RANK=str(rank // per_host))
    mesh = comm.build_mesh()
    intra, inter = mesh.host_groups()
    out = {"hosts": [list(h) for h in mesh.hosts.hosts], "host_rank": mesh.hosts.host_rank,
           "num_hosts": mesh.sizes["hosts"], "sum_intra": _sum_over(intra), "sum_inter": _sum_over(inter)}
    comm.reset_mesh()
    os.environ["LOCAL_RANK"] = str((rank + 1) % per_host)  # a numbering that does not fit (on every rank): refused
    # when the mesh is built, before any group
    try:
        comm.build_mesh()
    except comm.MeshError as exc:
        out["bad"] = str(exc)
    comm.reset_mesh()
    return out
