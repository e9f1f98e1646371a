"""Pure-data plan of gradient buckets and their shards (no tensors, no processes).

A *bucket* is a run of trainable parameters, in the order their gradients become ready (reverse
registration order, as autograd produces them), laid out back to back in one flat buffer. A
bucket is the unit of every collective: one all-reduce (stage 0), one reduce-scatter (stages 1-2)
and one all-gather of updated parameters (stages 1-2) per bucket per step.

Sharding follows the bucket (as FSDP shards each flat parameter): a bucket's flat length is padded
to a multiple of the data-parallel world size N and rank r owns the contiguous range
``[r * L/N, (r+1) * L/N)`` of it. A parameter can straddle ranks; :meth:`BucketLayout.pieces`
says which part of which parameter each rank owns, which is how checkpoints address sharded state
by parameter name and global offset.

Buckets never mix optimizer parameter groups (each group has its own lr / weight decay), and a
parameter larger than the bucket size gets a bucket of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside its bucket's flat buffer."""

    name: str
    index: int  # position in the list of trainable parameters given to plan_buckets
    offset: int  # first element within the bucket
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that one rank's shard holds."""

    slot: ParamSlot
    param_start: int  # first element within the (flattened) parameter
    shard_start: int  # first element within the rank's shard
    numel: int


@dataclass(frozen=True)
class BucketLayout:
    index: int
    group_index: int
    slots: tuple[ParamSlot, ...]
    numel: int  # elements actually used by parameters
    padded_numel: int  # numel rounded up to a multiple of world_size
    world_size: int

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def pieces(self, rank: int) -> list[ShardPiece]:
        """The parameter pieces inside ``rank``'s shard, in order."""
        lo, hi = self.shard_range(rank)
        out = []
        for slot in self.slots:
            start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < end:
                out.append(ShardPiece(slot, start - slot.offset, start - lo, end - start))
        return out


def plan_buckets(
    params: Sequence[tuple[str, tuple[int, ...], int]],
    bucket_numel: int,
    world_size: int,
    group_world: dict[int, int] | None = None,
) -> list[BucketLayout]:
    """Group ``(name, shape, group_index)`` entries, given in gradient-ready order, into buckets.

    A new bucket starts when the optimizer group changes or when adding the next parameter would
    exceed ``bucket_numel`` elements (a larger parameter gets a bucket of its own).
    ``group_world`` overrides the sharding world size of some optimizer groups (expert parameters
    of a mixture-of-experts layer are sharded over their expert-data-parallel group).
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket size must be >= 1 element, got {bucket_numel}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    buckets: list[BucketLayout] = []
    current: list[ParamSlot] = []
    current_group = -1
    used = 0

    def close() -> None:
        nonlocal current, used
        if current:
            world = (group_world or {}).get(current_group, world_size)
            padded = -(-used // world) * world
            buckets.append(BucketLayout(len(buckets), current_group, tuple(current), used, padded, world))
        current, used = [], 0

    for index, (name, shape, group_index) in enumerate(params):
        numel = 1
        for dim in shape:
            numel *= dim
        if current and (group_index != current_group or used + numel > bucket_numel):
            close()
        current_group = group_index
        current.append(ParamSlot(name, index, used, numel, tuple(shape)))
        used += numel
    close()
    return buckets
