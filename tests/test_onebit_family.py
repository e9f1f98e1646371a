"""0/1 Adam (ZeroOneAdam) and 1-bit LAMB (OneBitLamb), issue #28, against one-process references.

* each equals its uncompressed reference exactly while it is uncompressed (0/1 Adam: the first variance steps, every
  one averaged, are Adam without bias correction; 1-bit LAMB: the warm-up is LAMB), and a one-process simulation of
  the whole algorithm for every rank (tests/onebit_family_cases.py, written from DeepSpeed's formulas, with
  simulate_compressed_all_reduce as the collective) exactly after it, at world 2 and 4;
* through zerospeed.initialize (ZeRO stage 0) each equals the optimizer alone bit for bit;
* an engine checkpoint taken after the warm-up (0/1 Adam: between two synchronisations, where parameters differ per
  rank) resumes bit for bit at the same world size, and at another world size installs exactly the documented
  reshard of every rank's error buffers (zerospeed.ops.onebit_common);
* the published DeepSpeedExamples 0/1 Adam and 1-bit LAMB configs run on a small model; bad values and ZeRO stages
  above 0 are one line naming the key.
Gradients are exact dyadic numbers (tests/onebit_cases.py), so the averaged ones are exact in any summation order:
bit-for-bit equality is the tolerance the arithmetic allows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from onebit_family_cases import (LAMB, ZO, adam_without_bias_correction, checkpoint_run, engine_run, lamb_reference,
                                 plain_lamb, standalone_run, train, zoadam_reference)
from zerospeed.ops.onebit_common import SERVER, WORKER, padded_numel, reshard_rank_local
from zerospeed.testing import DistributedTestError, run_distributed

CONFIGS = Path("/work/shared/ds_configs")
PUBLISHED = sorted(p for p in CONFIGS.glob("*.json") if any(k in p.name for k in ("01adam", "1-bit_lamb"))) \
    if CONFIGS.is_dir() else []
STEPS = 14


def _equal_histories(got: list[dict], want: list, world: int) -> None:
    for r in range(world):
        for step in range(STEPS):
            for a, b in zip(got[r]["history"][step], want[step][r]):
                assert torch.equal(a, b), (world, r, step)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 4])
def test_zero_one_adam_equals_its_simulation(world):
    got = run_distributed(train, world, "zoadam", ZO, STEPS, timeout=120)
    want = zoadam_reference(world, STEPS)
    _equal_histories(got, want, world)
    # uncompressed while every step is a variance step (steps 1-4 with var_update_scaler 2): plain Adam, exactly
    plain = adam_without_bias_correction(5, world)
    for step in range(5):
        same = all(torch.equal(a, b) for a, b in zip(got[0]["history"][step], plain[step]))
        assert same == (step < 4), step  # step 5 is the first with a compressed gradient
    # frozen from step 8 (var_freeze_step 6): local steps make the ranks differ; a synchronisation brings them back
    # together up to the rounding of undoing the local updates (p - acc), as in DeepSpeed
    diffs = [((torch.cat([x.reshape(-1) for x in got[0]["history"][step]]) -
               torch.cat([x.reshape(-1) for x in got[1]["history"][step]])).abs().max()).item() for step in range(STEPS)]
    assert max(diffs[:7]) == 0.0 and max(diffs[7:]) > 1e-4 and min(diffs[7:]) < 1e-6, diffs


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 4])
def test_onebit_lamb_equals_its_simulation(world):
    got = run_distributed(train, world, "lamb", LAMB, STEPS, timeout=120)
    want = lamb_reference(world, STEPS)
    _equal_histories(got, want, world)
    plain = plain_lamb(STEPS, world)
    freeze = LAMB["freeze_step"]
    for step in range(STEPS):
        same = all(torch.equal(a, b) for a, b in zip(got[0]["history"][step], plain[step]))
        assert same == (step < freeze), step  # LAMB exactly during warm-up, compressed after
    assert set(got[0]["rank_local"]) == {"p0.worker_error", "p0.server_error", "p0.momentum_pad"}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", ["ZeroOneAdam", "OneBitLamb"])
def test_engine_equals_the_optimizer_alone(name):
    # world 2: the engine's flat all-reduce and the optimizer's per-parameter ones add the same two terms
    steps = 10
    got = run_distributed(engine_run, 2, name, steps, timeout=120)
    want = run_distributed(standalone_run, 2, name, steps, timeout=120)
    for r in range(2):
        for step in range(steps):
            for k, v in want[r][step].items():
                assert torch.equal(got[r][step][k], v), (r, step, k)
    assert not torch.equal(got[0][-1]["0.weight"], got[0][4]["0.weight"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["ZeroOneAdam", "OneBitLamb", "OneBitAdam", "ZeroOneAdam-bf16"])
def test_checkpoint_after_warm_up_resumes_bit_for_bit(name, tmp_path):
    # -bf16: the optimizer steps fp32 masters behind bf16 parameters; 0/1 Adam's local masters come back too
    straight = run_distributed(checkpoint_run, 2, name, str(tmp_path / "x"), range(10), False, False, timeout=100)
    first = run_distributed(checkpoint_run, 2, name, str(tmp_path / "c"), range(7), True, False, timeout=100)
    resumed = run_distributed(checkpoint_run, 2, name, str(tmp_path / "c"), range(7, 10), False, True, timeout=100)
    for r in range(2):
        assert first[r]["saved"] and any(k.endswith("worker_error") for k in first[r]["saved"])
        for k, v in straight[r]["weights"].items():
            assert torch.equal(resumed[r]["weights"][k], v), (r, k)
        for k, v in first[r]["saved"].items():
            assert torch.equal(resumed[r]["loaded"][k], v), (r, k)  # each rank got its own back
    assert not all(torch.equal(a, b) for a, b in zip(first[0]["saved"].values(), first[1]["saved"].values()))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["ZeroOneAdam", "OneBitLamb"])
def test_checkpoint_at_another_world_size_reshards_the_error_buffers(name, tmp_path):
    first = run_distributed(checkpoint_run, 2, name, str(tmp_path / "c"), range(7), True, False, timeout=100)
    resumed = run_distributed(checkpoint_run, 4, name, str(tmp_path / "c"), range(7, 9), False, True, timeout=100)
    saved = [first[r]["saved"] for r in range(2)]
    lengths = first[0]["error_lengths"]
    for r in range(4):
        loaded = resumed[r]["loaded"]
        for key in saved[0]:
            if key.endswith("server_error"):
                whole = torch.cat([saved[0][key], saved[1][key]])[:lengths[key]]
                chunk = padded_numel(lengths[key], 4) // 4
                want = torch.zeros(padded_numel(lengths[key], 4))
                want[:whole.numel()] = whole
                want = want[r * chunk:(r + 1) * chunk]
            elif key.endswith("momentum_pad"):
                continue  # re-laid out (zeros) at the first compressed step at the new size
            else:
                want = (saved[0][key] + saved[1][key]) / 2
                if key.endswith("worker_error"):
                    n = lengths[key]
                    want = torch.cat([want[:n], torch.zeros(padded_numel(n, 4) - n)])
            assert torch.equal(loaded[key], want), (r, key)
        assert all(torch.isfinite(torch.tensor(resumed[r]["losses"])))


def test_reshard_rule():
    a = {"p0.worker_error": torch.tensor([1.0, 2.0, 3.0, 0.5]), "p0.server_error": torch.tensor([4.0, 5.0])}
    b = {"p0.worker_error": torch.tensor([3.0, 4.0, 5.0, 0.5]), "p0.server_error": torch.tensor([6.0, 7.0])}
    kinds, lengths = {"p0.server_error": SERVER, "p0.worker_error": WORKER}, {"p0.server_error": 3, "p0.worker_error": 3}
    same = reshard_rank_local([a, b], kinds, lengths, 1, 2)
    assert torch.equal(same["p0.worker_error"], b["p0.worker_error"]) and same["p0.server_error"] is not b["p0.server_error"]
    one = reshard_rank_local([a, b], kinds, lengths, 0, 1)  # one rank: padded to 8, the whole server vector
    assert one["p0.worker_error"].tolist() == [2.0, 3.0, 4.0, 0, 0, 0, 0, 0]
    assert one["p0.server_error"].tolist() == [4.0, 5.0, 6.0, 0, 0, 0, 0, 0]
    assert padded_numel(3, 2) == 16 and padded_numel(17, 4) == 32 and padded_numel(5, 3) == 72


def _published(path: str, steps: int) -> dict:
    import torch.distributed as dist
    from torch import nn

    import zerospeed
    from onebit_engine_cases import batch, model

    cfg = json.load(open(path))
    params = cfg["optimizer"]["params"]
    for key in ("var_freeze_step", "freeze_step"):  # shortened, so that the run reaches the compressed phase
        if key in params:
            params[key] = 2
    engine, opt, _, _ = zerospeed.initialize(model=model(), config=cfg)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses = []
    for step in range(steps):
        for k in range(gas):
            x, y = batch(1000 * step + k, dist.get_rank(), micro)
            loss = nn.functional.mse_loss(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
        losses.append(float(loss))
    return {"losses": losses, "global_steps": engine.global_steps, "type": type(opt).__name__,
            "compressing": opt.communicates_gradients()}


@pytest.mark.timeout(300)
@pytest.mark.skipif(not PUBLISHED, reason="the shared DeepSpeedExamples configs are not in /work/shared/ds_configs")
@pytest.mark.parametrize("path", PUBLISHED, ids=[p.name[-45:] for p in PUBLISHED])
def test_published_configs_run(path):
    got = run_distributed(_published, 2, str(path), 4, timeout=280)[0]
    assert got["type"] in ("ZeroOneAdam", "OneBitLamb") and got["global_steps"] == 4
    assert got["compressing"] and all(torch.isfinite(torch.tensor(got["losses"])))


def _stage(name: str, stage: int) -> None:
    import zerospeed
    from onebit_engine_cases import model

    zerospeed.initialize(model=model(), config={"train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True,
                                                "zero_optimization": {"stage": stage}, "optimizer": {"type": name}})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["ZeroOneAdam", "OneBitLamb"])
def test_refusals(name):
    from zerospeed.config.errors import ConfigError
    from zerospeed.ops.optimizers import build_optimizer

    with pytest.raises(DistributedTestError, match=f"optimizer.type: {name} works at ZeRO stage 0"):
        run_distributed(_stage, 2, name, 2, timeout=100)
    p = [torch.nn.Parameter(torch.zeros(3))]
    bad = {"ZeroOneAdam": [({"var_freeze_step": -1}, "var_freeze_step"), ({"local_step_clipper": 0}, "local_step_clipper"),
                           ({"comm_backend_name": "gloo"}, "comm_backend_name"), ({"amsgrad": True}, "amsgrad")],
           "OneBitLamb": [({"factor_min": 5.0}, "factor_min"), ({"coeff_beta": 1.0}, "coeff_beta"),
                          ({"freeze_step": 1.5}, "freeze_step"), ({"max_coeff": 0.001}, "min_coeff")]}[name]
    for params, key in bad:
        with pytest.raises(ConfigError, match=f"optimizer.params.{key}"):
            build_optimizer(name, params, p)
    with pytest.raises(ConfigError, match="optimizer.params.no_such_key"):
        build_optimizer(name, {"no_such_key": 1}, p)
