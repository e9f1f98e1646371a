"""ZeRO-3 parameter offload (``zero_optimization.offload_param``, device ``nvme`` and ``cpu``).

* Parity: the same stage-3 run with and without offload, world sizes 1 and 2, fp32 (1e-5 relative
  on losses and every weight; the runs are in fact bit-identical, offload only moves bytes) and
  bf16 (identical to bf16 without offload).
* Resident bound: with NVMe and ``max_in_cpu`` 60 elements, after every step at most 60 swapped-in
  elements stay in memory (the swapper's accounting and ``memory_breakdown()``), the swap folder exists
  while training and is gone after ``strategy.close()`` and after a process exits without close.
* Errors: missing / read-only ``nvme_path``, ``buffer_size`` smaller than a bucket shard, a swap
  file deleted mid-run, a full disk at preallocation (``posix_fallocate`` made to fail).
* A checkpoint save + load round trip with NVMe parameter offload restores the same weights.
* Units without processes: the LRU bound, dirty write-back and the closed-swapper error.

The rank functions live in this module (importable by name from the harness's ranks).
"""

from __future__ import annotations

import errno
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

import offload_cases
import zero3_cases
from zerospeed.testing import run_distributed

GLOBAL_BATCH = 8
STEPS = 3
FP32_TOL = 1e-5
MAX_IN_CPU = 60  # elements: fewer than two of the Stack's shards at world size 2 (77, 54, 52, 25, 9)


class Stack(zero3_cases.Chain):
    """Several linears with odd sizes: one ZeRO-3 bucket each (persistence threshold 0)."""

    def __init__(self, sizes: tuple[int, ...] = (7, 13, 11, 9, 5, 3)) -> None:
        super().__init__(sizes)
        self.layers[1].requires_grad_(False)  # a frozen bucket is swapped too


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(900 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def config(offload: str | None = None, nvme_path: str | None = None, precision: str = "fp32", **offload_knobs) -> dict:
    zcfg: dict = {"stage": 3, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 0,
                  "stage3_prefetch_bucket_size": 300, "stage3_collective_timeout_s": 60}
    if offload is not None:
        zcfg["offload_param"] = {"device": offload, **({"nvme_path": nvme_path} if nvme_path else {}),
                                 **offload_knobs}
    return {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "betas": [0.9, 0.99], "eps": 1e-8,
                                                    "weight_decay": 0.01}},
            "gradient_clipping": 1.0, "steps_per_print": 0, "zero_optimization": zcfg,
            "aio": {"block_size": 4096, "queue_depth": 2},
            "bf16": {"enabled": precision == "bf16"}}


def build(cfg: dict):
    import zerospeed

    torch.manual_seed(7)
    model = Stack()
    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=params, config=cfg)
    return engine


def train(engine, steps: int, first: int = 0, after_step=None) -> list[float]:
    return zero3_cases._train(engine, batch, steps, first, after_step)[0]


def swap_dirs(nvme_path: str) -> list[str]:
    root = os.path.join(nvme_path, "zerospeed_swap")
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


# -- rank functions ---------------------------------------------------------------------------------
def parity_runs(cfgs: list[dict]) -> list[dict]:
    out = []
    for cfg in cfgs:
        engine = build(cfg)
        losses = train(engine, STEPS)
        weights = {k: v.float() for k, v in engine.strategy.consolidated_state_dict().items()}
        swapper = engine.strategy.swapper
        out.append({"losses": losses, "weights": weights,
                    "num_managed": 0 if swapper is None else len(swapper.entries),
                    "reads": 0 if swapper is None else swapper.num_reads})
        engine.strategy.close()
    return out


