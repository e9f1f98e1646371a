"""Process groups and counted collectives. Every collective in zerospeed goes through here."""

from zerospeed.comm.collectives import (
    ReduceOp,
    all_gather,
    all_gather_object,
    all_reduce,
    barrier,
    broadcast,
    irecv,
    isend,
    recv,
    reduce_scatter,
    send,
)
from zerospeed.comm.counter import COUNTER, CommCounter, OpStats
from zerospeed.comm.mesh import Mesh, MeshError, build_mesh, from_mpu, get_mesh, new_group, reset_mesh, set_mesh
from zerospeed.comm.dist import (
    device_for_backend,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
)

__all__ = [
    "COUNTER", "CommCounter", "OpStats", "ReduceOp", "all_gather", "all_gather_object", "all_reduce",
    "barrier", "broadcast", "device_for_backend", "get_local_rank", "get_rank", "get_world_size",
    "Mesh", "MeshError", "build_mesh", "from_mpu", "get_mesh", "new_group", "reset_mesh", "set_mesh",
    "init_distributed", "irecv", "is_initialized", "isend", "recv", "reduce_scatter", "send",
]
