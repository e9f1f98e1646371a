"""LR schedules against values worked out by hand from DeepSpeed's formulas.

Every expected value is written as the formula's arithmetic (never computed by the code under
test). ``i`` in comments is ``last_batch_iteration`` after the ``step()`` calls.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from zerospeed.config.errors import ConfigError
from zerospeed.runtime.lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_lr_scheduler,
)


def sgd(*lrs: float) -> torch.optim.Optimizer:
    """An SGD optimizer with one param group per lr."""
    groups = [{"params": [torch.zeros(3, requires_grad=True)], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def adam(lr: float = 0.01, betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.Optimizer:
    return torch.optim.Adam([torch.zeros(3, requires_grad=True)], lr=lr, betas=betas)


def lrs_at(scheduler, optimizer, iterations: list[int]) -> dict[int, list[float]]:
    """Step one batch at a time and record every group's lr at the wanted iterations."""
    out = {}
    for i in range(max(iterations) + 1):
        scheduler.step()
        assert scheduler.last_batch_iteration == i
        if i in iterations:
            out[i] = [g["lr"] for g in optimizer.param_groups]
            assert scheduler.get_last_lr() == out[i]
    return out


def approx(values):
    return pytest.approx(values, rel=1e-12, abs=1e-15)


# ----------------------------------------------------------------------------- WarmupLR


def test_warmup_lr_log():
    opt = sgd(0.5)
    s = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=10)
    assert opt.param_groups[0]["lr"] == 0.0  # construction applies warmup_min_lr
    assert s.get_last_lr() == [0.0]
    got = lrs_at(s, opt, [0, 1, 5, 9, 10, 100])
    assert got[0] == approx([0.001 * math.log(0 + 1) / math.log(10)])  # = 0
    assert got[1] == approx([0.001 * math.log(1 + 1) / math.log(10)])
    assert got[5] == approx([0.001 * math.log(5 + 1) / math.log(10)])
    assert got[9] == approx([0.001 * math.log(9 + 1) / math.log(10)])  # = max, end of warmup
    assert got[10] == approx([0.001])
    assert got[100] == approx([0.001])


def test_warmup_lr_linear_with_min():
    opt = sgd(0.5)
    s = WarmupLR(opt, warmup_min_lr=0.0002, warmup_max_lr=0.001, warmup_num_steps=10, warmup_type="linear")
    assert opt.param_groups[0]["lr"] == 0.0002
    got = lrs_at(s, opt, [0, 1, 4, 9, 10, 50])
    assert got[0] == approx([0.0002 + (0.001 - 0.0002) * 0 / 10])
    assert got[1] == approx([0.0002 + (0.001 - 0.0002) * 1 / 10])
    assert got[4] == approx([0.0002 + (0.001 - 0.0002) * 4 / 10])
    assert got[9] == approx([0.0002 + (0.001 - 0.0002) * 9 / 10])
    assert got[10] == approx([0.001])
    assert got[50] == approx([0.001])


def test_warmup_lr_max_defaults_to_each_groups_lr():
    opt = sgd(0.1, 0.2)
    s = WarmupLR(opt, warmup_num_steps=4, warmup_type="linear")
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    got = lrs_at(s, opt, [2, 4])
    assert got[2] == approx([0.1 * 2 / 4, 0.2 * 2 / 4])
    assert got[4] == approx([0.1, 0.2])


def test_warmup_lr_per_group_lists():
    opt = sgd(0.1, 0.2)
    s = WarmupLR(opt, warmup_min_lr=[0.01, 0.02], warmup_max_lr=[0.1, 0.3], warmup_num_steps=5, warmup_type="linear")
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.02]
    got = lrs_at(s, opt, [3])
    assert got[3] == approx([0.01 + 0.09 * 3 / 5, 0.02 + 0.28 * 3 / 5])


def test_warmup_num_steps_one_is_two_as_in_deepspeed():
    # DeepSpeed uses max(2, warmup_num_steps) so log(W) is never 0.
    opt = sgd(0.5)
    s = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=1)
    got = lrs_at(s, opt, [0, 1, 2])
    assert got[0] == approx([0.0])
    assert got[1] == approx([0.01 * math.log(2) / math.log(2)])
    assert got[2] == approx([0.01])


# ----------------------------------------------------------------------------- WarmupDecayLR


