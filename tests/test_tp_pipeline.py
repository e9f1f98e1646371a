"""Pipeline x tensor parallelism: pp2 x tp2 at world 4 against one process.

A PipelineModule of residual MLP blocks (fc_in column-parallel, fc_out row-parallel, chosen by
``tensor_parallel.partition_config`` alone) trains 2 steps of 1F1B with 2 micro-batches, Adam and
gradient clipping at 0.1 (active), so the global norm must sum the tp shards of both stages and
count replicated parameters once. fp32 tolerance: 1e-5 relative on losses; weights (gathered over
the tp group) within 1e-5 relative in Frobenius norm. Checkpoints of a pp x tp engine are refused
with a clear error (not built yet).
"""
import pytest

from tp_cases import pp_reference, pp_tp_training
from zerospeed.testing import run_distributed

TOL = 1e-5


@pytest.mark.timeout(120)
def test_pp2_x_tp2_matches_single_process(tmp_path):
    ref = pp_reference(steps=2, gas=2)
    runs = run_distributed(pp_tp_training, 4, 2, 2, 1, str(tmp_path), timeout=110)
    seen = set()
    for rank, r in enumerate(runs):
        assert r["stage"] == rank // 2  # tp fastest: ranks 0, 1 are stage 0's tp pair
        assert r["kinds"] == ["Linear", "LinearAllreduce", "LinearLayer"]
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"])) < TOL
        for key, value in r["weights"].items():
            want = ref["weights"][key]
            assert value.shape == want.shape, key
            assert float((value - want).norm() / want.norm()) < TOL, f"rank {rank}: {key}"
        seen.update(r["weights"])
        assert "checkpoints and consolidated state dicts of a pipeline x tensor-parallel engine are not supported " \
               "yet" in r["refused"], r["refused"]
    assert seen == set(ref["weights"])
