"""Two ranks on one device, parametrized by device: ZeRO stages 1-3 at world size 2 against the plain
PyTorch reference on that device (fp32, losses and weights within 1e-5 relative, as
tests/test_engine_parity.py).

NCCL needs one GPU per rank, so on a machine with a single GPU the two ranks use **gloo with CUDA
tensors** (``DS_ACCELERATOR=cuda`` in each rank, see ``comm.device_for_backend``): gloo carries CUDA
tensors for all-reduce and broadcast (staging them through host memory), which is all zerospeed's gloo
path uses (reduce-scatter and all-gather are done as all-reduces on gloo, ``comm.collectives``). This is a
check that the engine's state and collectives live on the GPU across ranks, not of NCCL; NCCL at world
size 1 is in tests/test_device_parity.py. On ``cpu`` the same runs use CPU tensors; ``cuda`` is skipped
("no CUDA device") where there is none.
"""

from __future__ import annotations

import pytest

import engine_cases
from device_cases import multirank_train, reference_run, rel_losses
from device_util import DEVICES, world_of_one
from zerospeed.testing import run_distributed

FP32_TOL = 1e-5


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("device", DEVICES)
def test_two_ranks_over_gloo_match_torch_reference(device, stage):
    results = run_distributed(multirank_train, 2, device, stage, timeout=200)
    with world_of_one(device) as dev:  # the reference under the same pinned numerics, in this process
        ref_losses, ref_weights = reference_run(dev, 2)
    for rank, r in enumerate(results):
        assert r["backend"] == "gloo" and r["device"].startswith(device), (rank, r["device"])
        assert device in r["param_devices"], (rank, r["param_devices"])
        assert rel_losses(r["losses"], ref_losses) < FP32_TOL, (rank, r["losses"], ref_losses)
        assert r["global_steps"] == engine_cases.STEPS
    assert engine_cases.max_rel_err(results[0]["weights"], ref_weights) < FP32_TOL  # consolidated on rank 0
