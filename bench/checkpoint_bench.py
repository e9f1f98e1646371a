"""Checkpoint save / load time and bytes on ``examples/gpt_model.gpt_bench()`` (~14M parameters).

Measured, each in fresh gloo ranks started by :func:`zerospeed.testing.run_distributed`:

* ``zerospeed sync``: ``engine.save_checkpoint`` / ``engine.load_checkpoint`` at ``--world`` ranks,
  ZeRO ``--stage`` (median of ``--repeats``), bytes on disk per checkpoint;
* ``DeepSpeed``: the same model, config (``--world``, ``--stage``, ``--precision``, AdamW) and
  timing (median of ``--repeats``, barrier before and after, ``os.sync()`` before each save) with
  DeepSpeed's own ``engine.save_checkpoint(dir, tag)`` / ``engine.load_checkpoint(dir, tag)``, in
  the same run; skipped (with the reason) when ``deepspeed`` does not import (run under
  ``.venv-bench`` with ``DS_ACCELERATOR=cpu``). DeepSpeed's default checkpoint engine does not
  ``fsync``, so its save is also reported with an ``fsync`` of the files it wrote (the durability
  zerospeed's save includes);
* ``zerospeed resharded load``: that checkpoint loaded at world size 1, stage 0;
* ``zerospeed async``: time the training loop is blocked by an asynchronous save (the CPU
  snapshot), time until it is published, and the training steps' times while it is written
  compared with steps without a save (the overlap);
* ``DCP`` vs ``zerospeed`` at world size 1 (stage 0): the same model and AdamW state saved and
  loaded with ``torch.distributed.checkpoint`` (``get_state_dict`` / ``dcp.save`` / ``dcp.load`` /
  ``set_state_dict``), the baseline this format has to beat on load time.

Every timed save starts after ``os.sync()``, so it pays for its own writes (both formats ``fsync``
their files) and not for the writeback of earlier ones. Loads read files that were just written,
so they come from the page cache for both formats (dropping caches would disturb other users of a
shared machine); load figures compare the formats' CPU-side costs (parsing, checksums, copies,
resharding), not the disk.

``--migration`` (issue #26, DeepSpeed needed) measures instead a DeepSpeed ZeRO-3 folder of the same model
saved at 2 ranks and resumed at 4 (and, like for like, at 2): zerospeed's ``load_checkpoint`` of the folder as
it is, against DeepSpeed's own resume (at 2 ranks: it cannot change the size) and ``ds_to_universal`` + a
universal load at 4; wall time (median of ``--repeats`` loads, slowest rank), CPU seconds and peak RSS per rank;
and the peak memory of ``zero_to_fp32`` (both libraries' helpers).

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python bench/checkpoint_bench.py [--world 2] [--stage 2]
[--repeats 3] [--no_deepspeed] [--no_write]``; with DeepSpeed: ``DS_ACCELERATOR=cpu
TORCH_EXTENSIONS_DIR=$PWD/.venv-bench/torch_extensions OMP_NUM_THREADS=1 .venv-bench/bin/python
bench/checkpoint_bench.py``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))


def _cfg(stage: int, precision: str) -> dict:
    return {"train_batch_size": 4, "gradient_accumulation_steps": 1, "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
            "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
            "bf16": {"enabled": precision == "bf16"}}


def _engine(stage: int, precision: str):
    import zerospeed
    from gpt_model import GPT, gpt_bench

    torch.manual_seed(0)
    model = GPT(gpt_bench())
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=_cfg(stage, precision))
    return engine


def _step(engine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    seq = engine.module.cfg.seq_len
    micro = engine.train_micro_batch_size_per_gpu()
    idx = torch.randint(0, 256, (micro, seq), generator=g)
    loss = engine(idx, idx.roll(-1, 1))
    engine.backward(loss)
    engine.step()


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _tree_files(path: str) -> list[str]:
    return [os.path.join(dp, f) for dp, _, fs in os.walk(path) for f in fs]


def _ds_engine(stage: int, precision: str):
    """DeepSpeed's engine on the same model and config as :func:`_engine` (gloo, CPU accelerator)."""
    import deepspeed
    from gpt_model import GPT, gpt_bench

    deepspeed.init_distributed(dist_backend="gloo")  # wraps the process group run_distributed made
    torch.manual_seed(0)
    model = GPT(gpt_bench())
    cfg = _cfg(stage, precision)
    cfg["steps_per_print"] = 10 ** 9  # DeepSpeed's "never"; 0 is zerospeed's
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def worker_deepspeed(stage: int, precision: str, root: str, repeats: int) -> dict:
    import torch.distributed as dist

    engine = _ds_engine(stage, precision)
    _step(engine, 0)
    saves, saves_fsync, loads = [], [], []
    for i in range(repeats):
        tag = f"t{i}"
        os.sync()  # earlier writes' writeback must not be billed to this save
        _barrier()
        t0 = time.perf_counter()
        engine.save_checkpoint(root, tag=tag)
        _barrier()
        saves.append(time.perf_counter() - t0)
        # DeepSpeed's TorchCheckpointEngine does not fsync; this rank's files (shared files by rank 0)
        mine = [f for f in _tree_files(os.path.join(root, tag))
                if f"zero_pp_rank_{dist.get_rank()}_" in os.path.basename(f)
                or (dist.get_rank() == 0 and "zero_pp_rank_" not in os.path.basename(f))]
        for f in mine:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _barrier()
        saves_fsync.append(time.perf_counter() - t0)
    files = _tree_files(os.path.join(root, f"t{repeats - 1}"))
    nbytes = sum(os.path.getsize(f) for f in files)
    for i in range(repeats):
        _barrier()
        t0 = time.perf_counter()
        path, _ = engine.load_checkpoint(root, tag=f"t{i}")
        _barrier()
        loads.append(time.perf_counter() - t0)
        if path is None:
            raise RuntimeError(f"DeepSpeed load_checkpoint({root!r}, tag='t{i}') loaded nothing")
    _step(engine, 1)  # the loaded state trains
    return {"save_s": saves, "save_fsync_s": saves_fsync, "load_s": loads, "bytes": nbytes,
            "files": sorted(os.path.basename(f) for f in files)}


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def worker_save_load(stage: int, precision: str, root: str, repeats: int) -> dict:
    from zerospeed.checkpoint import saver

    engine = _engine(stage, precision)
    _step(engine, 0)
    saves, loads = [], []
    for i in range(repeats):
        os.sync()  # earlier writes' writeback must not be billed to this save
        _barrier()
        t0 = time.perf_counter()
        engine.save_checkpoint(root, tag=f"t{i}")
        _barrier()
        saves.append(time.perf_counter() - t0)
    nbytes = _dir_bytes(os.path.join(root, f"t{repeats - 1}"))
    for i in range(repeats):
        _barrier()
        t0 = time.perf_counter()
        engine.load_checkpoint(root, tag=f"t{i}")
        _barrier()
        loads.append(time.perf_counter() - t0)
    # async: blocking part, time to publish, step times with and without a save in flight
    quiet = []
    for i in range(4):
        _barrier()
        t0 = time.perf_counter()
        _step(engine, 10 + i)
        quiet.append(time.perf_counter() - t0)
    os.sync()
    _barrier()
    t0 = time.perf_counter()
    saver.save(engine, root, "async", {}, True, async_save=True)
    blocking = time.perf_counter() - t0
    busy, pending = [], True
    while pending:
        t1 = time.perf_counter()
        _step(engine, 20 + len(busy))
        busy.append(time.perf_counter() - t1)
        pending = saver.pending(engine) and len(busy) < 50
    saver.wait(engine)
    published = time.perf_counter() - t0
    return {"save_s": saves, "load_s": loads, "bytes": nbytes, "async_blocking_s": blocking,
            "async_published_s": published, "async_steps_during": len(busy),
            "step_quiet_s": statistics.median(quiet), "step_during_save_s": statistics.median(busy)}