def bound_case(nvme_path: str) -> dict:
    from zerospeed import zero

    cfg = config("nvme", nvme_path, buffer_count=1, max_in_cpu=MAX_IN_CPU)
    engine = build(cfg)
    strategy = engine.strategy
    swapper = strategy.swapper
    largest = max(e.nbytes for e in swapper.entries.values())
    buffer_bytes = max(e.region_bytes for e in swapper.entries.values())
    seen: list[dict] = []

    def check(eng):
        mem = eng.memory_breakdown()
        seen.append({"resident": swapper.num_resident(), "idle": swapper.num_idle_resident(),
                     "swap_bytes": mem["params_swapped_in"],
                     "buffers": mem["param_swap_buffers"], "nvme": mem["params_on_nvme"],
                     "dir": os.path.isdir(swapper.swap_dir)})

    losses = train(engine, STEPS, after_step=check)
    file_bytes = os.path.getsize(swapper.swap_file)
    # a GatheredParameters edit on rank 0 lands in the (swapped) shards of every rank
    layer = engine.module.layers[2]
    with zero.GatheredParameters([layer.weight], modifier_rank=0):
        if dist.get_rank() == 0:
            with torch.no_grad():
                layer.weight.fill_(0.25)
    weights = strategy.consolidated_state_dict()
    folder = swapper.swap_dir
    dirs_before_close = swap_dirs(nvme_path)
    strategy.close()
    closed_error = ""
    try:
        strategy.consolidated_state_dict()  # gathers: needs the shards, which are gone
    except RuntimeError as exc:
        closed_error = str(exc)
    # a second engine is never closed: the process exit removes its folder
    other = build(cfg)
    train(other, 1)
    return {"losses": losses, "seen": seen, "largest": largest, "buffer_bytes": buffer_bytes,
            "total_shard_bytes": sum(e.nbytes for e in swapper.entries.values()), "file_bytes": file_bytes,
            "num_managed": len(swapper.entries), "edited": weights.get("layers.2.weight"),
            "folder": folder, "folder_after_close": os.path.exists(folder), "dirs_before_close": dirs_before_close,
            "closed_error": closed_error, "other_folder": other.strategy.swapper.swap_dir,
            "peak": engine.strategy.swapper.resident_peak_bytes}


def error_case(missing: str, ok_path: str) -> dict:
    from zerospeed.config import ConfigError
    from zerospeed.ops.aio import AIOError

    out: dict = {}
    try:
        build(config("nvme", missing))
        out["missing"] = "no error"
    except ConfigError as exc:
        out["missing"] = str(exc)
    try:
        build(config("nvme", ok_path, buffer_size=10))
        out["buffer_size"] = "no error"
    except ConfigError as exc:
        out["buffer_size"] = str(exc)
    engine = build(config("nvme", ok_path, max_in_cpu=0))  # nothing cached: the next forward reads
    train(engine, 1)
    swap_file = engine.strategy.swapper.swap_file
    os.unlink(swap_file)
    try:
        train(engine, 1, first=1)
        out["deleted"] = "no error"
    except AIOError as exc:
        out["deleted"] = str(exc)
    out["swap_file"] = swap_file
    engine.strategy.close()
    return out


def checkpoint_case(nvme_path: str, ckpt_dir: str) -> dict:
    engine = build(config("nvme", nvme_path, buffer_count=1, max_in_cpu=MAX_IN_CPU))
    train(engine, 2)
    engine.save_checkpoint(ckpt_dir, tag="t2")
    saved = {k: v.clone() for k, v in engine.strategy.consolidated_state_dict().items()}
    after_save = train(engine, 1, first=2)  # training continues from the shards the save read
    moved = {k: v.clone() for k, v in engine.strategy.consolidated_state_dict().items()}
    engine.load_checkpoint(ckpt_dir, tag="t2")
    loaded = engine.strategy.consolidated_state_dict()
    again = train(engine, 1, first=2)  # the same step from the restored state
    engine.strategy.close()
    return {"saved": saved, "moved": moved, "loaded": loaded, "after_save": after_save, "again": again}


# -- tests ------------------------------------------------------------------------------------------
def _rel(a: dict, b: dict) -> float:
    return max(((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max()).item() for k in b)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [1, 2])
