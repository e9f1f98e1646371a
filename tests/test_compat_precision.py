"""bf16 master weights / optimizer states and torch_autocast (issue 20, point 7).

Memory: with ``bf16_master_weights_and_grads`` + ``bf16_optimizer_states`` at ZeRO-2, world 2, the
fp32 master disappears (the bf16 shard is the master) and Adam's two moments are bf16: per rank
``master_params`` = 0 and ``optimizer_states`` = 2 moments x 2 bytes x shard elements, against
4 x shard (master) + 2 x 4 x shard (moments) with fp32 masters; shard = ceil(N / 2) per bucket
(one bucket here, padded to the world size). Loss: within 5% (relative, every step of 8) of the
same run with fp32 masters, and not identical to it (the setting is read).
"""

import pytest

from compat_cases import precision_runs
from zerospeed.testing import run_distributed

BF16 = {"bf16": {"enabled": True}}
LOW = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
AUTOCAST = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}


@pytest.mark.timeout(120)
def test_bf16_masters_and_states_save_memory_and_track_fp32_masters():
    base, low, fp32, autocast, low3, full = run_distributed(
        precision_runs, 2, [BF16, LOW, {}, AUTOCAST, {**LOW, "_stage": 3},
                            {**LOW, "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}, "_stage": 3}])[0]
    n = base["numel"]
    shard = -(-n // 2)
    assert base["memory"]["master_params"] == 4 * shard
    assert base["memory"]["optimizer_states"] == 2 * 4 * shard
    assert low["memory"]["master_params"] == 0
    assert low["memory"]["optimizer_states"] == 2 * 2 * shard
    saved = (base["memory"]["master_params"] + base["memory"]["optimizer_states"]) - low["memory"]["optimizer_states"]
    assert saved == 8 * shard  # 12 -> 4 bytes per shard element
    assert base["state_dtypes"] == ["torch.float32"] and low["state_dtypes"] == ["torch.bfloat16"]
    assert low["losses"] != base["losses"]
    for a, b in zip(low["losses"], base["losses"]):
        assert abs(a - b) / b < 0.05, (low["losses"], base["losses"])
    assert low3["memory"]["master_params"] == 0 and low3["state_dtypes"] == ["torch.bfloat16"]
    for a, b in zip(low3["losses"], low["losses"]):  # stage 3 trains like stage 2
        assert abs(a - b) / b < 0.02, (low3["losses"], low["losses"])
    # DeepSpeed's bf16_master_weight example config: bf16 + low-precision masters/states + autocast, stage 3
    assert full["memory"]["master_params"] == 0 and full["out_dtype"] == "torch.bfloat16"
    for a, b in zip(full["losses"], low3["losses"]):
        assert abs(a - b) / b < 0.05, (full["losses"], low3["losses"])
    # torch_autocast: fp32 parameters and masters, bf16 compute inside the forward
    assert autocast["param_dtype"] == "torch.float32" and autocast["out_dtype"] == "torch.bfloat16"
    assert autocast["memory"]["optimizer_states"] == 2 * 4 * shard
    for a, b in zip(autocast["losses"], fp32["losses"]):
        assert abs(a - b) / b < 0.05, (autocast["losses"], fp32["losses"])
    assert autocast["losses"] != fp32["losses"]


def _engine_error(extra: dict, stage: int = 2) -> str:
    from compat_cases import precision_run

    try:
        precision_run(extra, stage=stage, steps=1)
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "no error"


def _errors() -> list[str]:
    return [
        _engine_error({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}),
        _engine_error(LOW, stage=0),
        _engine_error({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}),
        _engine_error({**AUTOCAST, "fp16": {"enabled": True}}),
        _engine_error({"torch_autocast": {"enabled": True, "dtype": "fp16"}}),
        _engine_error({"gradient_allreduce_op": "sum"}),
        _engine_error({"data_types": {"grad_accum_dtype": "bf16"}}),
    ]


@pytest.mark.timeout(60)
def test_unsupported_precision_combinations_name_the_key():
    errors = run_distributed(_errors, 1)[0]
    assert "bf16.bf16_master_weights_and_grads" in errors[0] and "bf16_optimizer_states" in errors[0]
    assert "stage 1, 2 or 3" in errors[1]
    assert "fp16.fp16_master_weights_and_grads" in errors[2]
    assert "torch_autocast.enabled" in errors[3] and "fp16" in errors[3]
    assert "torch_autocast.dtype" in errors[4]
    assert "gradient_allreduce_op" in errors[5] and "'sum'" in errors[5]
    assert "data_types.grad_accum_dtype" in errors[6]
