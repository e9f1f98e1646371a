"""The training side of issue #25: the ``adam_kernel`` and ``direct_io`` fast paths and the engine's
``fast_paths`` config section.

Each forced choice gives the reference's result: Adam weights after a few steps through
``zerospeed.initialize`` against ``torch.optim.AdamW`` - equal when both run the same torch
implementation on the same tensors (stage 0), and within a bound derived from the arithmetic across
families or on flat shards (:func:`adam_rounding_bound`) - and direct I/O reads back the bytes it
wrote, with the path that ran visible in the handle's per-mode block counters. Bad switches are errors
naming the key; a forced ``direct_io: on`` on a file system that refuses O_DIRECT names the switch and
the folder; the engine logs one start-up line.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import os
import uuid

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.config import ConfigError, load_config
from zerospeed.config.fast_paths import SETTINGS
from zerospeed.ops.adam import CPUAdam, FusedAdam
from zerospeed.ops.adam.kernel_choice import switch_of
from zerospeed.ops.aio import AIOError, AsyncIOHandle, new_aligned_tensor
from zerospeed.ops.aio import engine as aio_engine
from zerospeed.ops.fast_paths import ENV_VAR, PATHS, FastPathError
from zerospeed.testing import run_distributed

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01
STEPS = 3
D_IN, D_A, D_B = 48, 40, 24
KiB = 1024


# --------------------------------------------------------------------------------------------- config


def test_config_values_are_the_choosers():
    assert set(SETTINGS) <= set(PATHS)
    for name, allowed in SETTINGS.items():
        assert allowed == PATHS[name], name


@pytest.mark.parametrize("key,value", [("adam_kernel", "x"), ("adam_kernel", "Fused"), ("direct_io", True),
                                       ("direct_io", "yes"), ("cpu_kernels", 1), ("greedy_head", "fp8")])
def test_bad_switch_values_name_the_key_and_the_allowed_values(key, value):
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 1, "fast_paths": {key: value}})
    assert str(info.value) == (f"zerospeed config: fast_paths.{key}: {value!r} is not one of "
                               f"{', '.join(SETTINGS[key])}")


def test_unknown_switch_and_wrong_section_type():
    with pytest.raises(ConfigError, match=r"fast_paths\.adam_kernal: unknown key; did you mean 'adam_kernel'\?"):
        load_config({"train_batch_size": 1, "fast_paths": {"adam_kernal": "auto"}})
    with pytest.raises(ConfigError, match=r"fast_paths: 'fused' is not a JSON object"):
        load_config({"train_batch_size": 1, "fast_paths": "fused"})


def test_defaults_and_forced_values_parse():
    cfg = load_config({"train_batch_size": 1})
    assert cfg.fast_paths.settings() == dict.fromkeys(SETTINGS, "auto")
    cfg = load_config({"train_batch_size": 1, "fast_paths": {"adam_kernel": "foreach", "direct_io": "off",
                                                             "cpu_kernels": "on", "greedy_head": "int8"}})
    assert (cfg.fast_paths.adam_kernel, cfg.fast_paths.direct_io) == ("foreach", "off")


# ------------------------------------------------------------------------------ Adam: the arithmetic


def _ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(x)) - 23)


def adam_rounding_bound(steps: int, lr: float, betas: tuple[float, float], w_max: float) -> float:
    """How far two fp32 implementations of the same AdamW steps can end apart, per element, when the
    gradients do not depend on the weights (so differences do not feed back).

    Per step s and per implementation: the decoupled decay and the final update each round the weight
    once (<= 1 ulp of max|w| each); the update lr * m^/(sqrt(v^) + eps) takes <= 12 roundings of
    2^-24 relative to its size, which is <= lr * R_s (Cauchy-Schwarz: |m^/sqrt(v^)| <=
    (1-b1) sqrt(1-b2^s) / ((1-b1^s) sqrt(1-b2)) * sqrt(sum_{j<s} (b1^2/b2)^j)); the state recursions
    add <= 3 roundings per step each: v is a sum of non-negative terms (relative error <= 3s * 2^-24,
    half of it in sqrt(v)), while m may cancel, so its absolute error (<= 3s * 2^-24 * max|g|) is
    divided by sqrt(v_s) >= sqrt((1-b2) b2^(s-1)) * max|g|. Both implementations err, hence the 2s.
    """
    b1, b2 = betas
    total = 0.0
    for s in range(1, steps + 1):
        corr = math.sqrt(1 - b2 ** s) / (1 - b1 ** s)
        r_s = (1 - b1) * corr / math.sqrt(1 - b2) * math.sqrt(sum((b1 * b1 / b2) ** j for j in range(s)))
        m_term = 3 * s * (1 - b1) * corr / math.sqrt((1 - b2) * b2 ** (s - 1))
        update = lr * 2.0 ** -24 * (12 * r_s + 1.5 * s * r_s + m_term)
        total += 2 * (2 * _ulp(w_max) + update)
    return total


class Twin(nn.Module):
    """Two linear maps of one input: the loss ``(out * C).sum()`` is linear in the weights, so the
    gradients are the same whatever the weights (no feedback of rounding differences)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D_IN, D_A)
        self.b = nn.Linear(D_IN, D_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), self.b(x)], dim=-1)


