"""The ZeRO memory formulas as a planning tool (no processes)."""

import pytest

from zerospeed.zero.memory import estimate_model_state_bytes

PSI, N = 1_000_000, 4


@pytest.mark.parametrize("stage,expected", [
    (0, (2 * PSI, 2 * PSI, 12 * PSI)),
    (1, (2 * PSI, 2 * PSI, 12 * PSI / N)),
    (2, (2 * PSI, 2 * PSI / N, 12 * PSI / N)),
    (3, (2 * PSI / N, 2 * PSI / N, 12 * PSI / N)),
])
def test_mixed_precision_adam(stage, expected):
    e = estimate_model_state_bytes(PSI, N, stage, "bf16", "adam")
    assert (e.params, e.grads, e.optimizer_states) == expected


def test_fp32_adam_has_no_separate_master():
    e = estimate_model_state_bytes(PSI, N, 2, "fp32", "adamw")
    assert (e.params, e.grads, e.optimizer_states) == (4 * PSI, 4 * PSI / N, 8 * PSI / N)


def test_paper_example_7_5b_on_64_ranks():
    # ZeRO paper, Figure 1: 7.5B parameters, N=64, stage 3 (P_os+g+p): 120 GB -> 1.9 GB.
    assert estimate_model_state_bytes(7_500_000_000, 64, 3, "fp16").total == pytest.approx(1.875e9)
    assert estimate_model_state_bytes(7_500_000_000, 64, 0, "fp16").total == pytest.approx(120e9)


@pytest.mark.parametrize("kwargs,word", [
    (dict(stage=4), "stage"), (dict(precision="fp8"), "precision"), (dict(optimizer="muon"), "optimizer"),
])
def test_errors_name_the_argument(kwargs, word):
    args = dict(num_params=10, dp_world_size=2, stage=1, precision="bf16", optimizer="adam") | kwargs
    with pytest.raises(ValueError, match=word):
        estimate_model_state_bytes(**args)


def test_offloaded_bytes_move_between_tiers_and_sum_up():
    from zerospeed.zero.memory import estimate_offloaded_bytes

    psi, n = 10**9, 8
    none = estimate_offloaded_bytes(psi, n, 3, "bf16")
    assert (none.device, none.host, none.nvme) == (estimate_model_state_bytes(psi, n, 3, "bf16").total, 0.0, 0.0)
    cpu = estimate_offloaded_bytes(psi, n, 2, "bf16", offload_optimizer="cpu")
    assert cpu.device == 2 * psi + 2 * psi / n  # 16-bit params (stage 2: full) + gradient shard
    assert cpu.host == 12 * psi / n and cpu.nvme == 0  # fp32 master + Adam moments
    infinity = estimate_offloaded_bytes(psi, n, 3, "bf16", offload_optimizer="nvme", offload_param="nvme")
    assert (infinity.device, infinity.host, infinity.nvme) == (2 * psi / n, 0.0, 12 * psi / n + 2 * psi / n)
    fp32 = estimate_offloaded_bytes(psi, n, 1, "fp32", offload_optimizer="cpu")
    assert fp32.host == 12 * psi / n  # on an accelerator the fp32 master is a separate host copy
    with pytest.raises(ValueError, match="offload_param needs ZeRO stage 3"):
        estimate_offloaded_bytes(psi, n, 2, offload_param="cpu")
    with pytest.raises(ValueError, match="offload_optimizer must be one of"):
        estimate_offloaded_bytes(psi, n, 2, offload_optimizer="gpu")
