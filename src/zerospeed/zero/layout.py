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
parameter larger than the bucket size gets a bucket of its own. A bucket is a run of its *group's*
parameters in that order, so with interleaved groups its parameters need not be adjacent.
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

    Each optimizer group fills buckets of its own: a parameter joins the open bucket of its group,
    which closes when adding it would exceed ``bucket_numel`` elements (a larger parameter gets a
    bucket of its own). Groups that interleave in the order (weight / bias groups with and without
    weight decay, Muon's matrices and its Adam vectors) therefore still make buckets of
    ``bucket_numel`` elements instead of one bucket per run of a group, which cost one collective
    per parameter. The buckets are ordered by their last parameter's position, i.e. by when their
    last gradient becomes ready, which is the order the reducer launches them in.
    ``group_world`` overrides the sharding world size of some optimizer groups (expert parameters
    of a mixture-of-experts layer are sharded over their expert-data-parallel group).
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket size must be >= 1 element, got {bucket_numel}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    closed: list[tuple[int, list[ParamSlot], int, int]] = []  # (last index, slots, used, group)
    open_: dict[int, tuple[list[ParamSlot], int]] = {}  # group -> (slots, used)

    def close(group_index: int) -> None:
        slots, used = open_.pop(group_index)
        closed.append((slots[-1].index, slots, used, group_index))

    for index, (name, shape, group_index) in enumerate(params):
        numel = 1
        for dim in shape:
            numel *= dim
        if group_index in open_ and open_[group_index][1] + numel > bucket_numel:
            close(group_index)
        slots, used = open_.get(group_index, ([], 0))
        slots.append(ParamSlot(name, index, used, numel, tuple(shape)))
        open_[group_index] = (slots, used + numel)
    for group_index in list(open_):
        close(group_index)
    buckets: list[BucketLayout] = []
    for _, slots, used, group_index in sorted(closed, key=lambda c: c[0]):
        world = (group_world or {}).get(group_index, world_size)
        padded = -(-used // world) * world
        buckets.append(BucketLayout(len(buckets), group_index, tuple(slots), used, padded, world))
    return buckets
