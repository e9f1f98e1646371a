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

from zerospeed.comm.topology import ProcessTopology, _positive

__all__ = ["PipeDataParallelTopology", "PipeTopology", "ProcessTopology"]


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