def worker_load_only(stage: int, precision: str, root: str, tag: str, repeats: int) -> list[float]:
    engine = _engine(stage, precision)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.load_checkpoint(root, tag=tag, load_module_strict=True)
        times.append(time.perf_counter() - t0)
    return times


def worker_dcp_vs_ours(root: str, repeats: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from gpt_model import GPT, gpt_bench

    torch.manual_seed(0)
    model = GPT(gpt_bench())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    idx = torch.randint(0, 256, (2, model.cfg.seq_len))
    model(idx, idx).backward()
    opt.step()
    out: dict = {"dcp_save_s": [], "dcp_load_s": []}
    for i in range(repeats):
        d = os.path.join(root, f"dcp{i}")
        os.sync()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=d)
        out["dcp_save_s"].append(time.perf_counter() - t0)
    out["dcp_bytes"] = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.join(root, "dcp0"))
                           for f in fs)
    for i in range(repeats):
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=os.path.join(root, f"dcp{i}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out["dcp_load_s"].append(time.perf_counter() - t0)
    ours = worker_save_load(0, "fp32", os.path.join(root, "ours"), repeats)
    out.update(ours_save_s=ours["save_s"], ours_load_s=ours["load_s"], ours_bytes=ours["bytes"])
    return out


# -- DeepSpeed migration rows (issue #26): a DeepSpeed ZeRO-3 folder resumed at another world size ----------

class _PeakSampler:
    """Peak resident memory of this process while a block runs (sampled every 2 ms from /proc)."""

    def __enter__(self):
        import threading

        from common import current_rss_bytes

        self.before = current_rss_bytes()
        self.peak = self.before
        self._stop = threading.Event()

        def run() -> None:
            while not self._stop.is_set():
                self.peak = max(self.peak, current_rss_bytes())
                self._stop.wait(0.002)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        from common import current_rss_bytes

        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_bytes())