def test_warmup_decay_lr_linear():
    opt = sgd(0.5)
    s = WarmupDecayLR(opt, total_num_steps=30, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=10,
                      warmup_type="linear")  # fmt: skip
    assert opt.param_groups[0]["lr"] == 0.0
    got = lrs_at(s, opt, [0, 1, 5, 10, 20, 29, 30, 40])
    assert got[0] == approx([0.0])
    assert got[1] == approx([0.001 * 1 / 10])
    assert got[5] == approx([0.001 * 5 / 10])
    assert got[10] == approx([0.001 * (30 - 10) / (30 - 10)])  # end of warmup = max
    assert got[20] == approx([0.001 * (30 - 20) / (30 - 10)])  # mid decay
    assert got[29] == approx([0.001 * (30 - 29) / (30 - 10)])
    assert got[30] == approx([0.0])  # end: decayed to 0
    assert got[40] == approx([0.0])  # beyond the end: stays 0


def test_warmup_decay_lr_log_and_default_max():
    opt = sgd(0.5)
    s = WarmupDecayLR(opt, total_num_steps=100, warmup_num_steps=10)  # warmup_max_lr default 0.001
    got = lrs_at(s, opt, [3, 55])
    assert got[3] == approx([0.001 * math.log(3 + 1) / math.log(10)])
    assert got[55] == approx([0.001 * (100 - 55) / (100 - 10)])


# ----------------------------------------------------------------------------- WarmupCosineLR


def test_warmup_cosine_lr_linear():
    opt = sgd(0.5)
    s = WarmupCosineLR(opt, total_num_steps=30, warmup_min_ratio=0.1, warmup_num_steps=10, cos_min_ratio=0.01,
                       warmup_type="linear")  # fmt: skip
    assert opt.param_groups[0]["lr"] == 0.0  # DeepSpeed: ratio 0 before the first step
    got = lrs_at(s, opt, [0, 1, 5, 9, 10, 19, 29, 50])
    assert got[0] == approx([0.5 * (0.1 + (1 - 0.1) * 0 / 10)])
    assert got[1] == approx([0.5 * (0.1 + (1 - 0.1) * 1 / 10)])
    assert got[5] == approx([0.5 * (0.1 + (1 - 0.1) * 5 / 10)])
    assert got[9] == approx([0.5 * (0.1 + (1 - 0.1) * 9 / 10)])
    # decay: progress = (i - 10 + 1) / (30 - 10)
    assert got[10] == approx([0.5 * (0.01 + (1 - 0.01) * (1 + math.cos(math.pi * 1 / 20)) / 2)])
    assert got[19] == approx([0.5 * (0.01 + (1 - 0.01) * (1 + math.cos(math.pi * 10 / 20)) / 2)])
    assert got[29] == approx([0.5 * 0.01])  # progress 1: cos_min_ratio
    assert got[50] == approx([0.5 * 0.01])  # clamped past the end


def test_warmup_cosine_lr_log_defaults_and_groups():
    opt = sgd(0.1, 0.4)
    s = WarmupCosineLR(opt, total_num_steps=1000, warmup_num_steps=10)  # min ratio 0, cos_min 1e-4
    got = lrs_at(s, opt, [3, 1000])
    ratio3 = 0.0 + (1 - 0.0) * math.log(3 + 1) / math.log(10)
    assert got[3] == approx([0.1 * ratio3, 0.4 * ratio3])
    assert got[1000] == approx([0.1 * 0.0001, 0.4 * 0.0001])


# ----------------------------------------------------------------------------- OneCycle


def test_one_cycle_lr_and_momentum():
    opt = adam(lr=0.5, betas=(0.9, 0.999))
    s = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, decay_lr_rate=0.5, cycle_first_step_size=10,
                 decay_step_size=5)  # fmt: skip
    group = opt.param_groups[0]
    assert group["lr"] == 0.01
    assert group["betas"] == (0.8, 0.999)  # cycle_min_mom at construction; own beta2 kept
    seen = {}
    for i in range(30):
        s.step()
        seen[i] = (group["lr"], group["betas"])
    # i=0: batch 1 of a 20-step cycle, x = 1/20, rising half: scale = x / 0.5
    assert seen[0][0] == pytest.approx(0.01 + (0.1 - 0.01) * (1 / 20) / 0.5)
    assert seen[0][1] == pytest.approx((0.9 - (0.9 - 0.8) * (1 / 20) / 0.5, 0.999))
    assert seen[9][0] == pytest.approx(0.1)  # peak: x = 10/20
    assert seen[9][1][0] == pytest.approx(0.8)
    assert seen[14][0] == pytest.approx(0.01 + (0.1 - 0.01) * (15 / 20 - 1) / (0.5 - 1))  # falling half
    assert seen[19][0] == pytest.approx(0.01)  # batch 20 closes the cycle
    # decay phase: k = i - 20 + 1
    assert seen[20][0] == pytest.approx(0.01 / (1 + 0.5 * 1 / 5))
    assert seen[29][0] == pytest.approx(0.01 / (1 + 0.5 * 10 / 5))
    assert seen[29][1] == (0.9, 0.999)  # decay_mom_rate 0: momentum stays at cycle_max_mom


