"""The one mesh: the world split once into pipeline, data, sequence and tensor groups, with the
expert-parallel groups carved out of the data groups and the ranks grouped by host.

``build_mesh(pp, tp, sp=1)`` validates the degrees against the world size *before* any group is made
(a degree that does not divide the world is one line naming the numbers), reads the host grouping
from the launcher's environment (:mod:`zerospeed.comm.hosts`, validated too), creates every group
through :func:`new_group` and records the result as the current mesh (:func:`get_mesh`). Every
layer then receives the group it works on: ZeRO the ``dp_group``, tensor-parallel layers the
``tp_group``, the pipeline the ``pp_group`` and ``dp_group``, MoE layers and ZeRO's expert buckets
:meth:`Mesh.expert_groups`, hierarchical collectives :meth:`Mesh.host_groups`. Nothing should read the
global world size to mean "my data-parallel degree".

Decisions:

* Rank layout is DeepSpeed's / Megatron's: axes ``["pipe", "data", "sequence", "model"]`` in row-major
  order, so tensor-parallel ranks are adjacent (tp fastest, then sp, then dp, then pp):
  ``rank = ((pp_rank * dp + dp_rank) * sp + sp_rank) * tp + tp_rank``. With pp=1, tp=2 at world 4 the tp
  groups are [0, 1], [2, 3] and the dp groups [0, 2], [1, 3]. The arithmetic is
  :class:`zerospeed.comm.topology.ProcessTopology` (shared with the pipeline's grid). The sequence degree
  ``sp`` is 1 unless asked for (sequence parallelism itself is built elsewhere); at 1 the layout is
  the (pp, dp, tp) one.
* ``new_group`` is collective over the whole world, so every rank creates every group of every
  axis in one fixed order (pipe, data, sequence, model) when the mesh is built. A group that spans
  the whole world is the default group itself (``dist.group.WORLD``), which costs nothing to create.
* Expert parallelism is not an axis of the grid: DeepSpeed carves expert-parallel groups out of each
  data-parallel group, and a model may hold MoE layers of several ``ep_size``. :meth:`Mesh.expert_groups`
  builds them per size on first use (collective, as the MoE layers are built on every rank in one
  order) and checks that the size divides the dp degree (:mod:`zerospeed.comm.expert_groups`).
* Sequence parallelism (Ulysses) keeps the same weights on every rank of an sp group, so ZeRO shards and averages
  over the dp x sp ranks that share a (pp, tp) coordinate, as DeepSpeed's "sequence data parallel" group does:
  :attr:`Mesh.sp_dp_group` (the dp group itself when sp is 1; created with the axes by :func:`build_mesh`
  otherwise). The data loader still reads by dp rank, so the ranks of an sp group get the same samples.
* Hosts come from the launcher's environment (:mod:`zerospeed.comm.hosts`); their groups are made on
  first use of :meth:`Mesh.host_groups` (collective).
* Without an initialised process group the mesh is the trivial one with ``None`` groups (the
  collectives in :mod:`zerospeed.comm.collectives` treat ``None`` as the world of one).
* Plain data parallelism needs no mesh to be built: :func:`world_mesh` describes the world as one dp
  group (``dp_group`` None, the default group, as every collective reads it) and creates the
  single-rank groups of its other axes only if they are asked for. :func:`current_mesh` is the
  current mesh or that one; it is never made current itself.
* ``from_mpu`` wraps a Megatron-style mpu (``get_model_parallel_*``/``get_data_parallel_*``,
  optionally ``get_pipe_parallel_*``); its groups are used as given, its sizes checked against the
  world size. A :class:`Mesh` answers the same mpu methods, so it can be handed to code that
  expects an mpu.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch.distributed as dist

from zerospeed.comm.dist import get_rank, get_world_size, is_initialized
from zerospeed.comm.expert_groups import ExpertGroups, build_expert_groups, check_expert_degree
from zerospeed.comm.hosts import HostLayout, host_layout
from zerospeed.comm.topology import MeshError, ProcessTopology

__all__ = ["AXES", "Mesh", "MeshError", "build_mesh", "current_mesh", "from_mpu", "get_mesh", "has_subgroup",
           "new_group", "reset_mesh", "set_mesh", "subgroups", "validate_degrees", "world_mesh"]

#: Axis names of the grid, slowest first (DeepSpeed's PipeModelDataParallelTopology order, with the
#: sequence axis between data and model).
AXES = ("pipe", "data", "sequence", "model")

_CURRENT: Mesh | None = None
_UNSET: Any = object()  # a group not created yet (made on first use, collectively)
#: groups made for one purpose beside the axes (tied weights, the checkpoint's gloo copies), by
#: ``(purpose, ranks, backend)``; equal on every rank (the same creations in the same order), and dropped when
#: the default group changes (a process group destroyed and initialised again)
_SUBGROUPS: dict[tuple[str, tuple[int, ...], str | None], Any] = {}
_SUBGROUPS_WORLD: list[Any] = [None]


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


def subgroups(purpose: str, rank_lists: Sequence[Sequence[int]],
              backend: str | None = None) -> dict[tuple[int, ...], Any]:
    """A dedicated group (its own communicator, never the default group) for every list of ``rank_lists``,
    created on first use for ``purpose`` and returned from the cache after: ``{sorted ranks: group}``.

    Collective: every rank of the world must call it with the same lists in the same order (a group
    not yet made is created then, in that order; duplicates are created once). Without an initialised
    process group every group is None.
    """
    out: dict[tuple[int, ...], Any] = {}
    cache = _subgroup_cache()
    for ranks in rank_lists:
        key = tuple(sorted(int(r) for r in ranks))
        if key in out:
            continue
        if not is_initialized():
            out[key] = None
            continue
        slot = (purpose, key, backend)
        if slot not in cache:
            cache[slot] = dist.new_group(ranks=list(key), backend=backend)
        out[key] = cache[slot]
    return out


def has_subgroup(purpose: str, ranks: Sequence[int], backend: str | None = None) -> bool:
    """Whether :func:`subgroups` already made the group over ``ranks`` for ``purpose`` (local, not collective)."""
    return (purpose, tuple(sorted(int(r) for r in ranks)), backend) in _subgroup_cache()


def _subgroup_cache() -> dict[tuple[str, tuple[int, ...], str | None], Any]:
    if is_initialized() and dist.group.WORLD is not _SUBGROUPS_WORLD[0]:  # a new world: the old groups are gone
        _SUBGROUPS.clear()
        _SUBGROUPS_WORLD[0] = dist.group.WORLD
    return _SUBGROUPS


def _degree(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MeshError(f"{name}: must be a positive int, got {value!r}")
    return value


def _validate(world_size: int, pp: int, tp: int, dp: int | None, sp: int) -> tuple[int, int, int, int]:
    """``(pp, dp, sp, tp)`` for ``world_size`` (see :func:`validate_degrees`)."""
    pp, tp = _degree("pipeline degree pp", pp), _degree("tensor-parallel degree tp", tp)
    sp = _degree("sequence-parallel degree sp", sp)
    fixed = pp * sp * tp
    named = f"pp={pp} x sp={sp} x tp={tp}" if sp != 1 else f"pp={pp} x tp={tp}"
    if world_size % fixed:
        raise MeshError(f"mesh: world size {world_size} is not divisible by {named} = {fixed}")
    quotient = world_size // fixed
    if dp is not None and _degree("data-parallel degree dp", dp) != quotient:
        product = f"pp={pp} x dp={dp}" + (f" x sp={sp}" if sp != 1 else "") + f" x tp={tp}"
        raise MeshError(f"mesh: {product} = {fixed * dp} does not equal the world size {world_size}")
    return pp, quotient, sp, tp


def validate_degrees(world_size: int, pp: int = 1, tp: int = 1, dp: int | None = None, *,
                     sp: int = 1) -> tuple[int, int, int]:
    """``(pp, dp, tp)`` for ``world_size``: pp * sp * tp must divide it (dp is the quotient, or must equal it)."""
    pp, dp, _, tp = _validate(world_size, pp, tp, dp, sp)
    return pp, dp, tp


class Mesh:
    """This rank's place in the (pp, dp, sp, tp) grid, the groups it belongs to, its expert groups and host."""

    def __init__(self, pp_size: int, dp_size: int, tp_size: int, pp_rank: int, dp_rank: int, tp_rank: int,
                 pp_group: Any = _UNSET, dp_group: Any = _UNSET, tp_group: Any = _UNSET, rank: int = 0,
                 topology: ProcessTopology | None = None, sp_size: int = 1, sp_rank: int = 0, sp_group: Any = _UNSET,
                 hosts: HostLayout | None = None) -> None:
        self.pp_size, self.dp_size, self.sp_size, self.tp_size = pp_size, dp_size, sp_size, tp_size
        self.pp_rank, self.dp_rank, self.sp_rank, self.tp_rank = pp_rank, dp_rank, sp_rank, tp_rank
        self.rank = rank
        self.topology = topology
        self._groups = {"pipe": pp_group, "data": dp_group, "sequence": sp_group, "model": tp_group}
        self._sp_dp_group: Any = _UNSET
        self._hosts = hosts
        self._host_groups: tuple[Any, Any] | None = None

    # -- groups ------------------------------------------------------------------------------------
    def _group(self, axis: str) -> Any:
        group = self._groups[axis]
        if group is _UNSET:  # made on first use, on every rank (collective)
            group = self._groups[axis] = self._make_axis(axis)
        return group

    def _make_axis(self, axis: str) -> Any:
        if self.topology is None:  # an mpu's mesh: only the axes it did not give, which have one rank
            return _self_group()
        mine = None
        for ranks in self.topology.get_axis_comm_lists(axis):
            group = new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    @property
    def pp_group(self) -> Any:
        return self._group("pipe")

    @property
    def dp_group(self) -> Any:
        return self._group("data")

    @property
    def sp_group(self) -> Any:
        return self._group("sequence")

    @property
    def tp_group(self) -> Any:
        return self._group("model")

    @property
    def sp_dp_group(self) -> Any:
        """The dp x sp ranks sharing this rank's (pp, tp) coordinate: the group ZeRO shards over and averages
        gradients over (the dp group when sp is 1). Made on first use on every rank (collective)."""
        if self.sp_size == 1:
            return self.dp_group
        if self._sp_dp_group is _UNSET:
            mine = None
            for ranks in self.sp_dp_rank_lists():
                group = new_group(ranks)
                if self.rank in ranks:
                    mine = group
            self._sp_dp_group = mine
        return self._sp_dp_group

    def sp_dp_rank_lists(self) -> list[list[int]]:
        """Global ranks of every dp x sp group (one per (pp, tp) coordinate), in creation order."""
        if self.topology is None:
            if self.sp_size != 1:
                raise MeshError("mesh: an mpu's mesh has no sequence axis")
            return [self.group_ranks("data")]
        lists: dict[tuple[int, int], list[int]] = {}
        for rank in range(self.world_size):
            coord = self.topology.get_coord(rank)
            lists.setdefault((coord.pipe, coord.model), []).append(rank)
        return [lists[key] for key in sorted(lists)]

    @property
    def sp_dp_size(self) -> int:
        return self.dp_size * self.sp_size

    @property
    def sp_dp_rank(self) -> int:
        """This rank's place in :attr:`sp_dp_group` (dp-major: ``dp_rank * sp + sp_rank``)."""
        return self.dp_rank * self.sp_size + self.sp_rank

    @property
    def world_size(self) -> int:
        return self.pp_size * self.dp_size * self.sp_size * self.tp_size

    @property
    def degrees(self) -> tuple[int, int, int]:
        """``(pp, dp, tp)``."""
        return self.pp_size, self.dp_size, self.tp_size

    @property
    def sizes(self) -> dict[str, int]:
        """Every dimension: ``{"pp", "dp", "sp", "tp", "hosts"}`` (expert groups are per ``ep_size``)."""
        return {"pp": self.pp_size, "dp": self.dp_size, "sp": self.sp_size, "tp": self.tp_size,
                "hosts": self.hosts.num_hosts}

    def group_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis`` (``"pipe"``, ``"data"``, ``"sequence"`` or ``"model"``)."""
        if axis not in AXES:
            raise MeshError(f"axis: {axis!r} is not one of {list(AXES)}")
        if self.topology is not None:
            return next(list(r) for r in self.topology.get_axis_comm_lists(axis) if self.rank in r)
        group = self._group(axis)
        if group is None:
            return [self.rank]
        return list(dist.get_process_group_ranks(group))

    def axis_groups(self, axis: str) -> list[list[int]]:
        """Global ranks of every group along ``axis`` (every mesh slice), in the order the groups are created."""
        if self.topology is None:
            return [self.group_ranks(axis)]
        return [list(r) for r in self.topology.get_axis_comm_lists(axis)]

    def tp_src_rank(self) -> int:
        """Global rank of tensor-parallel rank 0 in this rank's tp group (the broadcast source)."""
        return self.group_ranks("model")[0]

    # -- expert parallelism ------------------------------------------------------------------------
    def expert_groups(self, ep_size: int) -> ExpertGroups:
        """The expert-parallel and expert-data-parallel groups for ``ep_size`` (carved out of the dp groups;
        created on first use of this size, collective). ``ep_size`` must divide the dp degree."""
        dp_ranks = self.group_ranks("data") if is_initialized() else list(range(get_world_size()))
        check_expert_degree(ep_size, len(dp_ranks))
        all_dp = self.axis_groups("data") if self.topology is not None else [dp_ranks]
        return build_expert_groups(ep_size, dp_ranks, all_dp, get_rank(), new_group if is_initialized() else None)

    def validate_expert_degree(self, ep_size: int) -> None:
        """Raise (the MoE layer's message) when ``ep_size`` does not divide the dp degree."""
        check_expert_degree(ep_size, self.dp_size)

    # -- hosts -------------------------------------------------------------------------------------
    @property
    def hosts(self) -> HostLayout:
        """The world's ranks by host and this rank's host (from the launcher's environment)."""
        if self._hosts is None:
            self._hosts = host_layout(get_world_size(), get_rank())
        return self._hosts

    def host_groups(self) -> tuple[Any, Any]:
        """``(intra-host group, inter-host group)`` of this rank: the ranks on its host, and the ranks at its
        position on every host (created on first use, collective: every rank creates every host's groups)."""
        if self._host_groups is None:
            layout = self.hosts
            intra = inter = None
            for ranks in layout.hosts:
                group = new_group(list(ranks))
                if self.rank in ranks:
                    intra = group
            for position in range(layout.ranks_per_host):
                ranks = [host[position] for host in layout.hosts]
                group = new_group(ranks)
                if self.rank in ranks:
                    inter = group
            self._host_groups = (intra, inter)
        return self._host_groups

    # -- groups beside the axes --------------------------------------------------------------------
    def subgroups(self, purpose: str, rank_lists: Sequence[Sequence[int]],
                  backend: str | None = None) -> dict[tuple[int, ...], Any]:
        """Create-or-return a dedicated group per rank list for ``purpose`` (the pipeline's tied weights, the
        checkpoint saver's gloo copies of the dp groups): see :func:`subgroups` (collective, same order everywhere)."""
        return subgroups(purpose, rank_lists, backend)

    def has_subgroup(self, purpose: str, ranks: Sequence[int], backend: str | None = None) -> bool:
        """Whether :meth:`subgroups` already made the group over ``ranks`` for ``purpose`` (local, not collective)."""
        return has_subgroup(purpose, ranks, backend)

    # -- value semantics (what the frozen dataclass it was gave) --------------------------------------
    def _key(self) -> tuple[int, ...]:
        return (self.pp_size, self.dp_size, self.sp_size, self.tp_size, self.pp_rank, self.dp_rank, self.sp_rank,
                self.tp_rank, self.rank)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"Mesh(pp_size={self.pp_size}, dp_size={self.dp_size}, sp_size={self.sp_size}, "
                f"tp_size={self.tp_size}, pp_rank={self.pp_rank}, dp_rank={self.dp_rank}, sp_rank={self.sp_rank}, "
                f"tp_rank={self.tp_rank}, rank={self.rank})")

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

    def get_sequence_parallel_rank(self) -> int:
        return self.sp_rank

    def get_sequence_parallel_world_size(self) -> int:
        return self.sp_size

    def get_sequence_parallel_group(self) -> Any:
        return self.sp_group

    def get_sequence_data_parallel_rank(self) -> int:
        return self.sp_dp_rank

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.sp_dp_size

    def get_sequence_data_parallel_group(self) -> Any:
        return self.sp_dp_group