def _batches():
    g = torch.Generator().manual_seed(1)
    coef = torch.randn(D_A + D_B, generator=g)
    return [(torch.randn(8, D_IN, generator=g), coef) for _ in range(STEPS)]


def _fresh_model() -> Twin:
    torch.manual_seed(0)
    return Twin()


def _reference(kernel: str) -> list[torch.Tensor]:
    model = _fresh_model()
    flags = {"forloop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[kernel]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **flags)
    for x, coef in _batches():
        opt.zero_grad()
        (model(x) * coef).sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _engine_run(kernel: str, zero: dict) -> tuple[list[torch.Tensor], object]:
    model = _fresh_model()
    # gradient_clipping 0: the torch references do not clip (DeepSpeed's and zerospeed's default is 1.0, issue #27)
    cfg = {"train_batch_size": 8, "steps_per_print": 0, "zero_optimization": zero, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}},
           "fast_paths": {"adam_kernel": kernel}}
    engine, opt, _, _ = zerospeed.initialize(model=model, config=cfg)
    for x, coef in _batches():
        engine.backward((engine(x) * coef).sum())
        engine.step()
    return [p.detach().clone() for p in model.parameters()], engine


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def references():
    return {k: _reference(k) for k in ("forloop", "foreach", "fused")}


def test_the_bound_is_tight_enough_to_see_a_wrong_update(references):
    """The bound is a few ulps: an update off by one part in 10^4 (a wrong lr, a missed step) breaks it."""
    w_max = max(float(p.abs().max()) for p in references["forloop"])
    bound = adam_rounding_bound(STEPS, LR, BETAS, w_max)
    assert bound < 1e-4 * LR
    # fused rounds in another order than the for-loop: within the bound
    assert _max_diff(references["fused"], references["forloop"]) <= bound
    assert all(torch.equal(a, b) for a, b in zip(references["foreach"], references["forloop"]))


@pytest.mark.parametrize("kernel", ["forloop", "foreach", "fused"])
def test_stage0_forced_kernel_equals_torch_of_that_family(kernel, references, caplog):
    with caplog.at_level(logging.INFO, logger="zerospeed"):
        got, engine = _engine_run(kernel, {"stage": 0})
    opt = engine.optimizer
    assert switch_of(opt).kernel == kernel
    assert bool(opt.param_groups[0]["fused"]) is (kernel == "fused")
    assert opt.param_groups[0]["foreach"] is (kernel == "foreach")
    assert all(torch.equal(a, b) for a, b in zip(got, references[kernel]))  # the same torch code, same tensors
    w_max = max(float(p.abs().max()) for p in references["forloop"])
    assert _max_diff(got, references["forloop"]) <= adam_rounding_bound(STEPS, LR, BETAS, w_max)
    line = [r.getMessage() for r in caplog.records if "zerospeed fast paths:" in r.getMessage()]
    assert len(line) == 1, line
    assert f"adam_kernel={kernel}" in line[0] and f"optimizer AdamW: {kernel} (forced)" in line[0]
    assert "direct_io=auto" in line[0] and "greedy_head=auto (inference)" in line[0]


