"""Per-rank bodies of the tensor-parallel tests (importable by name for run_distributed)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zerospeed import comm


def mesh_layout(pp: int, tp: int) -> dict[str, Any]:
    """Build the mesh and report this rank's coordinates and the global ranks of its three groups."""
    mesh = comm.build_mesh(pp=pp, tp=tp)
    assert comm.get_mesh() is mesh
    out = {"degrees": mesh.degrees, "coord": (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank),
           "pipe": mesh.group_ranks("pipe"), "data": mesh.group_ranks("data"), "model": mesh.group_ranks("model")}
    # the groups really communicate among exactly those ranks
    for axis, group in (("pipe", mesh.pp_group), ("data", mesh.dp_group), ("model", mesh.tp_group)):
        t = torch.tensor([float(dist.get_rank())])
        comm.all_reduce(t, group=group)
        out[f"sum_{axis}"] = t.item()
    comm.reset_mesh()
    return out


def mesh_error(pp: int, tp: int) -> str:
    try:
        comm.build_mesh(pp=pp, tp=tp)
    except comm.MeshError as exc:
        return str(exc)
    return "no error"


class _Mpu:
    def __init__(self, tp_group: Any, dp_group: Any, tp_rank: int, tp_size: int) -> None:
        self._tp, self._dp, self._rank, self._size = tp_group, dp_group, tp_rank, tp_size

    def get_model_parallel_rank(self) -> int:
        return self._rank

    def get_model_parallel_world_size(self) -> int:
        return self._size

    def get_model_parallel_group(self) -> Any:
        return self._tp

    def get_data_parallel_group(self) -> Any:
        return self._dp


def mesh_from_mpu() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """A Megatron-style mpu with tp groups [0,1],[2,3] and dp groups [0,2],[1,3] gives the same mesh."""
    rank = dist.get_rank()
    tp_groups = [comm.new_group([0, 1]), comm.new_group([2, 3])]
    dp_groups = [comm.new_group([0, 2]), comm.new_group([1, 3])]
    mesh = comm.from_mpu(_Mpu(tp_groups[rank // 2], dp_groups[rank % 2], rank % 2, 2))
    assert comm.get_mesh() is mesh
    comm.reset_mesh()
    return mesh.degrees, (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank)
