"""Rank functions for the optimizer-offload tests (imported by test_offload.py and by the ranks)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

import engine_cases
import zero3_cases

VARIANTS = [("cpu", 1.0), ("cpu", 0.5), ("nvme", 1.0), ("nvme", 0.5)]


def offload_block(device: str, ratio: float = 1.0, nvme_root: str | None = None, **extra) -> dict:
    block = {"device": device, "ratio": ratio, **extra}
    if device == "nvme":
        block["nvme_path"] = nvme_root
    return block


def make_config(stage: int, offload: dict | None, precision: str = "fp32", gas: int = 2) -> dict:
    """Stages 1-2: the TinyNet config (64-element buckets: several per model); stage 3: the Zoo's."""
    if stage == 3:
        cfg = zero3_cases.config(gas=gas, precision=precision)
    else:
        cfg = engine_cases.config(stage, gas, precision)
    if offload is not None:
        cfg["zero_optimization"]["offload_optimizer"] = offload
    return cfg


def build(cfg: dict):
    import zerospeed

    if cfg["zero_optimization"]["stage"] == 3:
        model = zero3_cases.make_zoo()
        groups, batch = zero3_cases.zoo_groups(model), zero3_cases.zoo_batch
    else:
        model = engine_cases.make_model()
        groups, batch = engine_cases.param_groups(model), engine_cases.global_batch
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=groups, config=cfg)
    return engine, batch


def weights_of(engine) -> dict[str, torch.Tensor]:
    """Full fp32 weights (stage 3: consolidated, on rank 0 only; ``{}`` elsewhere)."""
    if engine.zero_stage == 3:
        return {k: v.float() for k, v in engine.strategy.consolidated_state_dict().items()}
    return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def run_engine(cfg: dict, steps: int = 4) -> dict:
    engine, batch = build(cfg)
    state = engine.strategy.state
    tier = state.offload
    folder = tier.swap_folder if tier is not None else None
    losses, _ = zero3_cases._train(engine, batch, steps)
    out = {"losses": losses, "weights": weights_of(engine), "memory": engine.memory_breakdown(),
           "offloaded": len(state.offloaded), "buckets": len(state.buckets), "swap_folder": folder,
           "swap_files": sorted(os.listdir(folder)) if folder else []}
    engine.destroy()
    out["swap_left_after_destroy"] = bool(folder) and os.path.exists(folder)
    return out


def parity_case(stage: int, nvme_root: str, precision: str = "fp32", variants=tuple(VARIANTS)) -> dict:
    """The run without offload, then each offload variant, in one launch."""
    results = {"none": run_engine(make_config(stage, None, precision))}
    for device, ratio in variants:
        cfg = make_config(stage, offload_block(device, ratio, nvme_root), precision)
        results[f"{device}-{ratio}"] = run_engine(cfg)
    return results


def both_offloads_case(nvme_root: str, opt_device: str, precision: str = "fp32") -> dict:
    """Stage 3 with ``offload_param: nvme`` (buffer_count 1) and ``offload_optimizer``: parity with
    the plain run, and the parameter shards resident during each optimizer step."""
    plain = run_engine(make_config(3, None, precision))
    cfg = make_config(3, offload_block(opt_device, 1.0, nvme_root), precision)
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme_root, "buffer_count": 1,
                                                 "max_in_cpu": 1}  # cache nothing idle
    cfg["zero_optimization"]["sub_group_size"] = 1  # one bucket per swap group: the step's unit of residency
    engine, batch = build(cfg)
    swapper = engine.strategy.swapper
    step_peaks: list[int] = []
    real_step = engine.step

    def step_with_peak() -> None:
        swapper.resident_peak_bytes = swapper.resident_bytes()
        real_step()
        step_peaks.append(swapper.resident_peak_bytes)

    engine.step = step_with_peak
    losses, _ = zero3_cases._train(engine, batch, 4)
    sizes = [e.nbytes for e in swapper.entries.values()]
    out = {"plain": plain, "losses": losses, "weights": weights_of(engine), "step_peak": max(step_peaks),
           "master_params": engine.memory_breakdown()["master_params"],
           "largest": max(sizes), "total": sum(sizes), "num_shards": len(sizes), "reads": swapper.num_reads}
    engine.destroy()
    return out


