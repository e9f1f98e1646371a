"""Tensor-parallel training through ``initialize``: parity with a single-process run.

The tiny Llama (GQA, untied vocab-parallel LM head) trains 2 steps with Adam (lr 1e-3) and
gradient clipping at 0.05 (active: the norm is ~1), so the clipping norm must count replicated
parameters once. Reference: one process, the same seed, the whole global batch per step.

Tolerances (fp32): losses and the global gradient norm within 1e-5 relative; every final weight
tensor, gathered from the tp (and ZeRO) shards, within 1e-5 relative in Frobenius norm
(||w - w_ref|| / ||w_ref||) and 5e-5 in max-abs over the tensor's max-abs (Adam turns ~1e-7
gradient differences of near-zero elements into slightly larger weight differences).

World 4: tp2 x dp2 at ZeRO 0, 1, 2, 3 and tp4 (ZeRO-2, a model with 4 KV heads) in one process
group, and the loader initialize returns (same micro-batch within a tp group, different across dp). World 2: tp2 (stage 0), tp2 with
ZeRO-2 and CPU optimizer offload, tp through a Megatron-style mpu, ``tp_model_init`` before
``initialize`` (DeepSpeed's order), and a divergent batch across the tp ranks (an error at the
first forward).
"""
import pytest
import torch

from tp_cases import reference_training, tp_training, train_config
from zerospeed.testing import run_distributed

TOL = 1e-5


def _rel(a, b):
    return abs(a - b) / abs(b)


def _check(run, ref, where):
    assert max(_rel(a, b) for a, b in zip(run["losses"], ref["losses"])) < TOL, where
    assert max(_rel(a, b) for a, b in zip(run["norms"], ref["norms"])) < TOL, where
    assert set(run["weights"]) == set(ref["weights"]), where
    for key, want in ref["weights"].items():
        got = run["weights"][key]
        assert got.shape == want.shape, f"{where}: {key}"
        assert float((got - want).norm() / want.norm()) < TOL, f"{where}: {key}"
        assert float((got - want).abs().max() / want.abs().max()) < 5 * TOL, f"{where}: {key}"


@pytest.mark.timeout(150)
def test_tp2_x_dp2_every_zero_stage_matches_single_process():
    ref = reference_training(dp=2)
    assert min(ref["norms"]) > 0.05  # clipping is active
    cases = [(2, train_config(stage, dp=2, tp=2)) for stage in range(4)] + [(2, train_config(1, 2, 2), "loader"),
                                                                             (1, train_config(2, 1, 4), "tp4")]
    runs = run_distributed(tp_training, 4, cases, timeout=140)
    for stage, run in enumerate(runs[0][:4]):
        _check(run, ref, f"tp2xdp2 zero{stage}")
    _check(runs[0][5], reference_training(dp=1, kv_heads=4), "tp4 zero2")
    firsts = [r[4]["first_batch"] for r in runs]  # ranks 0, 1 are dp replica 0's tp group; 2, 3 replica 1's
    assert torch.equal(firsts[0], firsts[1]) and torch.equal(firsts[2], firsts[3])
    assert not torch.equal(firsts[0], firsts[2])
    # each tp rank holds about half the model: the split linears and the LM head are halved
    assert runs[0][0]["param_bytes"] < 0.6 * sum(v.numel() * 4 for v in ref["weights"].values())


@pytest.mark.timeout(120)
def test_tp2_offload_mpu_and_divergent_batch():
    ref = reference_training(dp=1)
    offload = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    cases = [(1, train_config(0, dp=1, tp=2)),
             (1, train_config(2, dp=1, tp=2, zero_optimization=offload)),
             (1, train_config(1, dp=1, tp=1), "mpu"),
             (1, train_config(0, dp=1, tp=2), "diverge"),
             (1, train_config(1, dp=1, tp=1), "tp_model_init")]
    runs = run_distributed(tp_training, 2, cases, timeout=110)
    for i, where in [(0, "tp2 zero0"), (1, "tp2 zero2 offload"), (2, "tp2 via mpu, zero1"),
                     (4, "tp_model_init then initialize, zero1")]:
        _check(runs[0][i], ref, where)
    errors = [r[3]["error"] for r in runs]
    assert errors[0].startswith("tensor parallelism: the micro-batch on rank 1 differs from rank 0's in tp group "
                                "[0, 1]"), errors[0]
    assert errors[1].startswith("tensor parallelism: the micro-batch on rank 0 differs from rank 1's"), errors[1]