def test_one_cycle_momentum_decay_and_asymmetric_cycle():
    opt = adam()
    s = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=10, cycle_second_step_size=5, decay_step_size=5,
                 decay_mom_rate=0.1)  # fmt: skip
    group = opt.param_groups[0]
    seen = {}
    for i in range(25):
        s.step()
        seen[i] = (group["lr"], group["betas"][0])
    # cycle of 15, rising ratio 10/15; i=11 -> batch 12, x = 12/15 in the falling half
    assert seen[11][0] == pytest.approx(0.01 + 0.09 * (12 / 15 - 1) / (10 / 15 - 1))
    # decay_lr_rate 0: lr stays at cycle_min_lr after the cycle
    assert seen[20][0] == pytest.approx(0.01)
    # momentum grows after the cycle: k = 20 - 15 + 1
    assert seen[20][1] == pytest.approx(0.9 * (1 + 0.1 * 6 / 5))


def test_one_cycle_stairs():
    opt = adam()
    s = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=10, cycle_first_stair_count=5, cycle_momentum=False)
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)  # untouched without cycle_momentum
    seen = {}
    for i in range(20):
        s.step()
        seen[i] = opt.param_groups[0]["lr"]
    assert seen[0] == pytest.approx(0.01 + 0.09 * math.floor(1 * 5 / 10) / 5)  # flat first stair
    assert seen[2] == pytest.approx(0.01 + 0.09 * math.floor(3 * 5 / 10) / 5)
    assert seen[9] == pytest.approx(0.01 + 0.09 * math.floor(10 * 5 / 10) / 5)  # = max
    # falling half: second stair count defaults to the first; offset from the cycle end
    assert seen[12] == pytest.approx(0.01 + 0.09 * math.floor((20 - 13) * 5 / 10) / 5)
    assert seen[19] == pytest.approx(0.01)


def test_one_cycle_without_betas_disables_momentum(caplog):
    opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1, momentum=0.9)
    with caplog.at_level(logging.WARNING):
        s = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=4)
    assert "cycle_momentum disabled" in caplog.text
    s.step()
    assert s.get_mom() is None
    assert opt.param_groups[0]["momentum"] == 0.9
    assert "betas" not in opt.param_groups[0]


# ----------------------------------------------------------------------------- LRRangeTest


def test_lr_range_test_continuous():
    opt = sgd(0.5)
    s = LRRangeTest(opt, lr_range_test_min_lr=0.001, lr_range_test_step_size=10, lr_range_test_step_rate=2.0)
    assert opt.param_groups[0]["lr"] == 0.001
    got = lrs_at(s, opt, [0, 4, 19])
    assert got[0] == approx([0.001 * (1 + 2.0 * 1 / 10)])
    assert got[4] == approx([0.001 * (1 + 2.0 * 5 / 10)])
    assert got[19] == approx([0.001 * (1 + 2.0 * 20 / 10)])


def test_lr_range_test_staircase_and_defaults():
    opt = sgd(0.5, 0.5)
    s = LRRangeTest(opt, lr_range_test_step_size=10, lr_range_test_staircase=True)  # min 1e-3, rate 1.0
    got = lrs_at(s, opt, [8, 9, 25])
    assert got[8] == approx([0.001 * (1 + 1.0 * math.floor(9 / 10))] * 2)
    assert got[9] == approx([0.001 * (1 + 1.0 * math.floor(10 / 10))] * 2)
    assert got[25] == approx([0.001 * (1 + 1.0 * math.floor(26 / 10))] * 2)