# -- checkpoints ---------------------------------------------------------------------------------
def _tree_digest(path: str) -> str:
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            full = os.path.join(root, name)
            h.update(full.encode())
            with open(full, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def checkpoint_case(stage: int, nvme_root: str, ckpt_dir: str, save_offload: str, load_offloads: list[str],
                    precision: str = "fp32") -> dict:
    """Train 2 steps with ``save_offload`` ("none"/"cpu"/"nvme"), save, train 2 more (the truth);
    then for each of ``load_offloads`` a fresh engine loads the checkpoint and trains the same 2."""

    def cfg_for(kind: str) -> dict:
        return make_config(stage, None if kind == "none" else offload_block(kind, 1.0, nvme_root), precision)

    engine, batch = build(cfg_for(save_offload))
    zero3_cases._train(engine, batch, 2)
    engine.save_checkpoint(ckpt_dir, tag="two")
    truth, _ = zero3_cases._train(engine, batch, 2, first=2)
    out = {"truth": truth, "truth_weights": weights_of(engine), "loaded": {}}
    engine.destroy()
    for kind in load_offloads:
        fresh, batch = build(cfg_for(kind))
        fresh.load_checkpoint(ckpt_dir, tag="two")
        losses, _ = zero3_cases._train(fresh, batch, 2, first=2)
        out["loaded"][kind] = {"losses": losses, "weights": weights_of(fresh), "global_steps": fresh.global_steps}
        fresh.destroy()
    return out


def read_only_dir(tmp_path) -> str:
    """A directory this process cannot create files in (root ignores permission bits: then a
    kernel file system that refuses writes to everyone)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with open(ro / "probe", "w"):
            pass
    except OSError:
        return str(ro)
    os.unlink(ro / "probe")  # root ignores permission bits: use a directory the kernel refuses
    for candidate in ("/sys", "/proc"):
        try:
            with open(os.path.join(candidate, ".zs-probe"), "w"):
                pass
        except OSError:
            return candidate
    import pytest

    pytest.skip("no directory here refuses writes to this user (root on a fully writable system)")


def gathered_edit_case(nvme_root: str, offload: bool) -> dict:
    """bf16 ZeRO-3: a ``GatheredParameters`` edit on rank 0 between steps must reach the fp32 master
    (swapped to NVMe with offload), so the next steps continue from the edited weight."""
    from zerospeed import zero

    cfg = make_config(3, offload_block("nvme", 1.0, nvme_root) if offload else None, "bf16")
    engine, batch = build(cfg)
    zero3_cases._train(engine, batch, 1)
    with zero.GatheredParameters([engine.module.mid.weight], modifier_rank=0), torch.no_grad():
        if dist.get_rank() == 0:
            engine.module.mid.weight.fill_(0.25)
    losses, _ = zero3_cases._train(engine, batch, 2, first=1)
    out = {"losses": losses, "weights": weights_of(engine), "master_params": engine.memory_breakdown()["master_params"]}
    engine.destroy()
    return out


# -- failures ------------------------------------------------------------------------------------
def error_of(cfg: dict) -> str | None:
    from zerospeed.config import ConfigError

    try:
        engine, _ = build(cfg)
    except (ConfigError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    engine.destroy()
    return None


def full_disk_error(nvme_root: str) -> str | None:
    """``posix_fallocate`` reports ENOSPC, as on a full disk."""

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real = os.posix_fallocate
    os.posix_fallocate = no_space
    try:
        return error_of(make_config(2, offload_block("nvme", 1.0, nvme_root)))
    finally:
        os.posix_fallocate = real


def vanished_swap_file_case(nvme_root: str, ckpt_dir: str) -> dict:
    """Rank 0's swap file is deleted after a checkpoint; the next step must fail on every rank
    (rank 0 naming the file), the checkpoint must be untouched and still load."""
    cfg = make_config(2, offload_block("nvme", 1.0, nvme_root))
    engine, batch = build(cfg)
    zero3_cases._train(engine, batch, 1)
    engine.save_checkpoint(ckpt_dir, tag="one")
    saved = weights_of(engine)
    digest = _tree_digest(ckpt_dir)
    victim = None
    if dist.get_rank() == 0:
        victim = os.path.join(engine.strategy.state.offload.swap_folder, "exp_avg.swp")
        os.unlink(victim)
    dist.barrier()
    error = None
    try:
        zero3_cases._train(engine, batch, 1, first=1)
    except Exception as e:  # noqa: BLE001 - the point of the test
        error = f"{type(e).__name__}: {e}"
    engine.destroy()
    fresh, _ = build(cfg)
    fresh.load_checkpoint(ckpt_dir, tag="one")
    loaded = weights_of(fresh)
    fresh.destroy()
    return {"error": error, "victim": victim, "digest_same": digest == _tree_digest(ckpt_dir),
            "loaded_matches": all(torch.equal(loaded[k], saved[k]) for k in saved)}


# -- the resident-memory bound (run as a fresh process: python offload_cases.py <mode> <nvme_root>) -----
MEM_LAYERS, MEM_DIM = 16, 1024
STATE_BUDGET_BYTES = 48 << 20  # what the offloaded run may keep in memory for optimizer states


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_bound_main(mode: str, nvme_root: str) -> dict:
    """Train a 16.8M-parameter MLP (fp32 Adam moments 134 MB) 3 steps with ZeRO-2 at world size 1,
    without offload or with NVMe offload; report peak RSS growth over the built model."""
    import ctypes

    import zerospeed
    from torch import nn

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # large tensors on mmap: freed memory leaves RSS
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(MEM_DIM, MEM_DIM) for _ in range(MEM_LAYERS)])
    zero = {"stage": 2, "reduce_bucket_size": 2_000_000, "allgather_bucket_size": 2_000_000}
    if mode == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_root, "buffer_count": 2}
        zero["sub_group_size"] = 1_100_000
    cfg = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": zero, "steps_per_print": 0}
    x = torch.randn(4, MEM_DIM)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark: count from here
    base = _status_bytes("VmRSS")
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = []
    for _ in range(3):
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    peak = _status_bytes("VmHWM") - base
    memory = engine.memory_breakdown()
    engine.destroy()
    numel = sum(p.numel() for p in model.parameters())
    return {"peak_growth": peak, "memory": memory, "numel": numel, "losses": losses}


if __name__ == "__main__":
    print(json.dumps(memory_bound_main(sys.argv[1], sys.argv[2])))
