"""Engine behaviour beyond parity: fp16 overflow handling, collective counts, memory accounting,
lr scheduling on sharded groups, and the errors of the public entry points."""


import pytest
import torch
import torch.distributed as dist

from engine_cases import config, engine_run, global_batch, make_model, param_groups
from zerospeed.config import ConfigError
from zerospeed.testing import run_distributed
from zerospeed.zero.memory import estimate_model_state_bytes

NUM_PARAMS = 192  # TinyNet: 7*13 + 13 + 13*5 + 5 + 5*3 + 3
# reduce_bucket_size 64 gives buckets (gradient-ready order) [out.bias, out.weight, mid.bias] (23),
# [mid.weight] (65), [inp.bias] (13), [inp.weight] (91): 4 buckets, 2 of them for group 1.
BUCKET_NUMELS = [23, 65, 13, 91]


def _padded(world):
    return [-(-n // world) * world for n in BUCKET_NUMELS]


# -- fp16 overflow ---------------------------------------------------------------------------------
def _fp16_overflow_run(stage):
    import zerospeed

    cfg = config(stage, 1, "fp16", fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2,
                                         "hysteresis": 2})
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.05,
                                                       "warmup_num_steps": 10, "warmup_type": "linear"}}
    model = make_model()
    engine, _, _, sched = zerospeed.initialize(model=model, config=cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    scales, snapshots, lrs = [], [], []
    for step in range(6):
        x, y = global_batch(step)
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        if step in (1, 2) and rank == 1:  # only rank 1 overflows
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        scales.append(engine.loss_scale)
        snapshots.append({n: p.detach().clone() for n, p in engine.module.named_parameters()})
        lrs.append(engine.get_lr()[0])
    finite = all(torch.isfinite(p).all() for s in snapshots for p in s.values())
    return {"scales": scales, "snapshots": snapshots, "lrs": lrs, "skipped": engine.skipped_steps,
            "global_steps": engine.global_steps, "finite": finite}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(stage):
    results = run_distributed(_fp16_overflow_run, 2, stage)
    for r in results:
        # 256 -> overflow spends hysteresis -> overflow halves -> clean -> 2 clean steps double it back
        assert r["scales"] == [256.0, 256.0, 128.0, 128.0, 256.0, 256.0]
        assert r["skipped"] == 2 and r["global_steps"] == 6 and r["finite"]
        for k, w in r["snapshots"][0].items():  # steps 1 and 2 changed nothing
            assert torch.equal(r["snapshots"][1][k], w) and torch.equal(r["snapshots"][2][k], w)
        assert any(not torch.equal(r["snapshots"][3][k], w) for k, w in r["snapshots"][0].items())
        # WarmupLR (linear from 0.01 to 0.05 over 10 iterations) advances only on the 4 clean steps:
        # construction applies 0.01, clean steps move it to iterations 0, 1, 2, 3.
        assert r["lrs"] == pytest.approx([0.01 + 0.04 * i / 10 for i in (0, 0, 0, 1, 2, 3)])
    assert all(torch.equal(results[0]["snapshots"][-1][k], v) for k, v in results[1]["snapshots"][-1].items())


# -- collectives ------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage,gas", [(0, 1), (0, 4), (1, 1), (1, 4), (2, 1), (2, 4)])
def test_one_collective_per_bucket_and_two_psi_traffic(stage, gas):
    world = 2
    r = run_distributed(engine_run, world, config(stage, gas), 2)[0]
    assert r["num_buckets"] == 4
    for comms in r["comms"]:
        if stage == 0:
            assert comms["all_reduce"]["count"] == 4  # once per bucket, at the boundary only
            assert comms["all_reduce"]["elements"] == NUM_PARAMS
            assert "reduce_scatter" not in comms and "all_gather" not in comms
            traffic = 2 * comms["all_reduce"]["elements"]
        else:
            per_step = gas if stage == 2 else 1  # stage 2 reduces every micro-batch
            assert comms["reduce_scatter"]["count"] == 4 * per_step
            assert comms["reduce_scatter"]["elements"] == sum(_padded(world)) * per_step
            assert comms["all_gather"]["count"] == 4
            assert comms["all_gather"]["elements"] == sum(_padded(world))
            assert comms["all_reduce"] == {"count": 1, "elements": 1, "bytes": 4, "wire_elements": 2,  # grad norm
                                           "intra_host_bytes": 4, "inter_host_bytes": 0}
            traffic = comms["reduce_scatter"]["elements"] / per_step + comms["all_gather"]["elements"]
        assert 2 * NUM_PARAMS <= traffic <= 2 * (NUM_PARAMS + 4 * (world - 1))


# -- memory accounting ------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_memory_matches_zero_formula_within_padding(stage, world, precision):
    r = run_distributed(engine_run, world, config(stage, 1, precision), 1)[0]
    mem = r["memory"]
    width = 4 if precision == "fp32" else 2
    padded = sum(_padded(world)) if stage else NUM_PARAMS
    shard = padded // world if stage else NUM_PARAMS
    assert mem["params"] == width * padded
    assert mem["grads"] == width * (shard if stage == 2 else padded)
    master = 4 * shard if precision == "bf16" else 0
    assert mem["master_params"] == master
    assert mem["optimizer_states"] == 8 * shard  # AdamW: exp_avg + exp_avg_sq in fp32
    formula = estimate_model_state_bytes(NUM_PARAMS, world, stage, precision, "adamw")
    slack = 16 * 4 * (world - 1)  # at most world-1 padding elements per bucket, 16 bytes each
    assert abs(mem["total"] - formula.total) <= slack


# -- lr schedule on sharded parameter groups ---------------------------------------------------------
def _lr_trace(stage):
    import zerospeed

    cfg = config(stage, 1)
    cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.04,
                                                            "warmup_num_steps": 2, "total_num_steps": 6,
                                                            "warmup_type": "linear"}}
    model = make_model()
    engine, opt, _, _ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    trace = []
    for step in range(5):
        x, y = global_batch(step)
        engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
        engine.step()
        trace.append([g["lr"] for g in opt.param_groups])
    return trace, [len(g["params"]) for g in opt.param_groups]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 2])