# ----------------------------------------------------------------------------- shared behaviour


@pytest.mark.parametrize(
    "name,params",
    [
        ("WarmupLR", {"warmup_num_steps": 10}),
        ("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 5}),
        ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 5}),
        ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 5}),
        ("LRRangeTest", {"lr_range_test_step_size": 3}),
    ],
)
def test_state_dict_round_trip(name, params):
    opt_a = adam(lr=0.05)
    a = build_lr_scheduler(name, params, opt_a)
    for _ in range(7):
        a.step()
    state = a.state_dict()
    assert state == {"last_batch_iteration": 6}

    opt_b = adam(lr=0.05)
    b = build_lr_scheduler(name, params, opt_b)
    b.load_state_dict(state)
    assert b.last_batch_iteration == 6
    for _ in range(3):
        a.step()
        b.step()
        assert b.get_last_lr() == a.get_last_lr()
        assert opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"]
        assert opt_b.param_groups[0]["betas"] == opt_a.param_groups[0]["betas"]


def test_resume_by_last_batch_iteration_does_not_touch_optimizer():
    opt = sgd(0.5)
    s = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=10, last_batch_iteration=4)
    assert opt.param_groups[0]["lr"] == 0.5
    with pytest.raises(RuntimeError, match="step"):
        s.get_last_lr()
    s.step()
    assert s.last_batch_iteration == 5
    assert opt.param_groups[0]["lr"] == pytest.approx(0.001 * math.log(5 + 1) / math.log(10))


def test_step_to_explicit_iteration():
    opt = sgd(0.5)
    s = WarmupDecayLR(opt, total_num_steps=30, warmup_num_steps=10, warmup_type="linear")
    s.step(20)
    assert s.last_batch_iteration == 20
    assert opt.param_groups[0]["lr"] == pytest.approx(0.001 * (30 - 20) / (30 - 10))


def test_works_on_rewritten_param_groups_and_wrappers():
    # ZeRO replaces group["params"] with flat shards; schedules only touch lr / betas.
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    shard = torch.zeros(7, requires_grad=True)
    opt.param_groups[0]["params"] = [shard]

    class Wrapper:  # a ZeRO optimizer facade exposing only param_groups
        def __init__(self, inner):
            self.param_groups = inner.param_groups

    s = OneCycle(Wrapper(opt), 0.01, 0.1, cycle_first_step_size=2)
    s.step()
    assert opt.param_groups[0]["params"] == [shard]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 + 0.09 * (1 / 4) / 0.5)
    assert opt.param_groups[0]["betas"][0] == pytest.approx(0.9 - 0.1 * (1 / 4) / 0.5)


def test_tensor_lr_is_updated_in_place():
    opt = sgd(0.5)
    lr_tensor = torch.tensor(0.5)
    opt.param_groups[0]["lr"] = lr_tensor
    s = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=10, warmup_type="linear")
    s.step()
    s.step()
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert lr_tensor.item() == pytest.approx(0.001 * 1 / 10)


# ----------------------------------------------------------------------------- factory


def test_factory_is_case_insensitive_and_accepts_integral_floats():
    opt = sgd(0.5)
    s = build_lr_scheduler("warmupdecaylr", {"total_num_steps": 1e2, "warmup_num_steps": 1e1}, opt)
    assert isinstance(s, WarmupDecayLR)
    assert s.total_num_steps == 100 and s.warmup_num_steps == 10
    assert isinstance(build_lr_scheduler("ONECYCLE", {"cycle_min_lr": 0, "cycle_max_lr": 1}, opt), OneCycle)


def expect_config_error(key_path: str, type_name: str, params: dict, optimizer=None, match: str = "") -> ConfigError:
    with pytest.raises(ConfigError) as info:
        build_lr_scheduler(type_name, params, optimizer if optimizer is not None else sgd(0.5))
    assert info.value.key_path == key_path
    assert match in info.value.problem
    assert str(info.value).startswith(f"zerospeed config: {key_path}: ")
    return info.value


def test_unknown_scheduler_names_nearest():
    expect_config_error("scheduler.type", "WarmupLr_", {}, match="did you mean 'WarmupLR'")
    err = expect_config_error("scheduler.type", "Polynomial", {})
    assert "WarmupCosineLR" in err.problem  # lists what is allowed
    expect_config_error("scheduler.type", 3, {}, match="not a string")


