"""Lion, the μP optimizers (MuAdam, MuAdamW, MuSGD) and the torch.optim fallback by name (issue #30).

Each is element-wise, so at ZeRO 2 and 3 on 2 ranks it must equal the single-process loop with the same
optimizer: 1e-5 relative on losses and fp32 weights (the suite's fp32 parity tolerance; the gradient
reduction sums in another order than the single process).
"""

import pytest
import torch
from torch import nn

from engine_cases import GLOBAL_BATCH, global_batch, make_model, max_rel_err
from zerospeed.config import ConfigError, load_config
from zerospeed.ops.lion import Lion
from zerospeed.ops.optimizers import build_optimizer
from zerospeed.testing import run_distributed

TOL = 1e-5
STEPS = 3


class FakeInfShape:
    """What mup.set_base_shapes leaves on a parameter (duck-typed): ``inp`` and ``mid`` are matrix-like
    with width multiplier 2, biases vector-like."""

    def __init__(self, ninf, width_mult, ratio=1.0):
        self._n, self._w, self._r = ninf, width_mult, ratio

    def ninf(self):
        return self._n

    def width_mult(self):
        return self._w

    def fanin_fanout_mult_ratio(self):
        return self._r


def _mup_model():
    model = make_model()
    for n, p in model.named_parameters():
        p.infshape = FakeInfShape(2, 2.0, 0.5) if n in ("inp.weight", "mid.weight") else FakeInfShape(1, 2.0)
    return model


CASES = {
    "Lion": {"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.1},
    "MuAdam": {"lr": 0.02, "weight_decay": 0.01},
    "RAdam": {"lr": 0.02, "betas": [0.9, 0.99]},
    "NAdam": {"lr": 0.02, "momentum_decay": 0.004},
}


def _reference(name, params):
    model = _mup_model()
    names = {id(p): n for n, p in model.named_parameters()}
    opt = build_optimizer(name, params, model.parameters(), names=names)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _engine(name, params, stage):
    import torch.distributed as dist

    import zerospeed
    from zerospeed.zero import GatheredParameters

    model = _mup_model()
    cfg = {"train_batch_size": GLOBAL_BATCH, "steps_per_print": 0, "gradient_clipping": 0.0,
           "optimizer": {"type": name, "params": params},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64}}
    engine, opt, _, _ = zerospeed.initialize(model=model, config=cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step)
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    with GatheredParameters(list(engine.module.parameters())):
        weights = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "weights": weights, "class": type(opt).__name__}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_sharded_equals_single_process(name, stage):
    ref_losses, ref_weights = _reference(name, CASES[name])
    for r in run_distributed(_engine, 2, name, CASES[name], stage, timeout=150):
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_losses)) < TOL
        assert max_rel_err(r["weights"], ref_weights) < TOL


def test_lion_equals_deepspeed_formula():
    torch.manual_seed(1)
    p = nn.Parameter(torch.randn(50))
    opt = Lion([p], lr=0.01, betas=(0.8, 0.99), weight_decay=0.1)
    w, m = p.detach().clone(), torch.zeros(50)
    for _ in range(3):
        g = torch.randn(50)
        p.grad = g.clone()
        opt.step()
        c = 0.8 * m + 0.2 * g
        w = w * (1 - 0.01 * 0.1) - 0.01 * torch.sign(c)
        m = 0.99 * m + 0.01 * g
        assert torch.allclose(p.detach(), w, rtol=0, atol=1e-6) and torch.allclose(opt.state[p]["exp_avg"], m)


