"""Process groups and counted collectives. Every collective in zerospeed goes through here.

It also answers to DeepSpeed's ``deepspeed.comm`` names (``import zerospeed.comm as dist`` works
as ``import deepspeed.comm as dist``): ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
``all_to_all_single``, ``new_group``... are counted like every other collective.
"""

from zerospeed.comm.collectives import (
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all_single,
    inference_all_reduce,
    reduce,
    barrier,
    broadcast,
    irecv,
    isend,
    recv,
    reduce_scatter,
    reduce_scatter_tensor,
    send,
)
from zerospeed.comm.counter import COUNTER, CommCounter, OpStats
from zerospeed.comm.mesh import (Mesh, MeshError, build_mesh, current_mesh, from_mpu, get_mesh, new_group, reset_mesh,
                                 set_mesh, world_mesh)
from zerospeed.comm.dist import (
    destroy_process_group,
    device_for_backend,
    get_all_ranks_from_group,
    get_backend,
    get_global_rank,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_available,
    is_initialized,
    new_group,
)

__all__ = [
    "COUNTER", "CommCounter", "OpStats", "ReduceOp", "all_gather", "all_gather_object", "all_reduce",
    "barrier", "broadcast", "device_for_backend", "get_local_rank", "get_rank", "get_world_size",
    "Mesh", "MeshError", "build_mesh", "current_mesh", "from_mpu", "get_mesh", "new_group", "reset_mesh", "set_mesh",
    "world_mesh",
    "init_distributed", "irecv", "is_initialized", "isend", "recv", "reduce_scatter", "send",
    # DeepSpeed's names (deepspeed.comm)
    "all_gather_into_tensor", "all_to_all_single", "destroy_process_group", "get_all_ranks_from_group",
    "get_backend", "get_global_rank", "inference_all_reduce", "is_available", "new_group", "reduce",
    "reduce_scatter_tensor",
]


from zerospeed._submodules import lazy_submodules as _lazy_submodules

__getattr__ = _lazy_submodules(__name__)  # zerospeed.<package>.<submodule> after `import zerospeed` (issue #27)