@pytest.mark.parametrize("kernel", ["auto", "forloop", "foreach", "fused"])
def test_offloaded_step_with_each_kernel_matches_torch_adamw(kernel, references, caplog):
    """Stage 2 with the optimizer step offloaded to CPU Adam (flat shards, chunks on the worker pool)."""
    with caplog.at_level(logging.INFO, logger="zerospeed"):
        got, engine = _engine_run(kernel, {"stage": 2, "offload_optimizer": {"device": "cpu"}})
    tier = engine.strategy.state.offload
    assert tier.kernel == kernel if kernel != "auto" else tier.kernel in ("forloop", "foreach", "fused")
    w_max = max(float(p.abs().max()) for p in references["forloop"])
    bound = adam_rounding_bound(STEPS, LR, BETAS, w_max)
    for family in ("forloop", "fused"):
        assert _max_diff(got, references[family]) <= bound, family
    line = [r.getMessage() for r in caplog.records if "zerospeed fast paths:" in r.getMessage()]
    assert len(line) == 1 and f"offloaded step: {tier.kernel}" in line[0]
    if kernel == "auto":  # the choice was measured and reported with its timings
        assert "adam_kernel[cpu float32/float32" in line[0] and "(measured;" in line[0]


def test_auto_settles_at_startup_with_timings_and_env_fills_in_auto(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="zerospeed"):
        _, engine = _engine_run("auto", {"stage": 1})
    switch = switch_of(engine.optimizer)
    assert switch.kernel in ("forloop", "foreach", "fused") and switch.reason == "measured"
    monkeypatch.setenv(ENV_VAR, "adam_kernel=foreach")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zerospeed"):
        got, engine = _engine_run("auto", {"stage": 0})
    assert switch_of(engine.optimizer).kernel == "foreach"
    assert any(f"adam_kernel=foreach (from {ENV_VAR})" in r.getMessage() for r in caplog.records)


def test_conflicting_kernel_settings_are_errors_naming_both():
    model = _fresh_model()
    cfg = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"fused": True}},
           "fast_paths": {"adam_kernel": "foreach"}}
    with pytest.raises(ConfigError, match=r"fast_paths\.adam_kernel: 'foreach' conflicts with "
                                          r"optimizer\.params\.fused: true"):
        zerospeed.initialize(model=model, config=cfg)
    cfg = {"train_batch_size": 8, "fast_paths": {"adam_kernel": "foreach"}}
    opt = CPUAdam(model.parameters(), adam_kernel="fused")
    with pytest.raises(ConfigError, match=r"fast_paths\.adam_kernel: 'foreach' conflicts with "
                                          r"CPUAdam\(adam_kernel=\.\.\.\)='fused'"):
        zerospeed.initialize(model=model, optimizer=opt, config=cfg)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    with pytest.raises(ConfigError, match=r"'forloop' conflicts with the client optimizer's own foreach/fused"):
        zerospeed.initialize(model=model, optimizer=opt, config={**cfg, "fast_paths": {"adam_kernel": "forloop"}})


def test_client_optimizers_take_the_switch():
    # a client CPU Adam left at auto takes the config's forced family
    model = _fresh_model()
    opt = CPUAdam(model.parameters(), lr=LR)
    engine, *_ = zerospeed.initialize(model=model, optimizer=opt, config={
        "train_batch_size": 8, "zero_optimization": {"stage": 1}, "fast_paths": {"adam_kernel": "foreach"}})
    assert opt.kernel_switch.kernel == "foreach"
    # a client torch AdamW at auto is left as built; forced, it gets the family's flags
    model = _fresh_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    zerospeed.initialize(model=model, optimizer=opt, config={"train_batch_size": 8})
    assert switch_of(opt) is None and opt.param_groups[0]["fused"] is None
    model = _fresh_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    zerospeed.initialize(model=model, optimizer=opt, config={"train_batch_size": 8,
                                                             "fast_paths": {"adam_kernel": "fused"}})
    assert switch_of(opt).kernel == "fused" and opt.param_groups[0]["fused"] is True


# ----------------------------------------------------------------- Adam: CPUAdam / FusedAdam directly


def _cpu_adam_run(**kw) -> tuple[list[torch.Tensor], CPUAdam]:
    model = _fresh_model()
    opt = CPUAdam(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, chunk_numel=640, **kw)
    for x, coef in _batches():
        opt.zero_grad()
        (model(x) * coef).sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


@pytest.mark.parametrize("kernel", ["forloop", "foreach", "fused"])
def test_cpu_adam_each_kernel_matches_torch(kernel, references):
    got, opt = _cpu_adam_run(adam_kernel=kernel)
    assert opt.kernel_switch.kernel == kernel
    w_max = max(float(p.abs().max()) for p in references["forloop"])
    assert _max_diff(got, references[kernel]) <= adam_rounding_bound(STEPS, LR, BETAS, w_max)
    if kernel == "fused":  # chunks cut at multiples of 64 elements: the fused kernel is bit-identical
        assert all(torch.equal(a, b) for a, b in zip(got, references["fused"]))


