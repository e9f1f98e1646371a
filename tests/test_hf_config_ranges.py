"""Numeric config values that have the right type but no meaning are refused, naming the key.

Pure data: no processes. Each case is a value just outside the range in which the derived quantity
(the loss scale, a reciprocal, a timeout, a seed...) is finite or meaningful, and the value just
inside it is accepted.
"""

import pytest

from zerospeed.config import ConfigError, load_config

BASE = {"train_batch_size": 2}

CASES = [  # (section dict, key in the error, bad value, good value)
    ({"fp16": {"enabled": True}}, "fp16.initial_scale_power", 128, 127),
    ({"fp16": {"enabled": True}}, "fp16.initial_scale_power", -1, 0),
    ({"fp16": {"enabled": True}}, "fp16.loss_scale", 1e39, 65536.0),
    ({"fp16": {"enabled": True}}, "fp16.min_loss_scale", 0, 1e-3),
    ({"fp16": {"enabled": True}}, "fp16.min_loss_scale", 1e39, 1.0),
    ({}, "gradient_predivide_factor", 1e-300, 1e-30),
    ({}, "gradient_predivide_factor", 1e39, 1e30),
    ({}, "seed", 2 ** 64, 2 ** 64 - 1),
    ({}, "seed", -(2 ** 63) - 1, -(2 ** 63)),
    ({}, "zero_optimization.sub_group_size", 0, 1),
    ({}, "zero_optimization.stage3_collective_timeout_s", 1e20, 86400.0),
    ({}, "zero_optimization.offload_param.buffer_size", 0, 1),
    ({}, "zero_optimization.offload_optimizer.cpuadam_cores_perc", 0.0, 0.01),
    ({}, "autotuning.exp_timeout", 1e20, 86400.0),
    ({}, "autotuning.exp_timeout", 0, 1.0),
    ({}, "flops_profiler.recompute_fwd_factor", 1.5, 1.0),
]


def _with(key: str, value, section: dict) -> dict:
    cfg = {**BASE, **{k: dict(v) for k, v in section.items()}}
    parts = key.split(".")
    node = cfg
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if p in ("offload_param", "offload_optimizer"):
            node.setdefault("device", "cpu")
    node[parts[-1]] = value
    return cfg


@pytest.mark.parametrize("section,key,bad,good", CASES, ids=[f"{c[1]}={c[2]}" for c in CASES])
def test_out_of_range_numbers_are_refused_naming_the_key(section, key, bad, good):
    with pytest.raises(ConfigError) as err:
        load_config(_with(key, bad, section))
    assert err.value.key_path == key, str(err.value)
    assert "out of range" in str(err.value) or "not allowed" in str(err.value)
    load_config(_with(key, good, section))  # the edge of the range is accepted


def test_loss_scale_power_overflowing_fp32_is_named():
    with pytest.raises(ConfigError, match=r"fp16.initial_scale_power: 1000 .*overflow fp32"):
        load_config({**BASE, "fp16": {"enabled": True, "initial_scale_power": 1000}})


def test_min_loss_scale_above_the_initial_scale_is_refused():
    with pytest.raises(ConfigError) as err:
        load_config({**BASE, "fp16": {"enabled": True, "initial_scale_power": 4, "min_loss_scale": 32}})
    assert err.value.key_path == "fp16.min_loss_scale" and "2**initial_scale_power = 16" in str(err.value)
    # a static scale ignores min_loss_scale
    load_config({**BASE, "fp16": {"enabled": True, "loss_scale": 8, "initial_scale_power": 4, "min_loss_scale": 32}})
