"""Rank arithmetic of a Cartesian process grid, DeepSpeed's ``ProcessTopology``.

``ProcessTopology(axes, dims)`` maps named coordinates to global ranks in row-major order: the
*last* axis varies fastest. It lives in comm/ because both the (pp, dp, tp) mesh
(:mod:`zerospeed.comm.mesh`) and the pipeline's grid (:mod:`zerospeed.pipe.topology`) use it.
Only arithmetic lives here: no process group is created.
"""
from __future__ import annotations

import itertools
from collections import namedtuple
from collections.abc import Sequence
from typing import Any

__all__ = ["MeshError", "ProcessTopology"]


class MeshError(ValueError):
    """The requested degrees (or the mpu's groups, or the launcher's host numbering) do not fit the world; the
    message names the numbers. Raised by :mod:`zerospeed.comm.mesh`, defined here below it."""


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