def test_cpu_adam_auto_measures_at_the_first_step(caplog):
    with caplog.at_level(logging.INFO, logger="zerospeed.fast_paths"):
        _, opt = _cpu_adam_run()
    assert opt.kernel_switch.setting == "auto" and opt.kernel_switch.kernel in ("forloop", "foreach", "fused")


def test_constructor_switches_are_validated_by_name():
    w = [torch.zeros(4, requires_grad=True)]
    with pytest.raises(FastPathError, match=r"CPUAdam\(adam_kernel=\.\.\.\): 'cuda' is not one of auto, forloop, "
                                            r"foreach, fused"):
        CPUAdam(w, adam_kernel="cuda")
    with pytest.raises(FastPathError, match=r"FusedAdam\(adam_kernel=\.\.\.\): 'fast' is not one of"):
        FusedAdam(w, adam_kernel="fast")
    with pytest.raises(ValueError, match=r"FusedAdam\(adam_kernel=\.\.\.\): 'foreach' conflicts with fused=True"):
        FusedAdam(w, adam_kernel="foreach", fused=True)
    with pytest.raises(FastPathError, match=r"FusedAdam\(adam_kernel=\.\.\.\): 'fused' cannot run on this machine: "
                                            r"torch\.int64 is not a floating-point dtype"):
        FusedAdam([torch.zeros(4, dtype=torch.int64)], adam_kernel="fused")
    opt = FusedAdam(w, adam_kernel="foreach")
    assert opt.param_groups[0]["foreach"] is True and switch_of(opt).kernel == "foreach"


# ------------------------------------------------------------------------------ Adam: replicas agree


def _replica_case():
    import torch.distributed as dist

    got, engine = _engine_run("auto", {"stage": 0})
    switch = switch_of(engine.optimizer)
    return {"rank": dist.get_rank(), "kernel": switch.kernel, "reason": switch.reason, "weights": got}


@pytest.mark.timeout(120)
def test_stage0_replicas_run_rank0s_choice():
    results = run_distributed(_replica_case, 2, timeout=100)
    assert results[0]["kernel"] == results[1]["kernel"]
    assert results[0]["reason"] == "measured" and results[1]["reason"] == "data-parallel rank 0's choice"
    assert all(torch.equal(a, b) for a, b in zip(results[0]["weights"], results[1]["weights"]))


# ----------------------------------------------------------------------------------------- direct I/O


def _direct_supported(folder: str) -> bool:
    path = os.path.join(folder, f".odirect-check-{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        return False
    try:
        os.pwrite(fd, memoryview(new_aligned_tensor(4096, torch.uint8).numpy()), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


def _round_trip(handle: AsyncIOHandle, folder) -> None:
    g = torch.Generator().manual_seed(3)
    data = new_aligned_tensor(300_000, torch.float32).copy_(torch.randn(300_000, generator=g))
    odd = torch.randn(70_001, generator=g)[1:]  # unaligned buffer and length
    handle.sync_pwrite(data, os.path.join(folder, "a.bin"))
    handle.sync_pwrite(odd, os.path.join(folder, "b.bin"), file_offset=4096)
    back, back_odd = new_aligned_tensor(300_000, torch.float32), torch.empty_like(odd)
    handle.sync_pread(back, os.path.join(folder, "a.bin"))
    handle.sync_pread(back_odd, os.path.join(folder, "b.bin"), file_offset=4096)
    assert torch.equal(back, data) and torch.equal(back_odd, odd)


@pytest.mark.parametrize("setting", ["on", "off", "auto"])
def test_direct_io_each_setting_reads_back_what_it_wrote(setting, tmp_path):
    if setting == "on" and not _direct_supported(str(tmp_path)):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    with AsyncIOHandle(block_size=64 * KiB, queue_depth=4, direct_io=setting) as h:
        _round_trip(h, str(tmp_path))
        stats = h.stats()
        used = list(h.direct_io_choices().values())
    assert stats["bytes_written"] == stats["bytes_read"] == 300_000 * 4 + 70_000 * 4
    if setting == "off":
        assert used == [] and stats["direct"] == stats["bounce"] == 0
    elif setting == "on":
        assert used == [True] and stats["direct"] > 0 and stats["bounce"] > 0
    else:  # whichever was measured faster, the counters show that path ran
        assert len(used) == 1 and (stats["direct"] + stats["bounce"] > 0) == used[0]
    assert not [n for n in os.listdir(tmp_path) if "probe" in n]  # the measurement's file is gone


def _refuse_o_direct(monkeypatch):
    real_open = aio_engine.sys_open

    def refusing_open(path, flags):
        if flags & aio_engine.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags)

    monkeypatch.setattr(aio_engine, "sys_open", refusing_open)


def test_forced_direct_io_where_o_direct_fails_names_the_switch_and_the_folder(monkeypatch):
    """tmpfs (/dev/shm) refused O_DIRECT before Linux 6.6; on a newer kernel the refusal is simulated
    at the open (the engine's system calls are module functions for this)."""
    if not hasattr(os, "O_DIRECT") or not os.path.isdir("/dev/shm"):
        pytest.skip("no O_DIRECT or no /dev/shm")
    folder = f"/dev/shm/zerospeed-direct-{uuid.uuid4().hex[:8]}"
    os.mkdir(folder)
    try:
        if _direct_supported(folder):
            _refuse_o_direct(monkeypatch)
        with AsyncIOHandle(direct_io="on", direct_io_source="fast_paths.direct_io") as h:
            with pytest.raises(FastPathError, match=rf"fast_paths\.direct_io: 'on' cannot run on this machine: "
                                                    rf"O_DIRECT refused in '{folder}'"):
                h.sync_pwrite(torch.zeros(4096), os.path.join(folder, "x.bin"))
        # auto on the same folder falls back to buffered I/O and says why
        with AsyncIOHandle(direct_io="auto") as h:
            _round_trip(h, folder)
            assert h.stats()["direct"] == 0 and "O_DIRECT" in next(iter(h.direct_io_fallbacks.values()))
        assert sorted(os.listdir(folder)) == ["a.bin", "b.bin"]
    finally:
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)