def worker_ds_save(root: str, tag: str) -> None:
    engine = _ds_engine(3, "fp32")
    _step(engine, 0)
    engine.save_checkpoint(root, tag=tag)
    _barrier()


def _optimizer_state_bytes(engine) -> int:
    """Bytes of the tensors in the torch optimizer's state (DeepSpeed's ZeRO wraps it as ``.optimizer``)."""
    opt = engine.optimizer
    inner = opt if isinstance(opt, torch.optim.Optimizer) else getattr(opt, "optimizer", opt)
    return sum(t.numel() * t.element_size() for st in getattr(inner, "state", {}).values() for t in st.values()
               if torch.is_tensor(t))


def _timed_load(make_engine, root: str, tag: str, repeats: int = 1, import_s: float = 0.0) -> dict:
    """A resume, ``repeats`` times on this rank: each time a freshly initialized engine (``make_engine()``: model
    built, optimizer made, nothing loaded yet), then ``engine.load_checkpoint(root, tag)`` timed: the call and a
    barrier after it (so every rank's figure includes waiting for the slowest rank), started after a barrier;
    wall seconds (perf_counter) and this process's CPU seconds (process_time: every thread, gloo's included).
    Memory is measured on the first load only."""
    import gc

    walls, cpus, mem, created = [], [], None, 0
    for i in range(max(1, repeats)):
        engine = make_engine()
        state_before = _optimizer_state_bytes(engine)
        _barrier()
        sampler = _PeakSampler() if i == 0 else contextlib.nullcontext()
        with sampler:
            c0, t0 = time.process_time(), time.perf_counter()
            path, _ = engine.load_checkpoint(root, tag=tag)
            _barrier()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        if path is None:
            raise RuntimeError(f"load_checkpoint({root!r}, tag={tag!r}) loaded nothing")
        if i == 0:
            mem = sampler
            # state the run ends with that the load created (zerospeed makes Adam's moments at the load;
            # DeepSpeed's ZeRO made them at initialize): the memory a load holds beyond its model state is rss
            # added minus this
            created = _optimizer_state_bytes(engine) - state_before
        if i == max(1, repeats) - 1:
            _step(engine, 1)  # the loaded state trains
        del engine
        gc.collect()
    return {"s_all": walls, "cpu_all": cpus, "rss_before": mem.before, "rss_peak": mem.peak,
            "state_created": created, "import_s": import_s}