def test_mup_groups_follow_mup_scaling():
    model = _mup_model()
    opt = build_optimizer("MuAdamW", {"lr": 0.1, "weight_decay": 0.01}, model.parameters())
    assert isinstance(opt, torch.optim.AdamW)
    lrs = {id(p): (g["lr"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]}
    assert lrs[id(model.inp.weight)] == (0.05, 0.02)  # matrix-like, width x2: lr / 2, wd * 2
    assert lrs[id(model.inp.bias)] == (0.1, 0.01)
    sgd = build_optimizer("MuSGD", {"lr": 0.1}, model.parameters())
    lrs = {id(p): g["lr"] for g in sgd.param_groups for p in g["params"]}
    assert lrs[id(model.inp.weight)] == 0.2 and lrs[id(model.inp.bias)] == 0.2  # ratio 0.5; vector x2
    plain = make_model()
    with pytest.raises(ValueError, match="infshape"):
        build_optimizer("MuAdam", {"lr": 0.1}, plain.parameters())


def test_torch_fallback_by_name_and_its_keywords():
    model = make_model()
    opt = build_optimizer("RMSprop", {"lr": 0.01, "alpha": 0.9}, model.parameters())
    assert type(opt) is torch.optim.RMSprop and opt.param_groups[0]["alpha"] == 0.9
    with pytest.raises(ConfigError) as err:
        build_optimizer("RAdam", {"lr": 0.01, "momentum": 0.9}, model.parameters())
    assert "optimizer.params.momentum" in str(err.value) and "torch.optim.RAdam" in str(err.value)
    assert len(str(err.value).splitlines()) == 1
    with pytest.raises(ConfigError, match="closure"):
        build_optimizer("LBFGS", {}, model.parameters())


@pytest.mark.parametrize("name, canonical", [("radam", "RAdam"), ("nadam", "NAdam"), ("lion", "Lion"),
                                             ("muadamw", "MuAdamW"), ("Rprop", "Rprop")])
def test_config_accepts_the_names(name, canonical):
    assert load_config({"train_batch_size": 8, "optimizer": {"type": name}}).optimizer.type == canonical


def test_config_refuses_lbfgs_in_one_line():
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 8, "optimizer": {"type": "LBFGS"}})
    assert "optimizer.type" in str(err.value)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["Lion", "RAdam"])
def test_host_held_offload_equals_the_device_run(name):
    # offload_optimizer cpu with a non-Adam element-wise optimizer: its own step on host-memory masters
    # and states (bf16 training, so the fp32 masters are separate tensors)
    bases = run_distributed(_offload_run, 2, name, False, timeout=150)
    for base, r in zip(bases, run_distributed(_offload_run, 2, name, True, timeout=150)):  # rank by rank
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"])) < 1e-6
        assert max_rel_err(r["weights"], base["weights"]) < 1e-6


def _offload_run(name, offload):
    import torch.distributed as dist

    import zerospeed

    model = make_model()
    zero = {"stage": 2, "reduce_bucket_size": 64, "allgather_bucket_size": 64}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {"train_batch_size": GLOBAL_BATCH, "steps_per_print": 0, "bf16": {"enabled": True},
           "optimizer": {"type": name, "params": CASES[name]}, "zero_optimization": zero}
    engine, _, _, _ = zerospeed.initialize(model=model, config=cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step)
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "weights": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["Lion", "NAdam"])
def test_host_held_optimizer_with_nvme_and_no_swap_buffer_is_one_line(name, tmp_path):
    # host-held states swap to NVMe (tests/test_optimizer_nvme.py) through at least one swap buffer
    from zerospeed.testing.distributed import DistributedTestError

    with pytest.raises(DistributedTestError) as err:
        run_distributed(_nvme_init, 1, name, str(tmp_path), timeout=100)
    line = [ln for ln in str(err.value).splitlines() if "ConfigError:" in ln][-1]
    assert "zero_optimization.offload_optimizer.buffer_count: 0" in line


def _nvme_init(name, nvme_path):
    import zerospeed

    zero = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 0}}
    cfg = {"train_batch_size": GLOBAL_BATCH, "steps_per_print": 0,
           "optimizer": {"type": name, "params": CASES[name]}, "zero_optimization": zero}
    zerospeed.initialize(model=make_model(), config=cfg)