def test_offload_matches_the_run_without_offload(world, tmp_path):
    nvme = str(tmp_path)
    cfgs = [config(), config("cpu"), config("nvme", nvme), config("nvme", nvme, max_in_cpu=0),
            config(precision="bf16"), config("nvme", nvme, precision="bf16", buffer_count=2)]
    results = run_distributed(parity_runs, world, cfgs, timeout=180)
    ref = results[0][0]
    for i, label in enumerate(["cpu", "nvme", "nvme max_in_cpu 0"], start=1):
        r = results[0][i]
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"])) < FP32_TOL, label
        assert set(r["weights"]) == set(ref["weights"]), label
        assert _rel(r["weights"], ref["weights"]) < FP32_TOL, label
    bf16_ref, bf16 = results[0][4], results[0][5]
    assert bf16["losses"] == bf16_ref["losses"]
    assert _rel(bf16["weights"], bf16_ref["weights"]) == 0
    for rank_results in results:
        assert rank_results[1]["num_managed"] == 0  # cpu offload of a CPU model: shards already on the host
        assert rank_results[2]["num_managed"] == 5 and rank_results[2]["reads"] > 0  # really swapped
    assert swap_dirs(nvme) == []  # every folder removed by close()


@pytest.mark.timeout(200)
def test_resident_shards_stay_within_max_in_cpu_and_the_folder_is_removed(tmp_path):
    nvme = str(tmp_path)
    results = run_distributed(bound_case, 2, nvme, timeout=180)
    for r in results:
        assert r["num_managed"] == 5
        for s in r["seen"]:  # after each step: nothing in use, at most max_in_cpu elements cached
            assert s["resident"] == s["idle"] <= 2, s  # 60 elements hold one shard, or the two smallest
            assert 0 < s["swap_bytes"] <= 4 * MAX_IN_CPU < r["total_shard_bytes"], s
            assert s["buffers"] == r["buffer_bytes"], s  # one aligned swap buffer (buffer_count 1)
            assert s["nvme"] == r["file_bytes"] and s["nvme"] % 4096 == 0 and s["dir"], s
        assert os.path.basename(r["folder"]).startswith(f"param_rank{results.index(r)}_")
        assert os.path.basename(r["folder"]) in r["dirs_before_close"]
        assert not r["folder_after_close"]
        assert "closed" in r["closed_error"]
        assert not os.path.exists(r["other_folder"])  # removed at process exit without close()
    assert (results[0]["edited"] == 0.25).all()
    assert swap_dirs(nvme) == []


@pytest.mark.timeout(200)
def test_offload_param_errors_name_the_key_or_the_path(tmp_path):
    ok = tmp_path / "ok"
    ok.mkdir()
    out = run_distributed(error_case, 1, str(tmp_path / "nope"), str(ok), timeout=180)[0]
    assert "zero_optimization.offload_param.nvme_path" in out["missing"] and "nope" in out["missing"]
    assert "zero_optimization.offload_param.buffer_size" in out["buffer_size"]
    assert "layers." in out["buffer_size"] and "shard" in out["buffer_size"]
    assert out["swap_file"] in out["deleted"] and "disappeared" in out["deleted"]


def test_read_only_nvme_path_names_the_key(tmp_path):
    from zerospeed.config import ConfigError
    from zerospeed.zero.offload import check_offload

    ro = offload_cases.read_only_dir(tmp_path)
    options = SimpleNamespace(stage=3, offload_optimizer=None, offload_param=_offload(nvme_path=ro))
    with pytest.raises(ConfigError) as info:
        check_offload(options, torch.optim.AdamW([nn.Parameter(torch.zeros(1))]))
    assert "zero_optimization.offload_param.nvme_path" in str(info.value) and ro in str(info.value)


@pytest.mark.timeout(200)
def test_checkpoint_round_trip_with_nvme_param_offload(tmp_path):
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    results = run_distributed(checkpoint_case, 2, str(nvme), str(ckpt), timeout=180)
    r = results[0]
    assert set(r["loaded"]) == set(r["saved"])
    assert any(not torch.equal(r["moved"][k], r["saved"][k]) for k in r["saved"])  # training moved them
    for k in r["saved"]:
        assert torch.equal(r["loaded"][k], r["saved"][k]), k
    assert r["again"] == r["after_save"]  # the restored shards and optimizer state give the same step
    assert swap_dirs(str(nvme)) == []


