"""Reused transient gradient buffers (``zero/grad_buffer_pool.py``) at ZeRO stages 2 and 3.

The pool hands out a buffer that an earlier micro-step filled, so it must be zero wherever this micro-step
writes nothing: a parameter without a gradient (here the micro-batches use head a, both heads, head b, in turn,
so a buffer that held a head's gradient serves a head that gets none) and the padding. The engine tests train 2
ranks with gradient accumulation 2 and small buckets (pooled here whatever their size), pool on and off, and
need bit-identical losses and weights (the same sums in the same order), and at least one reuse per micro-step
after the first.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from torch import nn

from zerospeed.testing import run_distributed
from zerospeed.zero.grad_buffer_pool import GradBufferPool, pool_enabled


def test_reuse_is_zeroed_best_fit_and_bounded_by_the_peak() -> None:
    pool = GradBufferPool(enabled=True, min_bytes=0)
    a, b = pool.zeros(100, torch.float32, "cpu"), pool.zeros(50, torch.float32, "cpu")
    peak = pool.limit_bytes
    assert peak == 600
    a.fill_(3.0)
    b.fill_(4.0)
    first = a.data_ptr()
    pool.give_back(a)
    pool.give_back(b)
    assert pool.kept_bytes() == 600
    c = pool.zeros(60, torch.float32, "cpu")  # the smallest free buffer that is large enough: a's
    assert c.data_ptr() == first and c.numel() == 60 and torch.equal(c, torch.zeros(60))
    d = pool.zeros(50, torch.float32, "cpu")
    assert torch.equal(d, torch.zeros(50)) and pool.reused == 2
    assert pool.zeros(50, torch.float64, "cpu").dtype == torch.float64 and pool.reused == 2  # no dtype mix
    pool.give_back(torch.ones(10))  # not the pool's: ignored
    pool.give_back(c)
    pool.give_back(d)
    assert pool.kept_bytes() <= pool.limit_bytes


def test_disabled_pool_allocates_fresh_buffers_and_the_switch_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    small = GradBufferPool(enabled=True)  # below MIN_POOLED_BYTES: fresh buffers, nothing kept
    buf = small.zeros(1000, torch.float32, "cpu")
    small.give_back(buf)
    assert small.kept_bytes() == 0 and small.limit_bytes == 0
    pool = GradBufferPool(enabled=False, min_bytes=0)
    a = pool.zeros(8, torch.float32, "cpu")
    pool.give_back(a)
    assert pool.kept_bytes() == 0 and pool.zeros(8, torch.float32, "cpu").data_ptr() != 0 and pool.reused == 0
    monkeypatch.setenv("ZEROSPEED_GRAD_BUFFER_POOL", "0")
    assert not pool_enabled()
    monkeypatch.setenv("ZEROSPEED_GRAD_BUFFER_POOL", "yes")
    with pytest.raises(ValueError, match="ZEROSPEED_GRAD_BUFFER_POOL: 'yes'"):
        GradBufferPool()


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head_a = nn.Linear(32, 4)
        self.head_b = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, heads: str) -> torch.Tensor:
        h = torch.relu(self.body(x))
        return sum(getattr(self, f"head_{name}")(h) for name in heads)


def _train(stage: int, pool: str) -> dict:
    import zerospeed
    import zerospeed.zero.grad_buffer_pool as pool_module

    os.environ["ZEROSPEED_GRAD_BUFFER_POOL"] = pool
    pool_module.MIN_POOLED_BYTES = 0  # this rank process only: pool the test's small buckets too
    torch.manual_seed(0)
    model = _TwoHeads()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 200,
                                 "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = zerospeed.initialize(model=model, config=cfg)
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for micro in range(8):  # 4 optimizer steps; a head without a gradient, then both, then the other one alone
        x, y = torch.randn(2, 16, generator=gen), torch.randn(2, 4, generator=gen)
        loss = (engine(x, ("a", "ab", "b")[micro % 3]) - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    reducer = engine.strategy.reducer
    params = list(engine.module.parameters())
    with zerospeed.zero.GatheredParameters(params) if stage == 3 else contextlib.nullcontext():
        weights = [p.detach().clone() for p in engine.module.parameters()]
    return {"losses": losses, "weights": weights, "reused": reducer._pool.reused,
            "buckets": len(reducer.buckets)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [2, 3])
def test_pool_on_equals_pool_off_bit_for_bit(stage: int) -> None:
    on = run_distributed(_train, 2, stage, "1", timeout=200)
    off = run_distributed(_train, 2, stage, "0", timeout=200)
    for rank in range(2):
        assert on[rank]["buckets"] > 1
        assert on[rank]["losses"] == off[rank]["losses"]
        for w_on, w_off in zip(on[rank]["weights"], off[rank]["weights"], strict=True):
            assert torch.equal(w_on, w_off)
        assert off[rank]["reused"] == 0
        assert on[rank]["reused"] >= 7 * on[rank]["buckets"] // 2, on[rank]  # reused after the first micro-step