def test_unknown_parameter_lists_allowed():
    err = expect_config_error("scheduler.params.warmup_steps", "WarmupLR", {"warmup_steps": 10},
                              match="unknown parameter for WarmupLR; allowed: ")  # fmt: skip
    assert "warmup_num_steps" in err.problem and "warmup_type" in err.problem
    expect_config_error("scheduler.params.cos_min_ratio", "WarmupDecayLR",
                        {"total_num_steps": 10, "cos_min_ratio": 0.1}, match="WarmupDecayLR")  # fmt: skip


@pytest.mark.parametrize(
    "type_name,params,key",
    [
        ("WarmupDecayLR", {}, "total_num_steps"),
        ("WarmupCosineLR", {"warmup_num_steps": 3}, "total_num_steps"),
        ("OneCycle", {"cycle_max_lr": 0.1}, "cycle_min_lr"),
        ("OneCycle", {"cycle_min_lr": 0.1}, "cycle_max_lr"),
    ],
)
def test_missing_required_parameter(type_name, params, key):
    expect_config_error(f"scheduler.params.{key}", type_name, params, match="missing")


@pytest.mark.parametrize(
    "type_name,params,key,match",
    [
        ("WarmupLR", {"warmup_num_steps": -5}, "warmup_num_steps", ">= 1"),
        ("WarmupLR", {"warmup_num_steps": 0}, "warmup_num_steps", ">= 1"),
        ("WarmupLR", {"warmup_num_steps": "auto"}, "warmup_num_steps", "not an integer"),
        ("WarmupLR", {"warmup_num_steps": 2.5}, "warmup_num_steps", "not an integer"),
        ("WarmupLR", {"warmup_num_steps": True}, "warmup_num_steps", "not an integer"),
        ("WarmupLR", {"warmup_type": "cosine"}, "warmup_type", "log, linear"),
        ("WarmupLR", {"warmup_min_lr": -0.1}, "warmup_min_lr", ">= 0"),
        ("WarmupLR", {"warmup_max_lr": "auto"}, "warmup_max_lr", "not a finite number"),
        ("WarmupLR", {"warmup_max_lr": float("nan")}, "warmup_max_lr", "not a finite number"),
        ("WarmupLR", {"warmup_min_lr": [0.1, 0.2]}, "warmup_min_lr", "1 param groups"),
        ("WarmupLR", {"last_batch_iteration": -3}, "last_batch_iteration", ">= -1"),
        ("WarmupDecayLR", {"total_num_steps": 5, "warmup_num_steps": 10}, "total_num_steps",
         "less than warmup_num_steps"),
        ("WarmupDecayLR", {"total_num_steps": 0}, "total_num_steps", ">= 1"),
        ("WarmupCosineLR", {"total_num_steps": 5, "warmup_num_steps": 10}, "total_num_steps",
         "less than warmup_num_steps"),
        ("WarmupCosineLR", {"total_num_steps": 5000, "cos_min_ratio": 1.5}, "cos_min_ratio", "<= 1"),
        ("WarmupCosineLR", {"total_num_steps": 5000, "warmup_min_ratio": -0.5}, "warmup_min_ratio", ">= 0"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_first_step_size": 0}, "cycle_first_step_size",
         ">= 1"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_second_step_size": -2}, "cycle_second_step_size",
         ">= 1"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_first_stair_count": -1},
         "cycle_first_stair_count", ">= 0"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "decay_step_size": -1}, "decay_step_size", ">= 0"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_momentum": "yes"}, "cycle_momentum",
         "not a boolean"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_max_mom": 1.2}, "cycle_max_mom", "<= 1"),
        ("OneCycle", {"cycle_min_lr": -0.1, "cycle_max_lr": 1}, "cycle_min_lr", ">= 0"),
        ("LRRangeTest", {"lr_range_test_step_size": 0}, "lr_range_test_step_size", ">= 1"),
        ("LRRangeTest", {"lr_range_test_staircase": 1}, "lr_range_test_staircase", "not a boolean"),
        ("LRRangeTest", {"lr_range_test_step_rate": -1.0}, "lr_range_test_step_rate", ">= 0"),
    ],
)
def test_bad_values_name_the_key(type_name, params, key, match):
    expect_config_error(f"scheduler.params.{key}", type_name, params, match=match)


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        WarmupLR(sgd(0.1), warmup_num_steps=0)