# -- units without processes ---------------------------------------------------------------------------
def _buckets(num: int, numel: int = 10) -> list:
    from zerospeed.zero.layout import plan_buckets
    from zerospeed.zero.stage3.bucket import Stage3Bucket

    out = []
    for i in range(num):
        p = nn.Parameter(torch.arange(numel, dtype=torch.float32) + 100 * i)
        layout = plan_buckets([(f"m{i}.weight", (numel,), 0)], 1 << 62, 1)[0]
        out.append(Stage3Bucket(layout, [p], [p.detach().clone()], torch.float32, torch.device("cpu"), None, 0,
                                f"m{i}"))
    return out


def _offload(**kw) -> SimpleNamespace:
    base = dict(device="nvme", nvme_path="", pin_memory=False, buffer_count=2, buffer_size=1000, max_in_cpu=10**9)
    base.update(kw)
    return SimpleNamespace(**base)


def test_swapper_caches_max_in_cpu_elements_and_writes_back_dirty_ones(tmp_path):
    from zerospeed.zero.stage3.param_offload import ParamSwapper

    buckets = _buckets(4)
    sw = ParamSwapper(buckets, _offload(nvme_path=str(tmp_path), max_in_cpu=20), None, 0)
    assert all(b.shard.untyped_storage().nbytes() == 0 for b in buckets) and sw.num_resident() == 0
    assert sw.num_writes == 4 and sw.nvme_bytes == 4 * 4096
    for b in buckets:
        sw.acquire(b)
    assert sw.num_resident() == 4 and sw.num_idle_resident() == 0  # in use: never evicted
    buckets[0].shard.add_(1)
    for b in buckets:
        sw.release(b, dirty=b is buckets[0])
    assert sw.num_idle_resident() == 2 and sw.num_resident() == 2  # the two most recently used stay
    assert sw.num_writes == 5  # only the dirty evicted one was written
    with sw.hold(buckets):
        assert torch.equal(buckets[0].shard, torch.arange(10.0) + 1)
        assert torch.equal(buckets[3].shard, torch.arange(10.0) + 300)
    sw.swap_out_all()
    assert sw.num_resident() == 0 and sw.resident_bytes() == 0
    sw.close()
    assert not os.path.exists(sw.swap_dir)
    with pytest.raises(RuntimeError, match="closed"):
        sw.acquire(buckets[1])


def test_swapper_max_in_cpu_and_cpu_device(tmp_path):
    from zerospeed.zero.stage3.param_offload import ParamSwapper

    buckets = _buckets(3)
    sw = ParamSwapper(buckets, _offload(nvme_path=str(tmp_path), buffer_count=5, max_in_cpu=15), None, 0)
    with sw.hold(buckets):
        pass
    assert sw.num_resident() == 1  # 10 elements each: one fits under max_in_cpu
    sw.close()
    everything = ParamSwapper(_buckets(3), _offload(nvme_path=str(tmp_path)), None, 0)  # the default 1e9
    with everything.hold(everything_buckets := [e.bucket for e in everything.entries.values()]):
        pass
    assert everything.num_resident() == 3 and len(everything_buckets) == 3  # all cached: NVMe is the backing store
    everything.close()
    cpu = ParamSwapper(_buckets(2), _offload(device="cpu"), None, 0)
    assert cpu.entries == {} and cpu.memory_bytes()["params_on_nvme"] == 0  # CPU shards are already on the host


def test_full_disk_at_preallocation_names_the_path_and_the_bytes(tmp_path, monkeypatch):
    from zerospeed.ops.aio import AIOError
    from zerospeed.zero.stage3.param_offload import ParamSwapper

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(AIOError) as info:
        ParamSwapper(_buckets(3), _offload(nvme_path=str(tmp_path)), None, 0)
    msg = str(info.value)
    assert "params.swp" in msg and str(tmp_path) in msg and "12288 bytes" in msg and "disk is full" in msg
    assert os.listdir(tmp_path) == []  # nothing left behind, not even the shared parent
