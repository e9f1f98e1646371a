"""ZeRO-3 pieces without processes: the bucket's gather / release cycle, shard contents, the trace,
prefetch and reuse decisions, construction detection for zero.Init, the config key, API errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerospeed.config import ConfigError, load_config
from zerospeed.zero.layout import plan_buckets
from zerospeed.zero.stage3.bucket import BucketState, Stage3Bucket
from zerospeed.zero.stage3.construction import modules_under_construction
from zerospeed.zero.stage3.prefetch import GatherTrace, TraceEvent, plan_prefetch


def _bucket(params: list[nn.Parameter], world: int = 1, rank: int = 0, **kw) -> Stage3Bucket:
    values = [p.detach().clone() for p in params]
    layout = plan_buckets([(f"p{i}", tuple(p.shape), 0) for i, p in enumerate(params)], 1 << 62, world)[0]
    return Stage3Bucket(layout, params, values, params[0].dtype, params[0].device, None, rank, "test", **kw)


# -- bucket ---------------------------------------------------------------------------------------
def test_bucket_partitions_gathers_and_frees_the_full_buffer():
    lin = nn.Linear(5, 3)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    bucket = _bucket([lin.weight, lin.bias])
    assert lin.weight.shape == (0,) and lin.bias.shape == (0,)  # empty placeholders between uses
    assert bucket.state is BucketState.RELEASED and bucket._full.untyped_storage().nbytes() == 0
    bucket.start_gather()
    bucket.finish_gather()
    assert torch.equal(lin.weight, w) and torch.equal(lin.bias, b)
    assert bucket._full.untyped_storage().nbytes() == bucket.full_bytes == 18 * 4
    out = lin(torch.ones(2, 5))
    assert torch.allclose(out, torch.ones(2, 5) @ w.t() + b)
    bucket.release()
    assert lin.weight.shape == (0,) and bucket._full.untyped_storage().nbytes() == 0


def test_saved_views_see_the_regathered_storage_in_backward():
    # F.linear saves weight.t(): a view of the full buffer's storage, freed on release, valid again
    # once the storage is re-gathered before backward.
    lin = nn.Linear(4, 3)
    ref = nn.Linear(4, 3)
    ref.load_state_dict(lin.state_dict())
    bucket = _bucket([lin.weight, lin.bias])
    bucket.start_gather()
    bucket.finish_gather()
    x = torch.randn(6, 4, requires_grad=True)
    y = lin(x)
    bucket.release()
    bucket.start_gather()
    bucket.finish_gather()
    y.square().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    ref(x2).square().sum().backward()
    assert torch.allclose(x.grad, x2.grad) and torch.allclose(lin.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_rank_shard_is_its_range_of_the_padded_flat_layout(world):
    torch.manual_seed(0)
    shapes = [(3, 5), (7,), (2, 2)]
    values = [torch.randn(s) for s in shapes]
    flat = torch.cat([v.reshape(-1) for v in values])
    padded = -(-flat.numel() // world) * world
    flat = torch.cat([flat, torch.zeros(padded - flat.numel())])
    for rank in range(world):
        params = [nn.Parameter(v.clone()) for v in values]
        b = _bucket(params, world=world, rank=rank)
        lo, hi = b.layout.shard_range(rank)
        assert torch.equal(b.shard, flat[lo:hi])


def test_adopt_user_writes_and_write_back_shard():
    p = nn.Parameter(torch.zeros(4, 2))
    b = _bucket([p], persistent=False)
    b.master = torch.zeros(8, dtype=torch.float32)
    b.start_gather()
    b.finish_gather()
    p.data = torch.full((4, 2), 3.0)  # user code replaced .data while gathered
    b.adopt_user_writes()
    b.write_back_shard()
    assert torch.equal(b.shard, torch.full((8,), 3.0)) and torch.equal(b.master, torch.full((8,), 3.0))
    with pytest.raises(ValueError, match="shape"):
        p.data = torch.zeros(3)
        b.adopt_user_writes()


def test_release_refuses_a_bucket_in_flight():
    b = _bucket([nn.Parameter(torch.ones(3))])
    b.start_gather()
    with pytest.raises(RuntimeError, match="in flight"):
        b.release()


# -- trace, prefetch and reuse --------------------------------------------------------------------
class _FakeBucket:
    def __init__(self, numel: int) -> None:
        self.padded_numel = numel
        self.state = BucketState.RELEASED


def _ev(i: int, phase: str = "forward", buckets: tuple[int, ...] | None = None) -> TraceEvent:
    return TraceEvent(i, phase, f"m{i}", buckets if buckets is not None else (i,))


def _recorded(events: list[TraceEvent], numels: list[int]) -> GatherTrace:
    t = GatherTrace()
    t.begin_pass()
    for e in events:
        assert t.observe(e) == "recorded"
    assert t.finish_backward(numels)
    return t


def test_trace_records_a_pass_with_backward_then_follows_it():
    events = [_ev(0), _ev(1), _ev(1, "backward"), _ev(0, "backward")]
    t = GatherTrace()
    t.begin_pass()
    t.observe(events[0])
    t.begin_pass()  # the previous pass had no backward (evaluation): recording starts over
    for e in events:
        t.observe(e)
    assert t.finish_backward([10, 20]) and t.complete
    t.begin_pass()
    assert [t.observe(e) for e in events] == ["match"] * 4
    t.begin_pass()
    assert t.observe(events[0]) == "match"
    assert t.expected() == events[1]
    assert t.observe(_ev(1, "backward")) == "mismatch"
    t.invalidate()
    assert t.observe(events[1]) == "off" and t.upcoming() == []
    t.begin_pass()  # records again
    assert t.observe(events[0]) == "recorded"


def test_reuse_distance_counts_elements_gathered_in_between():
    numels = [10, 20, 30]
    t = _recorded([_ev(0), _ev(1), _ev(2), _ev(2, "backward"), _ev(1, "backward"), _ev(0, "backward")], numels)
    t.begin_pass()
    t.observe(_ev(0))
    assert t.reuse_distance(0) == 20 + 30 + 30 + 20  # next used by its backward event
    t.observe(_ev(1))
    t.observe(_ev(2))
    assert t.reuse_distance(2) == 0  # its backward comes right after
    assert t.reuse_distance(1) == 30
    for e in [_ev(2, "backward"), _ev(1, "backward"), _ev(0, "backward")]:
        t.observe(e)
    assert t.reuse_distance(0) is None


def test_prefetch_stays_within_the_bucket_size_and_the_live_bound():
    buckets = [_FakeBucket(n) for n in (10, 20, 30, 40)]
    upcoming = [_ev(1), _ev(2), _ev(3), _ev(3, "backward")]
    assert plan_prefetch(upcoming, buckets, 50, 0, 10**9, True) == buckets[1:3]
    assert plan_prefetch(upcoming, buckets, 1000, 0, 10**9, True) == buckets[1:4]
    assert plan_prefetch(upcoming, buckets, 1000, 40, 90, True) == buckets[1:3]
    assert plan_prefetch(upcoming, buckets, 0, 0, 10**9, True) == []
    buckets[2].state = BucketState.GATHERED  # already there: skipped, costs nothing
    assert plan_prefetch(upcoming, buckets, 60, 0, 10**9, True) == [buckets[1], buckets[3]]
    assert plan_prefetch([_ev(1, "backward")], buckets, 100, 0, 10**9, allow_backward=False) == []


# -- zero.Init's construction detection ------------------------------------------------------------
class _Probe(nn.Module):
    seen: set[int] = set()

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(2, 2)
        _Probe.seen = modules_under_construction()


def test_modules_under_construction_sees_the_running_constructors_only():
    probe = _Probe()
    assert id(probe) in _Probe.seen and id(probe.child) not in _Probe.seen
    assert id(probe) not in modules_under_construction()


# -- configuration and API errors -----------------------------------------------------------------
def test_collective_timeout_config_key():
    base = {"train_batch_size": 8, "zero_optimization": {"stage": 3}}
    assert load_config(base).zero_optimization.stage3_collective_timeout_s == 600.0
    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": 3, "stage3_collective_timeout_s": 2.5}}
    assert load_config(cfg).zero_optimization.stage3_collective_timeout_s == 2.5
    for bad, fragment in ((-1, "must be >= 0"), ("soon", "not a number")):
        cfg["zero_optimization"]["stage3_collective_timeout_s"] = bad
        with pytest.raises(ConfigError) as info:
            load_config(cfg)
        assert info.value.key_path == "zero_optimization.stage3_collective_timeout_s"
        assert fragment in str(info.value)


def test_public_api_errors_and_no_ops():
    from zerospeed import zero

    lin = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="torch.nn.Parameter"):
        zero.register_external_parameter(lin, torch.zeros(2))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        zero.register_external_parameter("lin", lin.weight)
    with pytest.raises(ValueError, match="mpu"):
        zero.Init(mpu=object())
    with pytest.raises(ValueError, match="remote_device"):
        zero.Init(remote_device="nvme")
    before = lin.weight.detach().clone()
    with zero.GatheredParameters(lin.parameters(), modifier_rank=0):  # not partitioned: nothing to do
        assert lin.weight.shape == (2, 2)
    assert torch.equal(lin.weight, before) and not zero.is_partitioned(lin.weight)
    with zero.Init(enabled=False):
        assert nn.Linear(2, 2).weight.shape == (2, 2)
