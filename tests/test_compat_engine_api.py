"""DeepSpeed's public engine methods: each is had, added, or refused by name (issue 20, point 3)."""

import pytest

from compat_cases import engine_api_probe
from zerospeed.runtime.engine import ZeroSpeedEngine
from zerospeed.runtime.engine_api import ADDS, DEEPSPEED_ENGINE_METHODS, HAS, LACKS
from zerospeed.testing import run_distributed


def test_the_three_lists_cover_deepspeeds_engine_methods_exactly():
    assert len(DEEPSPEED_ENGINE_METHODS) == 180  # DeepSpeed 0.19.8 deepspeed/runtime/engine.py (ast; communication_data_type has a setter too)
    names = set(DEEPSPEED_ENGINE_METHODS)
    assert set(HAS) | set(ADDS) | set(LACKS) == names
    assert not (set(HAS) & set(LACKS)) and not (set(ADDS) & set(LACKS)) and not (set(HAS) & set(ADDS))
    for name in HAS + ADDS:
        assert hasattr(ZeroSpeedEngine, name), name


@pytest.mark.timeout(90)
def test_engine_members_at_world_2():
    results = run_distributed(engine_api_probe, 2)
    for rank, r in enumerate(results):
        assert r["device"] == "cpu" and r["global_rank"] == rank and r["local_rank"] == rank
        assert r["world_size"] == 2 and r["data_parallel_rank"] == rank
        assert (r["fp16"], r["bf16"], r["stage"], r["zero"]) == (False, True, 2, True)
        assert r["partition_grads"] and not r["partition_weights"]
        assert r["batch_info"] == (16, 4, 2)
        assert r["optimizer_name"] == "AdamW" and r["scheduler_name"] == "WarmupLR" and r["clip"] == 1.0
        assert r["comm_dtype"] == "torch.bfloat16" and r["mom"] == [(0.9, 0.99)]
        assert r["flops"] is False
        assert r["grad_norm"] is not None and r["grad_norm"] > 0 and r["applied"] is True
        assert r["batch_after_set"] == (32, 4, 4)
        assert "set_train_batch_size: 3" in r["bad_batch"]
        assert r["lack_checked"] >= len(LACKS) - 2
        for name, message in r["lack_errors"].items():
            assert f"engine.{name}()" in message and "not supported by zerospeed" in message
    assert results[0]["state_keys"] == ["inp.bias", "inp.weight", "mid.bias", "mid.weight", "out.bias", "out.weight"]