def test_forced_direct_io_refused_in_the_middle_of_a_request_names_the_switch(tmp_path, monkeypatch):
    if not _direct_supported(str(tmp_path)):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    with AsyncIOHandle(block_size=64 * KiB, direct_io="on") as h:
        assert h.prepare(tmp_path) is True
        real = aio_engine.sys_pwrite

        def pwrite(fd, mv, off):
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(fd, mv, off)

        monkeypatch.setattr(aio_engine, "sys_pwrite", pwrite)
        with pytest.raises(AIOError, match=r"AsyncIOHandle\(direct_io=\.\.\.\) is 'on' but O_DIRECT write failed"):
            h.sync_pwrite(new_aligned_tensor(65536, torch.uint8).zero_(), tmp_path / "c.bin")


def test_handle_switch_validation():
    with pytest.raises(FastPathError, match=r"AsyncIOHandle\(direct_io=\.\.\.\): 'yes' is not one of auto, off, on"):
        AsyncIOHandle(direct_io="yes")
    with pytest.raises(FastPathError, match=r"'on' conflicts with use_direct_io=False"):
        AsyncIOHandle(direct_io="on", use_direct_io=False)
    with AsyncIOHandle(use_direct_io=False) as h:
        assert h.direct_io == "off" and not h.use_direct_io


def _nvme_config(folder: str, direct_io: str) -> dict:
    return {"train_batch_size": 8, "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": folder}},
            "fast_paths": {"direct_io": direct_io}}


def test_engine_nvme_offload_direct_io_off_and_forced_on_where_refused(tmp_path, monkeypatch, caplog):
    model = _fresh_model()
    with caplog.at_level(logging.INFO, logger="zerospeed"):
        engine, *_ = zerospeed.initialize(model=model, config=_nvme_config(str(tmp_path), "off"))
    for x, coef in _batches():
        engine.backward((engine(x) * coef).sum())
        engine.step()
    handle = engine.strategy.state.offload.swapper.handle
    stats = handle.stats()
    assert handle.direct_io == "off" and stats["direct"] == stats["bounce"] == 0 and stats["buffered"] > 0
    assert any("direct_io=off" in r.getMessage() for r in caplog.records if "zerospeed fast paths" in r.getMessage())
    engine.strategy.state.offload.close()

    _refuse_o_direct(monkeypatch)
    with pytest.raises(FastPathError,
                       match=rf"fast_paths\.direct_io: 'on' cannot run on this machine: O_DIRECT refused in "
                             rf"'{tmp_path}/zerospeed_swap/optimizer_rank0_"):
        zerospeed.initialize(model=_fresh_model(), config=_nvme_config(str(tmp_path), "on"))
    assert not os.path.exists(tmp_path / "zerospeed_swap")  # the swap folder was removed again
