"""offload_optimizer.device nvme with a host-held (non-Adam) optimizer: Muon, Lion, NAdam (issue #30).

The states go to the swap files and come back unchanged (fp32 in, fp32 out) and the optimizer's own step
runs on them as with ``device: cpu``, so the NVMe run must equal the cpu-offload run bit for bit (same
ranks, same reductions, same arithmetic): losses and weights compared with ``==``. A checkpoint saved
mid-run and loaded by a fresh engine must continue it bit for bit too. Muon's config also puts its
non-matrix parameters on Adam, so its states come in two kinds (momentum; exp_avg / exp_avg_sq). Muon
steps with all its states read in (one exchange of whole matrices per step); Lion and NAdam step swap group
by swap group (``sub_group_size`` 64: one bucket each) on views of the swap buffers.
"""

import os

import pytest
import torch
import torch.distributed as dist

from muon_cases import MUON_PARAMS, config, global_batch, make_model
from zerospeed.testing import run_distributed

STEPS = 4
SAVE_AFTER = 2
OPTIMIZERS = {
    "Muon": dict(MUON_PARAMS),
    "Lion": {"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.1},
    "NAdam": {"lr": 0.02, "momentum_decay": 0.004},
}


#: variant -> (optimizer, offload ratio, bf16): the ratio-0.5 bf16 Lion has buckets that are not offloaded
#: (stepped by the same optimizer, outside the swap groups) and fp32 masters apart from the bf16 model
VARIANTS = {"Muon": ("Muon", 1.0, False), "Lion": ("Lion", 1.0, False), "NAdam": ("NAdam", 1.0, False),
            "Lion_half_bf16": ("Lion", 0.5, True)}


def _cfg(stage, variant, device, nvme_path):
    name, ratio, bf16 = VARIANTS[variant]
    cfg = config(stage)
    cfg["optimizer"] = {"type": name, "params": dict(OPTIMIZERS[name])}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    off = {"device": device, "ratio": ratio}
    if device == "nvme":
        off.update(nvme_path=nvme_path, buffer_count=2)
    cfg["zero_optimization"]["offload_optimizer"] = off
    cfg["zero_optimization"]["sub_group_size"] = 64  # several swap groups
    return cfg


def _train(engine, steps, save=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        x, y = global_batch(step)
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if save is not None and step + 1 == SAVE_AFTER:
            engine.save_checkpoint(save, tag="t")
    from zerospeed.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return losses, weights


def _runs(stage, root):
    import zerospeed

    rank = dist.get_rank()
    out = {}
    for name in VARIANTS:
        nvme = os.path.join(root, f"{name}_swap")
        ckpt = os.path.join(root, f"{name}_ckpt")
        if rank == 0:
            os.makedirs(nvme, exist_ok=True)
        dist.barrier()
        cpu_engine, _, _, _ = zerospeed.initialize(model=make_model(), config=_cfg(stage, name, "cpu", nvme))
        cpu_losses, cpu_weights = _train(cpu_engine, range(STEPS))
        cpu_mem = cpu_engine.memory_breakdown()
        cpu_engine.destroy()
        engine, opt, _, _ = zerospeed.initialize(model=make_model(), config=_cfg(stage, name, "nvme", nvme))
        losses, weights = _train(engine, range(STEPS), save=ckpt)
        mem = engine.memory_breakdown()
        swapped_left = [k for st in opt.state.values() for k, v in st.items() if torch.is_tensor(v) and v.numel() > 1]
        engine.destroy()
        resumed, _, _, _ = zerospeed.initialize(model=make_model(), config=_cfg(stage, name, "nvme", nvme))
        resumed.load_checkpoint(ckpt, tag="t")
        res_losses, res_weights = _train(resumed, range(SAVE_AFTER, STEPS))
        resumed.destroy()
        dist.barrier()  # both ranks' swap folders are in one nvme_path: both engines destroyed first
        out[name] = {
            "same_losses": losses == cpu_losses,
            "same_weights": all(torch.equal(weights[k], cpu_weights[k]) for k in cpu_weights),
            "resumed_losses": res_losses == cpu_losses[SAVE_AFTER:],
            "resumed_weights": all(torch.equal(res_weights[k], cpu_weights[k]) for k in cpu_weights),
            "cpu_states": cpu_mem["optimizer_states"], "states": mem["optimizer_states"],
            "nvme": mem.get("optimizer_states_nvme", 0), "buffers": mem.get("offload_buffers", 0),
            "swapped_left": swapped_left, "swap_files_left": os.listdir(os.path.join(nvme, "zerospeed_swap"))
            if os.path.isdir(os.path.join(nvme, "zerospeed_swap")) else [],
        }
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [2, 3])
def test_nvme_equals_cpu_offload_and_resumes(stage, tmp_path):
    for rank, res in enumerate(run_distributed(_runs, 2, stage, str(tmp_path), timeout=110)):
        for name, r in res.items():
            what = f"{name} stage {stage} rank {rank}"
            assert r["same_losses"] and r["same_weights"], what
            assert r["resumed_losses"] and r["resumed_weights"], what
            # the element-wise states are on disk, not in memory (only scalars such as 'step' stay)
            if VARIANTS[name][1] == 1.0:
                assert r["swapped_left"] == [] and r["states"] == 0 < r["cpu_states"], what
                assert r["nvme"] >= r["cpu_states"], what
            else:  # the buckets that are not offloaded keep their states in memory
                assert 0 < r["states"] < r["cpu_states"] and r["nvme"] > 0, what
            assert r["buffers"] > 0, what
            assert r["swap_files_left"] == [], what  # destroy() removed the swap folders


def _vanished(root):
    import zerospeed

    out = {}
    for name in ("Muon", "Lion"):  # read-all step, and the swap-group step
        nvme = os.path.join(root, name)
        if dist.get_rank() == 0:
            os.makedirs(nvme)
        dist.barrier()
        engine, _, _, _ = zerospeed.initialize(model=make_model(), config=_cfg(2, name, "nvme", nvme))
        _train(engine, range(1))
        victim = None
        if dist.get_rank() == 0:
            folder = engine.strategy.state.host_nvme.swap_folders[0]
            victim = os.path.join(folder, sorted(os.listdir(folder))[0])
            os.unlink(victim)
        dist.barrier()
        try:
            _train(engine, range(1, 2))
            error = None
        except Exception as e:  # noqa: BLE001 - the point of the test
            error = f"{type(e).__name__}: {e}"
        engine.destroy()
        out[name] = {"victim": victim, "error": error}
    return out


@pytest.mark.timeout(120)
def test_vanished_swap_file_fails_every_rank(tmp_path):
    # rank 0 names the file; rank 1 stops too instead of waiting in the next collective
    results = run_distributed(_vanished, 2, str(tmp_path), timeout=110)
    for name in ("Muon", "Lion"):
        first, second = results[0][name], results[1][name]
        assert first["victim"] in (first["error"] or "") and "disappeared" in first["error"], name
        assert "rank(s) [0]" in (second["error"] or ""), name