def test_scheduler_drives_every_sharded_group(stage):
    trace, group_sizes = run_distributed(_lr_trace, 2, stage)[0]
    # WarmupDecayLR (DeepSpeed's formula) drives every group: after step k the scheduler is at iteration k;
    # linear warmup i/2 for i < 2, then decay (6 - i) / (6 - 2).
    expected = [0.04 * 0 / 2, 0.04 * 1 / 2, 0.04 * (6 - 2) / 4, 0.04 * (6 - 3) / 4, 0.04 * (6 - 4) / 4]
    assert [t[0] for t in trace] == pytest.approx(expected)
    assert all(t[0] == t[1] for t in trace)
    # stage 2: the optimizer holds one flat shard per bucket (2 buckets per group); stage 0 holds parameters
    assert group_sizes == ([2, 2] if stage else [2, 4])


# -- errors of the public entry points ----------------------------------------------------------------
def _expect_error(case):
    import zerospeed

    model = make_model()
    try:
        if case == "lamb_with_zero":
            cfg = config(1, 1)
            cfg["optimizer"] = {"type": "Lamb", "params": {"lr": 0.01}}
            zerospeed.initialize(model=model, config=cfg)
        elif case == "no_optimizer_backward":  # an engine for forward and evaluation (issue #27): training refuses
            cfg = config(0, 1)
            del cfg["optimizer"]
            engine, *_ = zerospeed.initialize(model=model, config=cfg)
            x, y = global_batch(0)
            engine.backward(engine(x[:8], y[:8]))
        elif case == "stray_backward":
            engine, *_ = zerospeed.initialize(model=model, config=config(0, 1))
            x, y = global_batch(0)
            model(x[:8], y[:8]).backward()  # the model, not the engine: no scaling, no reduction
            engine.step()
        elif case == "non_scalar_loss":
            engine, *_ = zerospeed.initialize(model=model, config=config(0, 1))
            engine.backward(torch.ones(3, requires_grad=True))
        elif case == "no_grad_loss":
            engine, *_ = zerospeed.initialize(model=model, config=config(0, 1))
            x, y = global_batch(0)
            with torch.no_grad():
                loss = engine(x[:8], y[:8])
            engine.backward(loss)
        elif case == "bad_batch":
            zerospeed.initialize(model=model, config={"train_batch_size": 15, "train_micro_batch_size_per_gpu": 4,
                                                      "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        elif case == "not_a_module":
            zerospeed.initialize(model="model", config=config(0, 1))
        elif case == "no_config":
            zerospeed.initialize(model=model)
    except Exception as e:  # noqa: BLE001 - the test inspects the type and message
        return type(e).__name__, str(e)
    return None, None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case,kind,words", [
    ("lamb_with_zero", "ConfigError", ["zero_allow_untested_optimizer", "Lamb"]),
    ("no_optimizer_backward", "RuntimeError", ["engine.backward", "without an optimizer", "initialize(optimizer=...)"]),
    ("stray_backward", "RuntimeError", ["engine.backward(loss)"]),
    ("non_scalar_loss", "ValueError", ["scalar loss", "(3,)"]),
    ("no_grad_loss", "ValueError", ["does not require grad"]),
    ("bad_batch", "ConfigError", ["train_batch_size", "15"]),
    ("not_a_module", "TypeError", ["torch.nn.Module", "str"]),
    ("no_config", "ConfigError", ["no config"]),
])
def test_entry_point_errors_are_clear(case, kind, words):
    name, message = run_distributed(_expect_error, 2, case)[0]
    assert name == kind, message
    for word in words:
        assert word in message
    assert "\n" not in message


