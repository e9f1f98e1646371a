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