def _warm_imports() -> float:
    """Import zerospeed's checkpoint-loading modules before any timer starts, as ``import deepspeed`` does for
    DeepSpeed's (``engine.load_checkpoint`` imports them lazily on first use; with ``PYTHONDONTWRITEBYTECODE``
    set that import compiles them). Returns its seconds (reported in a note, outside the timed call)."""
    t0 = time.perf_counter()
    import zerospeed.checkpoint.deepspeed.layout  # noqa: F401
    import zerospeed.checkpoint.loader  # noqa: F401
    import zerospeed.runtime.checkpointing  # noqa: F401

    return time.perf_counter() - t0


def worker_zs_load_ds(root: str, tag: str, repeats: int = 1) -> dict:
    import_s = _warm_imports()
    return _timed_load(lambda: _engine(3, "fp32"), root, tag, repeats, import_s)


def worker_ds_load(root: str, tag: str, universal: bool, repeats: int = 1) -> dict:
    import deepspeed
    from gpt_model import GPT, gpt_bench

    deepspeed.init_distributed(dist_backend="gloo")

    def make():
        torch.manual_seed(0)
        model = GPT(gpt_bench())
        cfg = _cfg(3, "fp32")
        cfg["steps_per_print"] = 10 ** 9
        cfg["checkpoint"] = {"load_universal": universal}
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]

    return _timed_load(make, root, tag, repeats)


_MEASURE = r"""
import resource, sys, time
sys.path.insert(0, {bench!r})
from common import current_rss_bytes
import torch
{imports}
before = current_rss_bytes()
t0 = time.perf_counter()
{call}
seconds = time.perf_counter() - t0
peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print("MEASURED", seconds, before, peak * 1024)
"""