def _client_and_config_optimizer():
    import logging

    import zerospeed

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("zerospeed").addHandler(handler)
    model = make_model()
    cfg = dict(config(0, 1), scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 4}})
    client_sched = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)  # noqa: E731
    engine, opt, _, sched = zerospeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                 lr_scheduler=client_sched, config=cfg)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING and "is ignored" in r.getMessage()]
    return type(engine.optimizer).__name__, type(sched).__name__, engine.get_lr(), warnings


@pytest.mark.timeout(120)
def test_client_optimizer_and_scheduler_win_over_the_config_with_a_warning():
    # DeepSpeed 0.19.8 uses initialize(optimizer=..., lr_scheduler=...) when the config also has the sections
    # (engine._configure_optimizer / _configure_lr_scheduler); zerospeed does too, and names what it ignores
    results = run_distributed(_client_and_config_optimizer, 2)
    opt_name, sched_name, lr, warnings = results[0]
    assert opt_name == "SGD" and sched_name == "LambdaLR" and lr == [pytest.approx(0.05)]
    assert len(warnings) == 2
    assert "initialize(optimizer=...)" in warnings[0] and "'optimizer' section" in warnings[0]
    assert "initialize(lr_scheduler=...)" in warnings[1] and "WarmupLR" in warnings[1]
    assert results[1][3] == []  # rank 0 only


def test_config_error_for_stage_4_names_the_key():
    from zerospeed.config import load_config

    with pytest.raises(ConfigError, match=r"zero_optimization\.stage"):
        load_config(config(4, 1))


# -- data loader ----------------------------------------------------------------------------------------
def _loader_slices():
    import zerospeed
    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.arange(32, dtype=torch.float32).view(16, 2), torch.zeros(16, 3))
    model = make_model()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, loader, _ = zerospeed.initialize(model=model, training_data=data, config=cfg)
    rows = [int(x[i, 0].item()) // 2 for x, _ in loader for i in range(x.shape[0])]
    return rows, engine.train_batch_size(), len(loader)


@pytest.mark.timeout(120)
def test_dataloader_gives_each_rank_a_disjoint_slice_of_micro_batches():
    (rows0, tbs, n0), (rows1, _, n1) = run_distributed(_loader_slices, 2)
    assert tbs == 8  # 2 micro x 2 accumulation x 2 ranks
    assert n0 == n1 == 4  # 8 samples per rank in micro-batches of 2
    assert sorted(rows0 + rows1) == list(range(16)) and not set(rows0) & set(rows1)




def _consolidated(stage):
    import zerospeed

    model = make_model()
    engine, *_ = zerospeed.initialize(model=model, config=config(stage, 1))
    x, y = global_batch(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
    engine.step()
    full = {n: p.detach().clone() for n, p in engine.module.named_parameters()} if stage < 3 else None
    return engine.consolidated_state_dict(), full


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 3])
def test_consolidated_state_dict_is_full_on_rank0_only(stage):
    (sd0, full0), (sd1, _) = run_distributed(_consolidated, 2, stage)
    assert sd1 == {}
    shapes = {n: tuple(p.shape) for n, p in make_model().named_parameters()}
    assert {k: tuple(v.shape) for k, v in sd0.items()} == shapes
    if full0 is not None:
        assert all(torch.equal(sd0[k], full0[k]) for k in shapes)
