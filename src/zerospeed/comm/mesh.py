"""The one (pp, dp, tp) device mesh: the world split once into pipeline, data and tensor groups.

``build_mesh(pp, tp)`` validates the degrees against the world size *before* any group is made
(a degree that does not divide the world is one line naming the numbers), creates every group
through :func:`new_group` and records the result as the current mesh (:func:`get_mesh`). Every
layer then receives the group it works on: ZeRO the ``dp_group``, tensor-parallel layers the
``tp_group``, the pipeline the ``pp_group``. Nothing should read the global world size to mean
"my data-parallel degree".

Decisions:

* Rank layout is DeepSpeed's / Megatron's: axes ``["pipe", "data", "model"]`` in row-major order,
  so tensor-parallel ranks are adjacent (tp fastest, then dp, then pp):
  ``rank = (pp_rank * dp + dp_rank) * tp + tp_rank``. With pp=1, tp=2 at world 4 the tp groups are
  [0, 1], [2, 3] and the dp groups [0, 2], [1, 3]. The arithmetic is
  :class:`zerospeed.comm.topology.ProcessTopology` (shared with the pipeline's grid).
* ``new_group`` is collective over the whole world, so every rank creates every group of every
  axis in one fixed order (pipe, data, model). A group that spans the whole world is the default
  group itself (``dist.group.WORLD``), which costs nothing to create.
* Without an initialised process group the mesh is the trivial 1x1x1 one with ``None`` groups
  (the collectives in :mod:`zerospeed.comm.collectives` treat ``None`` as the world of one).
* ``from_mpu`` wraps a Megatron-style mpu (``get_model_parallel_*``/``get_data_parallel_*``,
  optionally ``get_pipe_parallel_*``); its groups are used as given, its sizes checked against the
  world size. A :class:`Mesh` answers the same mpu methods, so it can be handed to code that
  expects an mpu.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch.distributed as dist

from zerospeed.comm.dist import get_rank, get_world_size, is_initialized
from zerospeed.comm.topology import ProcessTopology

__all__ = ["AXES", "Mesh", "MeshError", "build_mesh", "from_mpu", "get_mesh", "new_group", "reset_mesh", "set_mesh",
           "validate_degrees"]

#: Axis names of the grid, slowest first (DeepSpeed's PipeModelDataParallelTopology order).
AXES = ("pipe", "data", "model")

_CURRENT: Mesh | None = None


class MeshError(ValueError):
    """The requested degrees (or the mpu's groups) do not fit the world; the message names the numbers."""


def new_group(ranks: Sequence[int], backend: str | None = None) -> Any:
    """A process group over ``ranks`` (collective: every rank of the world must call it, in the same order).

    A group spanning the whole world is the default group (no new communicator).
    """
    ranks = sorted(int(r) for r in ranks)
    if not is_initialized():
        if ranks != [0]:
            raise MeshError(f"new_group: ranks {ranks} without an initialised process group (world of 1)")
        return None
    if ranks == list(range(dist.get_world_size())) and backend is None:
        return dist.group.WORLD
    return dist.new_group(ranks=ranks, backend=backend)


def _degree(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MeshError(f"{name}: must be a positive int, got {value!r}")
    return value


def validate_degrees(world_size: int, pp: int = 1, tp: int = 1, dp: int | None = None) -> tuple[int, int, int]:
    """``(pp, dp, tp)`` for ``world_size``: pp * tp must divide it (dp is the quotient, or must equal it)."""
    pp, tp = _degree("pipeline degree pp", pp), _degree("tensor-parallel degree tp", tp)
    if world_size % (pp * tp):
        raise MeshError(f"mesh: world size {world_size} is not divisible by pp={pp} x tp={tp} = {pp * tp}")
    quotient = world_size // (pp * tp)
    if dp is not None and _degree("data-parallel degree dp", dp) != quotient:
        raise MeshError(f"mesh: pp={pp} x dp={dp} x tp={tp} = {pp * dp * tp} does not equal the world size "
                        f"{world_size}")
    return pp, quotient, tp


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the (pp, dp, tp) grid and the three groups it belongs to."""

    pp_size: int
    dp_size: int
    tp_size: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    pp_group: Any = field(repr=False, compare=False)
    dp_group: Any = field(repr=False, compare=False)
    tp_group: Any = field(repr=False, compare=False)
    rank: int = 0
    topology: ProcessTopology | None = field(default=None, repr=False, compare=False)

    @property
    def world_size(self) -> int:
        return self.pp_size * self.dp_size * self.tp_size

    @property
    def degrees(self) -> tuple[int, int, int]:
        """``(pp, dp, tp)``."""
        return self.pp_size, self.dp_size, self.tp_size

    def group_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis`` (``"pipe"``, ``"data"`` or ``"model"``)."""
        group = {"pipe": self.pp_group, "data": self.dp_group, "model": self.tp_group}.get(axis, ...)
        if group is ...:
            raise MeshError(f"axis: {axis!r} is not one of {list(AXES)}")
        if group is None:
            return [self.rank]
        return list(dist.get_process_group_ranks(group))

    def tp_src_rank(self) -> int:
        """Global rank of tensor-parallel rank 0 in this rank's tp group (the broadcast source)."""
        return self.group_ranks("model")[0]

    # -- Megatron-style mpu interface (DeepSpeed's engine reads these) ----------------------------
    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_model_parallel_group(self) -> Any:
        return self.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    def get_pipe_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.pp_size

    def get_pipe_parallel_group(self) -> Any:
        return self.pp_group


def build_mesh(pp: int = 1, tp: int = 1, dp: int | None = None) -> Mesh:
    """Split the world into the (pp, dp, tp) grid, create its groups and make it the current mesh.

    Collective: every rank must call it with the same degrees. Raises :class:`MeshError` (before
    creating any group) when ``pp * tp`` does not divide the world size, or ``dp`` is given and
    ``pp * dp * tp`` is not the world size.
    """
    world = get_world_size()
    pp, dp, tp = validate_degrees(world, pp=pp, tp=tp, dp=dp)
    topo = ProcessTopology(list(AXES), [pp, dp, tp])
    rank = get_rank()
    coord = topo.get_coord(rank)
    groups: dict[str, Any] = {}
    for axis in AXES:  # fixed order on every rank: new_group is collective
        for ranks in topo.get_axis_comm_lists(axis):
            group = new_group(ranks)
            if rank in ranks:
                groups[axis] = group
    mesh = Mesh(pp_size=pp, dp_size=dp, tp_size=tp, pp_rank=coord.pipe, dp_rank=coord.data, tp_rank=coord.model,
                pp_group=groups["pipe"], dp_group=groups["data"], tp_group=groups["model"], rank=rank, topology=topo)
    set_mesh(mesh)
    return mesh


def _mpu_call(mpu: Any, names: tuple[str, ...], default: Any = ...) -> Any:
    for name in names:
        method = getattr(mpu, name, None)
        if callable(method):
            return method()
    if default is ...:
        raise MeshError(f"mpu: {type(mpu).__name__} has none of {', '.join(names)}()")
    return default


def from_mpu(mpu: Any) -> Mesh:
    """The mesh a Megatron-style ``mpu`` describes (its groups used as they are); becomes the current mesh."""
    if isinstance(mpu, Mesh):
        set_mesh(mpu)
        return mpu
    tp_group = _mpu_call(mpu, ("get_tensor_model_parallel_group", "get_model_parallel_group"))
    dp_group = _mpu_call(mpu, ("get_data_parallel_group",))
    tp_size = int(_mpu_call(mpu, ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size")))
    tp_rank = int(_mpu_call(mpu, ("get_tensor_model_parallel_rank", "get_model_parallel_rank")))
    dp_size = get_world_size(dp_group) if is_initialized() else 1
    dp_rank = get_rank(dp_group) if is_initialized() else 0
    pp_group = _mpu_call(mpu, ("get_pipeline_model_parallel_group", "get_pipe_parallel_group"), None)
    pp_size = int(_mpu_call(mpu, ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size"), 1))
    pp_rank = int(_mpu_call(mpu, ("get_pipeline_model_parallel_rank", "get_pipe_parallel_rank"), 0))
    world = get_world_size()
    if pp_size * dp_size * tp_size != world:
        raise MeshError(f"mpu: pp={pp_size} x dp={dp_size} x tp={tp_size} = {pp_size * dp_size * tp_size} does not "
                        f"equal the world size {world}")
    if is_initialized() and tp_group is not None and get_world_size(tp_group) != tp_size:
        raise MeshError(f"mpu: model-parallel world size {tp_size} but its group has {get_world_size(tp_group)} ranks")
    if not 0 <= tp_rank < tp_size:
        raise MeshError(f"mpu: model-parallel rank {tp_rank} outside [0, {tp_size})")
    if pp_group is None and pp_size == 1:
        pp_group = _self_group()
    mesh = Mesh(pp_size=pp_size, dp_size=dp_size, tp_size=tp_size, pp_rank=pp_rank, dp_rank=dp_rank, tp_rank=tp_rank,
                pp_group=pp_group, dp_group=dp_group, tp_group=tp_group, rank=get_rank())
    set_mesh(mesh)
    return mesh


def _self_group() -> Any:
    """A group of this rank alone (collective: every rank creates every single-rank group)."""
    if not is_initialized():
        return None
    mine = None
    for r in range(dist.get_world_size()):
        group = new_group([r])
        if r == dist.get_rank():
            mine = group
    return mine


def get_mesh() -> Mesh | None:
    """The current mesh (the last one built or set), or None."""
    return _CURRENT


def set_mesh(mesh: Mesh | None) -> None:
    global _CURRENT
    _CURRENT = mesh


def reset_mesh() -> None:
    """Forget the current mesh (tests; a new world)."""
    set_mesh(None)
