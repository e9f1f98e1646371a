"""The mesh ``initialize`` uses when sequence parallelism is asked for (config ``sequence_parallel_size`` > 1, or an
mpu with a sequence axis, as ``UlyssesSPAttentionHF.register_with_transformers`` returns).

Rules, checked before anything is built: the config's degree and the mpu's agree (a config without the key takes
the mpu's); sp must divide the world (the mesh's own check, one line naming the numbers); sequence parallelism
with tensor parallelism (``tensor_parallel.autotp_size`` > 1 or ``mesh_param`` tp) or with a pipeline is refused in
one line (not built: Ulysses would split the heads a tp rank already holds, and the pipeline engine has no sp
axis). The engine then shards and averages over the mesh's dp x sp group (``Mesh.sp_dp_group``), and the data
loader reads by dp rank, so every rank of an sp group gets the same samples.
"""

from __future__ import annotations

from typing import Any

from zerospeed import comm
from zerospeed.comm.mesh import Mesh, MeshError

__all__ = ["sequence_parallel_mesh"]


def _mpu_sp(mpu: Any) -> int:
    method = getattr(mpu, "get_sequence_parallel_world_size", None)
    return int(method()) if callable(method) else 1


def sequence_parallel_mesh(sp_size: int, tp_cfg: Any, *, mpu: Any = None, mesh_param: Any = None,
                           pipeline: bool = False) -> Mesh | None:
    """The (dp, sp) mesh for ``initialize``, or None when sequence parallelism is not asked for."""
    mpu_sp = _mpu_sp(mpu) if mpu is not None else 1
    if sp_size == 1 and mpu_sp == 1:
        return None
    if sp_size > 1 and mpu is not None and mpu_sp != sp_size:
        raise MeshError(f"initialize: sequence_parallel_size {sp_size} but the mpu's sequence-parallel world size is "
                        f"{mpu_sp}")
    degree = max(sp_size, mpu_sp)
    if pipeline:
        raise MeshError(f"initialize: sequence_parallel_size {degree} with a PipelineModule: sequence parallelism "
                        "with pipeline parallelism is not built")
    tp = tp_cfg.size if tp_cfg.enabled else 1
    if mesh_param is not None:
        raise MeshError(f"initialize: sequence_parallel_size {degree} with mesh_param: give the degree in the config "
                        "(or the mpu) alone")
    if tp > 1:
        raise MeshError(f"initialize: sequence_parallel_size {degree} with tensor_parallel.autotp_size {tp}: sequence "
                        "parallelism with tensor parallelism is not built")
    if isinstance(mpu, Mesh):
        comm.set_mesh(mpu)
        return mpu
    if mpu is not None:
        raise MeshError(f"initialize: an mpu of type {type(mpu).__name__} with a sequence-parallel world size {mpu_sp}: "
                        "pass the mesh UlyssesSPAttentionHF.register_with_transformers returns")
    current = comm.get_mesh()
    if current is not None and current.sp_size == degree and current.tp_size == 1 and current.pp_size == 1:
        return current  # already built (register_with_transformers), the same groups
    return comm.build_mesh(sp=degree)
