"""Bucket planning and shard arithmetic, as pure data."""

import pytest

from zerospeed.zero.layout import plan_buckets


def _params(*shapes, groups=None):
    return [(f"p{i}", s, (groups or [0] * len(shapes))[i]) for i, s in enumerate(shapes)]


def test_buckets_respect_size_and_groups():
    buckets = plan_buckets(_params((10,), (7, 3), (5,), (40,), (2,), groups=[0, 0, 0, 1, 1]), 25, 1)
    # 10 + 21 > 25 -> p1 starts a new bucket; 21 + 5 > 25 -> p2 too; the group change splits p3.
    assert [[s.name for s in b.slots] for b in buckets] == [["p0"], ["p1"], ["p2"], ["p3"], ["p4"]]
    assert [b.group_index for b in buckets] == [0, 0, 0, 1, 1]


def test_interleaved_groups_fill_buckets_of_their_own():
    # weight / bias alternating between two optimizer groups (decay / no decay, Muon / Adam): each group
    # fills its own buckets rather than one bucket per run of a group (one collective per parameter)
    shapes = [(4, 4), (4,), (4, 4), (4,), (4, 4), (4,)]
    buckets = plan_buckets(_params(*shapes, groups=[0, 1, 0, 1, 0, 1]), 40, 1)
    assert [[s.name for s in b.slots] for b in buckets] == [["p0", "p2"], ["p4"], ["p1", "p3", "p5"]]
    assert [b.group_index for b in buckets] == [0, 0, 1]
    assert [[s.offset for s in b.slots] for b in buckets] == [[0, 16], [0], [0, 4, 8]]
    # ordered by when the last gradient of each bucket is ready (its last parameter's position)
    assert [b.slots[-1].index for b in buckets] == sorted(b.slots[-1].index for b in buckets)
    assert [b.index for b in buckets] == [0, 1, 2]


def test_oversized_parameter_gets_its_own_bucket():
    buckets = plan_buckets(_params((3,), (100,), (4,)), 10, 2)
    assert [[s.name for s in b.slots] for b in buckets] == [["p0"], ["p1"], ["p2"]]


def test_offsets_and_padding():
    (b,) = plan_buckets(_params((3,), (2, 2), (6,)), 1000, 4)
    assert [(s.offset, s.numel) for s in b.slots] == [(0, 3), (3, 4), (7, 6)]
    assert b.numel == 13 and b.padded_numel == 16 and b.shard_numel == 4
    assert [b.shard_range(r) for r in range(4)] == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_pieces_cover_every_parameter_exactly_once():
    (b,) = plan_buckets(_params((3,), (2, 2), (6,)), 1000, 4)
    covered = {}
    for r in range(4):
        for piece in b.pieces(r):
            lo, hi = b.shard_range(r)
            assert 0 <= piece.shard_start and piece.shard_start + piece.numel <= hi - lo
            for k in range(piece.numel):
                key = (piece.slot.name, piece.param_start + k)
                assert key not in covered
                covered[key] = r
    assert len(covered) == 13
    # p1 (offset 3, 4 elements) straddles ranks 0 and 1.
    assert covered[("p1", 0)] == 0 and covered[("p1", 1)] == 1


@pytest.mark.parametrize("bad", [dict(bucket_numel=0, world_size=1), dict(bucket_numel=5, world_size=0)])
def test_bad_arguments(bad):
    with pytest.raises(ValueError):
        plan_buckets(_params((3,)), **bad)