def _measure(imports: str, call: str) -> dict:
    """Time and peak RSS of ``call`` in a fresh interpreter (so earlier work does not set the peak)."""
    import subprocess

    code = _MEASURE.format(bench=str(ROOT / "bench"), imports=imports, call=call)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    line = next((x for x in proc.stdout.splitlines() if x.startswith("MEASURED ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"measurement failed ({proc.returncode}): {proc.stderr[-2000:]}")
    seconds, before, peak = line.split()[1:]
    return {"s": float(seconds), "rss_before": int(before), "rss_peak": int(peak)}


def _beyond(r: dict) -> int:
    """Resident memory a call added beyond the state it leaves behind (a zero_to_fp32 call: its whole output)."""
    return r["rss_peak"] - r["rss_before"] - int(r.get("state_created", 0))


def _added_ratio(ours: dict, theirs: dict) -> float:
    return (ours["rss_peak"] - ours["rss_before"]) / max(1, theirs["rss_peak"] - theirs["rss_before"])


def migration(args) -> None:
    """DeepSpeed ZeRO-3 folder written at 2 ranks, resumed at 4: zerospeed vs DeepSpeed's ways."""
    from common import command_line, format_bytes, write_results
    from zerospeed.testing import run_distributed

    root = args.dir or tempfile.mkdtemp(prefix="zs_migration_bench_")
    src_world, dst_world = 2, 4
    try:
        ds_dir = os.path.join(root, "ds")
        run_distributed(worker_ds_save, src_world, ds_dir, "z3", timeout=900)
        nbytes = sum(os.path.getsize(f) for f in _tree_files(os.path.join(ds_dir, "z3")))
        reps = args.repeats
        zs = run_distributed(worker_zs_load_ds, dst_world, ds_dir, "z3", reps, timeout=900)
        zs_same = run_distributed(worker_zs_load_ds, src_world, ds_dir, "z3", reps, timeout=900)
        ds_own = run_distributed(worker_ds_load, src_world, ds_dir, "z3", False, reps, timeout=900)
        conv = _measure("from deepspeed.checkpoint import ds_to_universal as m\n"
                        f"sys.argv = ['ds_to_universal', '--input_folder', {os.path.join(ds_dir, 'z3')!r}, "
                        f"'--output_folder', {os.path.join(ds_dir, 'z3_universal')!r}, '--num_extract_workers', '1', "
                        "'--num_merge_workers', '1']", "m.main(m.parse_arguments())")
        ds_uni = run_distributed(worker_ds_load, dst_world, ds_dir, "z3_universal", True, reps, timeout=900)
        out_ds, out_zs = os.path.join(root, "fp32_ds"), os.path.join(root, "fp32_zs")
        z2f_ds = _measure("from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as f",
                          f"sd = f({ds_dir!r}, tag='z3')")
        z2f_zs = _measure("from zerospeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as f",
                          f"sd = f({ds_dir!r}, tag='z3')")
        cv_ds = _measure("from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as f",
                         f"f({ds_dir!r}, {out_ds!r}, max_shard_size='10MB', safe_serialization=False, tag='z3')")
        cv_zs = _measure("from zerospeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as f",
                         f"f({ds_dir!r}, {out_zs!r}, max_shard_size='10MB', safe_serialization=False, tag='z3')")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    def wall(res: list[dict]) -> float:
        """Median over the repeats of the slowest rank's time."""
        return statistics.median(max(r["s_all"][i] for r in res) for i in range(len(res[0]["s_all"])))

    def cpu(res: list[dict]) -> float:
        return statistics.median(max(r["cpu_all"][i] for r in res) for i in range(len(res[0]["cpu_all"])))

    def ranks(res: list[dict]) -> dict:
        return {"seconds": round(wall(res), 3), "cpu_seconds_per_rank": round(cpu(res), 3),
                "loads_s": " / ".join(f"{max(r['s_all'][i] for r in res):.3f}" for i in range(len(res[0]["s_all"]))),
                "peak_rss_per_rank": format_bytes(max(r["rss_peak"] for r in res)),
                "rss_added_per_rank": format_bytes(max(r["rss_peak"] - r["rss_before"] for r in res)),
                "added_beyond_model_state": format_bytes(max(_beyond(r) for r in res))}

    def one(r: dict) -> dict:
        return {"seconds": round(r["s"], 3), "cpu_seconds_per_rank": "", "loads_s": "",
                "peak_rss_per_rank": format_bytes(r["rss_peak"]),
                "rss_added_per_rank": format_bytes(r["rss_peak"] - r["rss_before"]),
                "added_beyond_model_state": format_bytes(_beyond(r))}

    folder = f"DeepSpeed ZeRO-3 folder of gpt_bench saved at {src_world} ranks ({format_bytes(nbytes)})"
    uni_total = conv["s"] + wall(ds_uni)
    rows = [
        {"what": f"zerospeed load_checkpoint of the folder at {dst_world} ranks, ZeRO 3", **ranks(zs)},
        {"what": f"zerospeed load_checkpoint of the folder at {src_world} ranks, ZeRO 3 (DeepSpeed's world size)",
         **ranks(zs_same)},
        {"what": f"DeepSpeed's own resume at {src_world} ranks (it cannot change the size without universal)",
         **ranks(ds_own)},
        {"what": "DeepSpeed ds_to_universal (1 extract / 1 merge worker, one process)", **one(conv)},
        {"what": f"DeepSpeed universal load at {dst_world} ranks", **ranks(ds_uni)},
        {"what": "DeepSpeed ds_to_universal + universal load", "seconds": round(uni_total, 3),
         "cpu_seconds_per_rank": "", "loads_s": "", "peak_rss_per_rank": "", "rss_added_per_rank": "",
         "added_beyond_model_state": ""},
        {"what": "DeepSpeed get_fp32_state_dict_from_zero_checkpoint", **one(z2f_ds)},
        {"what": "zerospeed get_fp32_state_dict_from_zero_checkpoint", **one(z2f_zs)},
        {"what": "DeepSpeed convert_zero_checkpoint_to_fp32_state_dict (10MB shards, .bin)", **one(cv_ds)},
        {"what": "zerospeed convert_zero_checkpoint_to_fp32_state_dict (10MB shards, .bin)", **one(cv_zs)},
    ]
    for row in rows:
        print(f"{row['what']:<96} {row['seconds']:>8} s  cpu {row['cpu_seconds_per_rank']:>6}  "
              f"peak {row['peak_rss_per_rank']:>10}  added "
              f"{row['rss_added_per_rank']:>10}")
    t_zs, t_same, t_own = wall(zs), wall(zs_same), wall(ds_own)
    notes = [
        folder,
        f"time zerospeed {src_world}-rank load / DeepSpeed's {src_world}-rank own resume (same world size): "
        f"{t_same / t_own:.2f}x wall, {cpu(zs_same) / cpu(ds_own):.2f}x CPU seconds per rank",
        f"time zerospeed {dst_world}-rank load / DeepSpeed's {src_world}-rank own resume: "
        f"{t_zs / t_own:.2f}x wall, {cpu(zs) / cpu(ds_own):.2f}x CPU seconds per rank; / ds_to_universal + "
        f"universal load: {t_zs / uni_total:.2f}x",
        f"what a load's seconds cover: engine.load_checkpoint(dir, tag) and a barrier after it, on every rank, "
        f"started after a barrier, in an engine initialized just before (model built, optimizer made); the row's "
        f"figure is the slowest rank's, median of {reps} resumes, each into a freshly initialized engine in the same "
        "processes (loads_s: each of them); the folder was just written, so it is in the page cache for every "
        "row; the same for zerospeed and DeepSpeed. "
        "cpu_seconds_per_rank: time.process_time() of the rank's process over the same span (all its threads), "
        "the largest rank's, median over the loads",
        f"zerospeed's checkpoint modules are imported before the timer, as `import deepspeed` imports DeepSpeed's "
        f"(this environment sets PYTHONDONTWRITEBYTECODE, so that first import compiles them: "
        f"{max(r['import_s'] for r in zs + zs_same):.2f} s on the slowest rank, not in the rows)",
        f"{dst_world} ranks share {os.cpu_count()} cores here: the {dst_world}-rank rows' wall time includes waiting "
        "for a core; compare CPU seconds per rank across world sizes",
        f"zero_to_fp32 memory added, zerospeed / DeepSpeed: get_fp32_state_dict {_added_ratio(z2f_zs, z2f_ds):.2f}x, "
        f"convert (10MB shards) {_added_ratio(cv_zs, cv_ds):.2f}x",
        f"memory a load holds beyond the model state it ends with, per rank, zerospeed {dst_world}-rank load / "
        f"DeepSpeed zero_to_fp32 (get_fp32_state_dict) added: {max(_beyond(r) for r in zs) / max(1, _beyond(z2f_ds)):.2f}x"
        " (issue #26 target: at most 0.5x)",
        f"load average (1, 5, 15 min) at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}",
        "added_beyond_model_state: rss_added minus the optimizer state the load created (zerospeed creates Adam's "
        "moments at the load, DeepSpeed's ZeRO at initialize)",
        "rss_added: peak resident memory during the call minus resident memory just before it (per rank: the "
        "largest); the loads sample /proc every 2 ms, the zero_to_fp32 rows use ru_maxrss of a fresh interpreter",
        "DeepSpeed files are read memory-mapped by zerospeed (torch.load(mmap=True, weights_only=True)): mapped "
        "pages count in RSS while touched but are file-backed and reclaimable",
    ]
    for n in notes[1:8]:
        print(n)
    if not args.no_write:
        paths = write_results("checkpoint_migration", rows, params=vars(args), notes=notes, command=command_line())
        print("wrote", *paths)


def main(argv: list[str] | None = None) -> None:
    from common import command_line, format_bytes, write_results
    from zerospeed.testing import run_distributed

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="scratch directory (default: a new temporary directory)")
    p.add_argument("--no_deepspeed", action="store_true", help="skip the DeepSpeed measurement")
    p.add_argument("--no_write", action="store_true", help="print only; do not write bench/results")
    p.add_argument("--migration", action="store_true", help="only the DeepSpeed-migration rows (issue #26; needs "
                   "DeepSpeed: run under .venv-bench)")
    args = p.parse_args(argv)
    if args.migration:
        migration(args)
        return
    root = args.dir or tempfile.mkdtemp(prefix="zs_ckpt_bench_")
    med = statistics.median
    try:
        sharded = os.path.join(root, "sharded")
        res = run_distributed(worker_save_load, args.world, args.stage, args.precision, sharded, args.repeats,
                              timeout=900)
        save_s = max(med(r["save_s"]) for r in res)
        load_s = max(med(r["load_s"]) for r in res)
        ds, ds_skip = None, None
        if args.no_deepspeed:
            ds_skip = "--no_deepspeed"
        else:
            try:
                import deepspeed  # noqa: F401
            except Exception as e:  # not installed (use .venv-bench), or its accelerator fails
                ds_skip = f"deepspeed does not import: {type(e).__name__}: {e}".splitlines()[0][:200]
        if ds_skip is None:
            ds = run_distributed(worker_deepspeed, args.world, args.stage, args.precision,
                                 os.path.join(root, "deepspeed"), args.repeats, timeout=1200)
        reshard = run_distributed(worker_load_only, 1, 0, args.precision, sharded, f"t{args.repeats - 1}",
                                  args.repeats, timeout=900)[0]
        cmp = run_distributed(worker_dcp_vs_ours, 1, root, args.repeats, timeout=900)[0]
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    r0 = res[0]
    rows = [
        {"what": f"zerospeed save, world {args.world}, stage {args.stage}, {args.precision}",
         "seconds": round(save_s, 3),
         "bytes": res[0]["bytes"], "MB_per_s": round(res[0]["bytes"] / save_s / 1e6, 1)},
        {"what": f"zerospeed load, same layout", "seconds": round(load_s, 3), "bytes": res[0]["bytes"],
         "MB_per_s": round(res[0]["bytes"] / load_s / 1e6, 1)},
    ]
    what = f"world {args.world}, stage {args.stage}, {args.precision}"
    if ds is not None:
        ds_save = max(med(r["save_s"]) for r in ds)
        ds_save_fsync = max(med(r["save_fsync_s"]) for r in ds)
        ds_load = max(med(r["load_s"]) for r in ds)
        nb = ds[0]["bytes"]
        rows += [
            {"what": f"DeepSpeed save_checkpoint, {what}", "seconds": round(ds_save, 3), "bytes": nb,
             "MB_per_s": round(nb / ds_save / 1e6, 1)},
            {"what": "DeepSpeed save_checkpoint + fsync of its files", "seconds": round(ds_save_fsync, 3),
             "bytes": nb, "MB_per_s": round(nb / ds_save_fsync / 1e6, 1)},
            {"what": "DeepSpeed load_checkpoint, same layout", "seconds": round(ds_load, 3), "bytes": nb,
             "MB_per_s": round(nb / ds_load / 1e6, 1)},
        ]
    else:
        rows += [{"what": f"DeepSpeed save_checkpoint / load_checkpoint, {what}", "seconds": "skipped",
                  "bytes": "", "MB_per_s": "", "reason": ds_skip}]
    rows += [
        {"what": "zerospeed load resharded to world 1, stage 0", "seconds": round(med(reshard), 3),
         "bytes": res[0]["bytes"], "MB_per_s": round(res[0]["bytes"] / med(reshard) / 1e6, 1)},
        {"what": "zerospeed async save: training blocked (snapshot)", "seconds": round(r0["async_blocking_s"], 3),
         "bytes": "", "MB_per_s": ""},
        {"what": f"zerospeed async save: published after ({r0['async_steps_during']} steps ran meanwhile)",
         "seconds": round(r0["async_published_s"], 3), "bytes": "", "MB_per_s": ""},
        {"what": "train step, no save in flight (median)", "seconds": round(r0["step_quiet_s"], 3), "bytes": "",
         "MB_per_s": ""},
        {"what": "train step while the async save writes (median)", "seconds": round(r0["step_during_save_s"], 3),
         "bytes": "", "MB_per_s": ""},
        {"what": "world 1: DCP save (get_state_dict + dcp.save)", "seconds": round(med(cmp["dcp_save_s"]), 3),
         "bytes": cmp["dcp_bytes"], "MB_per_s": ""},
        {"what": "world 1: zerospeed save (stage 0)", "seconds": round(med(cmp["ours_save_s"]), 3),
         "bytes": cmp["ours_bytes"], "MB_per_s": ""},
        {"what": "world 1: DCP load (dcp.load + set_state_dict)", "seconds": round(med(cmp["dcp_load_s"]), 3),
         "bytes": cmp["dcp_bytes"], "MB_per_s": ""},
        {"what": "world 1: zerospeed load (stage 0)", "seconds": round(med(cmp["ours_load_s"]), 3),
         "bytes": cmp["ours_bytes"], "MB_per_s": ""},
    ]
    for row in rows:
        size = format_bytes(row["bytes"]) if isinstance(row["bytes"], int) else ""
        secs = f"{row['seconds']:>8.3f} s" if isinstance(row["seconds"], float) else f"{row['seconds']:>10}"
        print(f"{row['what']:<72} {secs}  {size}" + (f"  ({row['reason']})" if row.get("reason") else ""))
    ratio = med(cmp["dcp_load_s"]) / med(cmp["ours_load_s"])
    ds_notes = []
    if ds is not None:
        ds_notes = [
            f"zerospeed / DeepSpeed at {what} (below 1: zerospeed faster): save {save_s / ds_save:.2f}x "
            f"({save_s / ds_save_fsync:.2f}x against DeepSpeed save + fsync), load {load_s / ds_load:.2f}x; "
            f"bytes {res[0]['bytes'] / ds[0]['bytes']:.3f}x",
            "DeepSpeed files per tag: " + ", ".join(ds[0]["files"]) + "; its default checkpoint engine "
            "(torch.save) does not fsync, zerospeed's save does, hence the '+ fsync' row",
            "both sides: median of --repeats per rank, the slower rank reported, barrier before and after "
            "each timed call, os.sync() before each save",
        ]
    else:
        ds_notes = [f"DeepSpeed row skipped: {ds_skip}"]
    for n in ds_notes[:1]:
        print(n)
    print(f"load time DCP / zerospeed at world 1: {ratio:.2f}x")
    if not args.no_write:
        notes = ds_notes + [f"load time DCP / zerospeed at world 1: {ratio:.2f}x",
                 "loads read freshly written files (page cache) for both formats; zerospeed verifies a CRC-32 "
                 "of every tensor it reads, DCP verifies nothing",
                 "async: the training loop is blocked only for the CPU snapshot; the step times during the "
                 "background write come from one save (few steps), so they are indicative only"]
        paths = write_results("checkpoint", rows, params=vars(args), notes=notes, command=command_line())
        print("wrote", *paths)


if __name__ == "__main__":
    main()
