"""Process grids for pipeline x data parallelism, with DeepSpeed's rank layout.

``ProcessTopology(axes, dims)`` maps Cartesian coordinates to global ranks in row-major order: the
*last* axis varies fastest. ``PipeTopology(num_pp, num_dp)`` (alias ``PipeDataParallelTopology``,
DeepSpeed's name) uses axes ``["pipe", "data"]`` as DeepSpeed does, so data-parallel replicas of a
stage have adjacent ranks (gradient all-reduce stays on the fast intra-node links) and
``rank = pipe_stage * num_dp + dp_rank``. With 2 stages x 2 replicas: stage 0 = ranks {0, 1},
stage 1 = ranks {2, 3}; pipe groups (one pipeline each) [[0, 2], [1, 3]]; data groups [[0, 1], [2, 3]].

Only rank arithmetic lives here; creating process groups from these lists is comm/'s job.
"""
from __future__ import annotations

import itertools
from collections import namedtuple
from collections.abc import Sequence
from typing import Any

__all__ = ["PipeDataParallelTopology", "PipeTopology", "ProcessTopology"]


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be a positive int, got {value!r}")
    return value


class ProcessTopology:
    """Row-major mapping between named coordinates and global ranks (DeepSpeed's method names)."""

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        axes = list(axes)
        dims = list(dims)
        if len(axes) != len(dims) or not axes:
            raise ValueError(f"axes: need one dim per axis, got axes={axes!r}, dims={dims!r}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"axes: names must be unique, got {axes!r}")
        for axis, dim in zip(axes, dims):
            _positive(f"dims[{axis}]", dim)
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)  # type: ignore[misc]
        self._coords = [self.ProcessCoord(*c) for c in itertools.product(*(range(d) for d in dims))]
        self._ranks = {coord: rank for rank, coord in enumerate(self._coords)}

    def world_size(self) -> int:
        return len(self._coords)

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        self._check_axis(axis)
        return self.dims[self.axes.index(axis)]

    def get_rank(self, **coord: int) -> int:
        if set(coord) != set(self.axes):
            raise ValueError(f"coord: give exactly the axes {self.axes}, got {sorted(coord)}")
        key = self.ProcessCoord(**coord)
        if key not in self._ranks:
            raise ValueError(f"coord: {coord} is outside dims {dict(zip(self.axes, self.dims))}")
        return self._ranks[key]

    def get_coord(self, rank: int) -> Any:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(self._coords):
            raise ValueError(f"rank: must be in [0, {len(self._coords)}), got {rank!r}")
        return self._coords[rank]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Global ranks whose coordinate on ``axis`` is ``idx``."""
        position = self._axis_index(axis)
        return [rank for rank, coord in enumerate(self._coords) if coord[position] == idx]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """Rank lists of the groups that communicate along ``axis`` (all other coordinates fixed)."""
        position = self._axis_index(axis)
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, coord in enumerate(self._coords):
            rest = tuple(c for i, c in enumerate(coord) if i != position)
            groups.setdefault(rest, []).append(rank)
        return [groups[key] for key in sorted(groups)]

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Ranks whose coordinates match every given ``axis=value``."""
        for axis in filter_kwargs:
            self._check_axis(axis)
        return [rank for rank, coord in enumerate(self._coords)
                if all(getattr(coord, axis) == value for axis, value in filter_kwargs.items())]

    def _check_axis(self, axis: str) -> None:
        if axis not in self.axes:
            raise ValueError(f"axis: {axis!r} is not one of {self.axes}")

    def _axis_index(self, axis: str) -> int:
        self._check_axis(axis)
        return self.axes.index(axis)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(zip(self.axes, self.dims))})"


class PipeTopology(ProcessTopology):
    """Pipeline x data-parallel grid, axes ``["pipe", "data"]`` (data fastest)."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        dims = [_positive("num_pp", num_pp), _positive("num_dp", num_dp)]
        super().__init__(axes=["pipe", "data"], dims=dims)

    @classmethod
    def from_world_size(cls, world_size: int, num_pp: int) -> PipeTopology:
        """The grid with ``num_pp`` stages and ``world_size // num_pp`` data-parallel replicas."""
        _positive("world_size", world_size)
        _positive("num_pp", num_pp)
        if world_size % num_pp:
            raise ValueError(f"num_pp: world size {world_size} is not divisible by {num_pp} pipeline stages")
        return cls(num_pp, world_size // num_pp)

    @property
    def num_pp(self) -> int:
        return self.dims[0]

    @property
    def num_dp(self) -> int:
        return self.dims[1]

    def stage_of(self, rank: int) -> int:
        return self.get_coord(rank).pipe

    def dp_rank_of(self, rank: int) -> int:
        return self.get_coord(rank).data

    def pipe_groups(self) -> list[list[int]]:
        """One list per pipeline (fixed data index), ordered by stage: ``[[0, dp, 2dp, ...], ...]``."""
        return self.get_axis_comm_lists("pipe")

    def data_groups(self) -> list[list[int]]:
        """One list per stage: the data-parallel replicas that all-reduce that stage's gradients."""
        return self.get_axis_comm_lists("data")


PipeDataParallelTopology = PipeTopology