def build_mesh(pp: int = 1, tp: int = 1, dp: int | None = None, *, sp: int = 1, current: bool = True) -> Mesh:
    """Split the world into the (pp, dp, sp, tp) grid, create its groups and make it the current mesh.

    Collective: every rank must call it with the same degrees. Raises :class:`MeshError` (before
    creating any group) when ``pp * sp * tp`` does not divide the world size, ``dp`` is given and
    ``pp * dp * sp * tp`` is not the world size, or the launcher's host numbering does not fit the world.
    ``current=False`` builds the mesh without making it the current one (the pipeline engine's own grid
    when no mesh was asked for).
    """
    world = get_world_size()
    pp, dp, sp, tp = _validate(world, pp, tp, dp, sp)
    rank = get_rank()
    hosts = host_layout(world, rank)
    topo = ProcessTopology(list(AXES), [pp, dp, sp, tp])
    coord = topo.get_coord(rank)
    mesh = Mesh(pp_size=pp, dp_size=dp, tp_size=tp, pp_rank=coord.pipe, dp_rank=coord.data, tp_rank=coord.model,
                rank=rank, topology=topo, sp_size=sp, sp_rank=coord.sequence, hosts=hosts)
    for axis in AXES:  # fixed order on every rank: new_group is collective
        mesh._group(axis)
    mesh.sp_dp_group  # noqa: B018  (made now, after the axes, in the same order on every rank)
    if current:
        set_mesh(mesh)
    return mesh


def world_mesh() -> Mesh:
    """The world as plain data parallelism (pp = sp = tp = 1, dp = world), with no group created: its
    ``dp_group`` is the default group (None), its other groups have one rank and are made if asked for."""
    world, rank = get_world_size(), get_rank()
    topo = ProcessTopology(list(AXES), [1, world, 1, 1])
    return Mesh(pp_size=1, dp_size=world, tp_size=1, pp_rank=0, dp_rank=rank, tp_rank=0, dp_group=None, rank=rank,
                topology=topo)


def current_mesh() -> Mesh:
    """The current mesh, or :func:`world_mesh` when none was built (it is not made current)."""
    mesh = get_mesh()
    return mesh if mesh is not None else world_mesh()


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
