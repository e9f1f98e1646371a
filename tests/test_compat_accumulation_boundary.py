"""DeepSpeed's manual accumulation boundary, ``engine.set_gradient_accumulation_boundary`` (issue #27).

DeepSpeed 0.19.8 (``runtime/engine.py``): the value set is sticky until set again and replaces the micro-step counter
in ``is_gradient_accumulation_boundary()``; ``backward`` still divides the loss by ``gradient_accumulation_steps``
(by 1 when it is 1); while the boundary is False the ZeRO-0/1 all-reduce / reduce-scatter is skipped (stages 2-3
reduce every micro-batch into their shards) and ``step()`` only counts the micro-batch; at True the accumulated
gradient is reduced and the optimizer steps. Its own unit tests (``test_zero2_offload_multi_backward.py``,
``test_zero.py``) drive it so with ``gradient_accumulation_steps: 1`` and one ``step()`` per window; Accelerate calls
it before every backward and ``step()`` only at its sync.

``engine.no_sync()`` (DeepSpeed's, at ZeRO 0-1; Accelerate's ``accumulate`` enters it between syncs at those stages):
backwards inside accumulate without reduction, the next backward outside at the boundary reduces the sum; ``step()``
inside, nesting and stages 2-3 raise DeepSpeed's ``AssertionError`` messages.

Parity: a window of ``N`` micro-batches on ``world`` ranks (each rank its slice of every global micro-batch) against a
single process that sums the gradients of the ``N`` global micro-batches' mean losses, each divided by
``gradient_accumulation_steps``, clips at 1.0 and steps AdamW. fp32, 1e-5 relative on the summed losses and on every
weight (max abs error over the tensor's max abs value): the runs differ only in the order of the sums (over ranks, and
the clipping norm over shards), a few ulps per step, far below 1e-5 after 3 Adam steps of lr 0.05. Windows alternate
between ``step()`` after every micro-batch and ``step()`` once at the end.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine_cases import make_model, max_rel_err, param_groups
from zerospeed.testing import run_distributed

FP32_TOL = 1e-5
STEPS = 3
MICRO = 2  # samples per rank per micro-batch
WINDOW = (3, 2, 4)  # micro-batches per window, one window per step
REDUCTIONS = ("all_reduce", "reduce_scatter")


def _config(stage: int, world: int, gas: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "train_batch_size": MICRO * gas * world, "steps_per_print": 0, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "betas": [0.9, 0.99], "eps": 1e-8}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64,
                                  "stage3_param_persistence_threshold": 0}}


def _micro_batch(step: int, i: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + i)
    return torch.randn(MICRO * world, 7, generator=g), torch.randn(MICRO * world, 3, generator=g)


def _reference(world: int, gas: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=0.05, betas=(0.9, 0.99), eps=1e-8, foreach=False)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for i in range(WINDOW[step]):
            x, y = _micro_batch(step, i, world)
            loss = model(x, y) / gas
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _engine_run(stage: int, gas: int) -> dict:
    import zerospeed
    from zerospeed import comm

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=param_groups(model),
                                           config=_config(stage, world, gas))
    losses, quiet, sticky = [], [], []
    for step in range(STEPS):
        total = torch.zeros(())
        every = step % 2 == 0  # step() after every micro-batch, or once after the window
        for i in range(WINDOW[step]):
            x, y = _micro_batch(step, i, world)
            loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
            last = i == WINDOW[step] - 1
            engine.set_gradient_accumulation_boundary(last)  # after the forward, as DeepSpeed's tests do
            comm.COUNTER.reset()
            total += engine.backward(loss).detach()  # DeepSpeed returns loss / gradient_accumulation_steps
            if not last:
                quiet.append(sum(comm.COUNTER.count(op) for op in REDUCTIONS))
            if every or last:
                engine.step()
                sticky.append(engine.is_gradient_accumulation_boundary() == last)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    state = engine.consolidated_state_dict()  # every rank calls it; rank 0 holds it
    return {"losses": losses, "weights": {k: v.float() for k, v in state.items()}, "quiet": quiet,
            "sticky": sticky, "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "global_samples": engine.global_samples}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world,stage,gas", [(2, 0, 1), (2, 1, 1), (2, 2, 1), (2, 3, 1), (1, 3, 1), (4, 1, 1),
                                             (2, 0, 2), (2, 3, 2)])
def test_windows_set_by_hand_equal_the_summed_micro_batch_gradients(world, stage, gas):
    ref_losses, ref_weights = _reference(world, gas)
    results = run_distributed(_engine_run, world, stage, gas, timeout=130)
    r = results[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_losses)) < FP32_TOL
    assert set(r["weights"]) == set(ref_weights)
    assert max_rel_err(r["weights"], ref_weights) < FP32_TOL
    steps_called = sum(WINDOW[s] if s % 2 == 0 else 1 for s in range(STEPS))
    for rank_result in results:
        assert rank_result["global_steps"] == STEPS
        assert rank_result["micro_steps"] == steps_called  # step() counts every call, as DeepSpeed's
        assert rank_result["global_samples"] == STEPS * MICRO * gas * world  # train_batch_size per step
        assert all(rank_result["sticky"])  # the value set holds after step() until set again
        if stage <= 1:  # reduced only at the boundary; stages 2-3 reduce-scatter every micro-batch, as DeepSpeed
            assert rank_result["quiet"] == [0] * sum(n - 1 for n in WINDOW)


def _no_sync_run(stage: int) -> dict:
    import zerospeed
    from zerospeed import comm

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=param_groups(model),
                                           config=_config(stage, world, 1))
    losses, quiet = [], []
    for step in range(STEPS):
        total = torch.zeros(())
        for i in range(WINDOW[step]):
            x, y = _micro_batch(step, i, world)
            xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
            if i < WINDOW[step] - 1:
                with engine.no_sync():
                    comm.COUNTER.reset()
                    total += engine.backward(engine(xs, ys)).detach()
                    quiet.append(sum(comm.COUNTER.count(op) for op in REDUCTIONS))
            else:
                total += engine.backward(engine(xs, ys)).detach()
                engine.step()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    errors = {}
    with engine.no_sync():
        try:
            engine.step()
        except AssertionError as e:
            errors["step"] = str(e)
        try:
            with engine.no_sync():
                pass
        except AssertionError as e:
            errors["nested"] = str(e)
    state = engine.consolidated_state_dict()
    return {"losses": losses, "weights": {k: v.float() for k, v in state.items()}, "quiet": quiet, "errors": errors,
            "global_steps": engine.global_steps}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_windows_equal_the_summed_micro_batch_gradients(stage):
    ref_losses, ref_weights = _reference(2, 1)
    results = run_distributed(_no_sync_run, 2, stage, timeout=130)
    r = results[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_losses)) < FP32_TOL
    assert max_rel_err(r["weights"], ref_weights) < FP32_TOL
    for rank_result in results:
        assert rank_result["global_steps"] == STEPS
        assert rank_result["quiet"] == [0] * sum(n - 1 for n in WINDOW)  # nothing reduced inside no_sync
        assert rank_result["errors"] == {
            "step": "It is illegal to call Engine.step() inside no_sync context manager",
            "nested": "no_sync context manager reentry is unsupported"}


def _no_sync_at(stage: int) -> str:
    import zerospeed

    model = make_model()
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=param_groups(model),
                                           config=_config(stage, 1, 1))
    try:
        with engine.no_sync():
            return "accepted"
    except AssertionError as e:
        return str(e)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [2, 3])
def test_no_sync_is_refused_where_gradients_are_partitioned(stage):
    msg = run_distributed(_no_sync_at, 1, stage, timeout=50)[0]
    assert msg.startswith(f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage "
                          f"{stage}"), msg


def _bad_input() -> dict:
    import zerospeed

    model = make_model()
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=param_groups(model),
                                           config=_config(0, 1, 2))
    out = {"default": engine.is_gradient_accumulation_boundary(), "managed": engine.managed_gradient_accumulation()}
    for name, value in (("string", "yes"), ("two", 2), ("none", None)):
        try:
            engine.set_gradient_accumulation_boundary(value)
            out[name] = "accepted"
        except TypeError as e:
            out[name] = str(e)
    engine.set_gradient_accumulation_boundary(True)
    out["override"] = engine.is_gradient_accumulation_boundary()  # micro-step 1 of 2, yet True as set
    return out


@pytest.mark.timeout(60)
def test_bad_values_are_refused_and_the_default_follows_the_counter():
    out = run_distributed(_bad_input, 1, timeout=50)[0]
    assert out["default"] is False and out["managed"] is True and out["override"] is True
    for name, shown in (("string", "'yes'"), ("two", "2"), ("none", "None")):
        assert "is_boundary must be a bool" in out[name] and shown in out[name], out[name]


def _pipeline_refuses() -> str:
    from pipe_cases import config, make_pipeline

    import zerospeed

    pipe = make_pipeline(1)
    engine, _, _, _ = zerospeed.initialize(model=pipe, model_parameters=pipe.parameters(),
                                           config=config("gpipe", 2))
    try:
        engine.set_gradient_accumulation_boundary(False)
    except RuntimeError as e:
        return str(e)
    return "accepted"


@pytest.mark.timeout(60)
def test_the_pipeline_engine_refuses_a_boundary():
    msg = run_distributed(_pipeline_refuses, 1, timeout=50)[0]
    assert "pipeline engine" in msg and "train_batch()" in msg, msg
