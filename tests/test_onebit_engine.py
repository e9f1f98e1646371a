"""1-bit Adam through zerospeed.initialize (issue #28): ``optimizer.type`` OneBitAdam / OnebitAdam at ZeRO stage 0.

During warm-up the engine all-reduces the gradients as usual and the optimizer steps plain Adam; after
``freeze_step`` the engine's all-reduce is skipped and the optimizer exchanges 1-bit momenta. The engine run equals
the standalone optimizer (tests/test_onebit_adam.py checks that against one-process references) bit for bit, the
published 1-bit Adam configs run, a checkpoint resumes bit for bit before and after the warm-up, and ZeRO stages > 0
are clear errors (0/1 Adam and 1-bit LAMB: tests/test_onebit_family.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from onebit_engine_cases import engine_run, shared_config_run, standalone_run
from zerospeed.testing import DistributedTestError, run_distributed

CONFIGS = Path("/work/shared/ds_configs")
ONEBIT_ADAM = sorted(CONFIGS.glob("*1-bit_adam*")) if CONFIGS.is_dir() else []


@pytest.mark.timeout(120)
def test_engine_equals_the_standalone_optimizer():
    # world 2: the engine's all-reduce of a flat bucket and the optimizer's per-parameter ones both add two terms,
    # so the warm-up gradients agree to the bit (at 4 ranks the ring's chunking changes the order of the sums)
    world, steps, freeze = 2, 6, 3
    got = run_distributed(engine_run, world, freeze, steps, timeout=100)
    want = run_distributed(standalone_run, world, freeze, steps, timeout=100)
    for r in range(world):
        for step in range(steps):
            for k, v in want[r][step].items():
                assert torch.equal(got[r][step][k], v), (r, step, k)
    assert not torch.equal(got[0][-1]["0.weight"], got[0][freeze - 1]["0.weight"])


@pytest.mark.timeout(120)
def test_replicas_stay_identical_at_world_4():
    got = run_distributed(engine_run, 4, 2, 5, timeout=100)
    for r in range(1, 4):
        for k, v in got[0][-1].items():
            assert torch.equal(got[r][-1][k], v), (r, k)  # every rank decodes the same compressed momentum


def _comms_after_freeze(freeze: int) -> dict:
    import torch.distributed as dist
    from torch import nn

    import zerospeed
    from zerospeed import comm
    from onebit_engine_cases import batch, model

    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "OneBitAdam", "params": {"freeze_step": freeze}}}
    engine, _, _, _ = zerospeed.initialize(model=model(), config=cfg)
    snaps = []
    for step in range(freeze + 1):
        comm.COUNTER.reset()
        x, y = batch(step, dist.get_rank())
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        snaps.append(comm.COUNTER.snapshot())
    return {"warm": snaps[0], "compressed": snaps[-1], "numel": sum(p.numel() for p in engine.module.parameters())}


@pytest.mark.timeout(120)
def test_after_warm_up_only_compressed_momenta_travel():
    r = run_distributed(_comms_after_freeze, 2, 1, timeout=100)[0]
    assert r["warm"]["all_reduce"]["elements"] >= r["numel"]  # the gradients, all-reduced
    sent = sum(s["intra_host_bytes"] + s["inter_host_bytes"] for s in r["compressed"].values())
    assert r["compressed"]["all_reduce"]["elements"] == 1  # the overflow agreement only
    assert sent <= 0.1 * 2 * 4 * r["numel"] // 2  # vs a ring all-reduce of fp32 gradients at world 2


@pytest.mark.timeout(300)
@pytest.mark.skipif(not ONEBIT_ADAM, reason="the shared DeepSpeedExamples configs are not in /work/shared/ds_configs")
@pytest.mark.parametrize("path", ONEBIT_ADAM, ids=[p.name[:40] for p in ONEBIT_ADAM])
def test_published_1bit_adam_configs_run(path):
    got = run_distributed(shared_config_run, 2, str(path), 1, 2, timeout=250)[0]  # warm-up 1, then 1-bit
    assert got["global_steps"] == 2 and all(torch.isfinite(torch.tensor(got["losses"])))


def _stage_1(allow: bool) -> None:
    import zerospeed
    from onebit_engine_cases import model

    zerospeed.initialize(model=model(), config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
                                                "optimizer": {"type": "OneBitAdam"},
                                                "zero_allow_untested_optimizer": allow})


@pytest.mark.timeout(120)
def test_refusals():
    from zerospeed.config.errors import ConfigError
    from zerospeed.config.loader import load_config

    with pytest.raises(DistributedTestError, match="OneBitAdam is not one. Use stage 0"):
        run_distributed(_stage_1, 2, False, timeout=100)
    with pytest.raises(DistributedTestError, match="optimizer.type: OneBitAdam works at ZeRO stage 0"):
        run_distributed(_stage_1, 2, True, timeout=100)
    for name in ("ZeroOneAdam", "OneBitLamb"):  # built since (tests/test_onebit_family.py)
        assert load_config({"train_batch_size": 2, "optimizer": {"type": name}}).optimizer.type == name
    with pytest.raises(ConfigError, match="'SparseAdam': not supported by zerospeed yet"):
        load_config({"train_batch_size": 2, "optimizer": {"type": "SparseAdam"}})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("freeze,save_at", [(3, 2), (2, 3)], ids=["during-warm-up", "after-warm-up"])
def test_engine_checkpoint_resumes_bit_for_bit(tmp_path, freeze, save_at):
    # after the warm-up the error buffers are rank-local state: each rank's are written to its own file
    from onebit_engine_cases import checkpoint_resume

    got = run_distributed(checkpoint_resume, 2, str(tmp_path / "ckpt"), freeze, 6, save_at, timeout=100)
    for r in got:
        for k, v in r["straight"].items():
            assert torch.equal(r["resumed"][k], v), k
