"""Compiled training, 2 processes (gloo on CPU): eager ZeRO versus engine.compile() versus DeepCompile,
with FSDP2 + torch.compile and DeepSpeed 0.19.8's engine.compile() as the peers.

Systems (each stage 0-3 where it applies; every (system, stage) runs in fresh processes so peak RSS
is its own):

* ``eager`` - zerospeed, no compile;
* ``compile`` - zerospeed ``engine.compile(backend)``: the module compiled, ZeRO hooks outside the graph;
* ``deepcompile`` - zerospeed with ``compile.deepcompile: true``: gathers, releases and reductions in
  the graphs (default schedule: a profiling step, then the optimized graphs);
* ``deepcompile aot_eager`` (stage 3) - the same with the graphs run eagerly (``backend="aot_eager"``);
* ``fsdp2+compile`` - ``fully_shard`` on every block and the root, then ``torch.compile`` (stage-3 peer);
* ``deepspeed compile`` - DeepSpeed's ``engine.compile(backend)`` at each stage (needs DeepSpeed:
  run with the bench venv); ``deepspeed deepcompile`` - DeepSpeed with ``compile.deepcompile``, whose
  exact error is recorded where it does not run.

With ``--rounds N`` every system of a stage runs N times, interleaved (eager, compile, deepcompile, ...,
eager, compile, ...), and a row's timings are the medians over the rounds (each round's are kept), so
a busy spell of the shared machine does not land on one system only.

Reported per row: zerospeed's collectives per step (``collectives_per_step``, from ``zerospeed.comm``'s
counter; the peers' collectives are not counted there), median step time (warmup excluded; the steps that compile are warmup) and median
CPU seconds per step (the slower rank; robust to other jobs on a shared machine), the first
step's wall time (compile included), compile seconds (zerospeed: ``engine.get_compile_time()``),
graph breaks and recompiles (zerospeed: ``engine.compile_report()``), peak RSS of rank 0, the
losses' max relative difference from zerospeed eager at the same stage, and the ratio of the step
time to zerospeed eager at the same stage.

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=.venv-bench/torch_extensions OMP_NUM_THREADS=1 PYTHONPATH=$PWD/src \
        .venv-bench/bin/python bench/compile_bench.py --backend inductor --stages 0 1 2 3
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SYSTEMS = ("eager", "compile", "deepcompile", "deepcompile aot_eager", "fsdp2+compile", "deepspeed compile",
           "deepspeed deepcompile")
STAGE3_ONLY = ("deepcompile aot_eager", "fsdp2+compile", "deepspeed deepcompile")


def _worker(system: str, stage: int, backend: str, steps: int, warmup: int, layers: int, d_model: int,
            seq: int, micro: int) -> dict[str, Any]:
    import torch
    import torch._dynamo
    import torch.distributed as dist

    from common import peak_rss_bytes, time_steps
    from gpt_model import GPT, GPTConfig

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=256, n_layer=layers, n_head=max(1, d_model // 64), d_model=d_model, seq_len=seq)
    rank, world = dist.get_rank(), dist.get_world_size()

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i * world + rank)
        data = torch.randint(0, cfg.vocab_size, (micro, seq + 1), generator=g)
        return data[:, :-1], data[:, 1:]

    torch.manual_seed(0)
    model = GPT(cfg)
    ds = {"train_batch_size": micro * world, "steps_per_print": 0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    out: dict[str, Any] = {"system": system, "stage": stage}
    engine: Any = None
    if system in ("eager", "compile", "deepcompile", "deepcompile aot_eager"):
        import zerospeed

        if system.startswith("deepcompile"):
            ds["compile"] = {"deepcompile": True}
        engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
        if system != "eager":
            engine.compile(backend="aot_eager" if system == "deepcompile aot_eager" else backend)
    elif system.startswith("deepspeed"):
        import deepspeed

        ds["steps_per_print"] = 10**9  # DeepSpeed computes step % steps_per_print: 0 divides by zero
        if system == "deepspeed deepcompile":
            ds["compile"] = {"deepcompile": True}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
        engine.compile(backend=backend)
    if engine is not None:
        def step(i: int) -> float:
            x, y = batch(i)
            loss = engine(x, targets=y)
            engine.backward(loss)
            engine.step()
            return loss.item()
    else:  # fsdp2+compile
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        compiled = torch.compile(model, backend=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(i: int) -> float:
            x, y = batch(i)
            loss = compiled(x, targets=y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item()

    losses: list[float] = []
    cpu: list[float] = []

    def timed(i: int) -> None:
        c0 = time.process_time()
        losses.append(step(i + 1))
        cpu.append(time.process_time() - c0)

    t0 = time.perf_counter()
    losses.append(step(0))
    out["first_step_s"] = time.perf_counter() - t0
    from zerospeed import comm

    comm.COUNTER.reset()  # zerospeed's collectives (the peers' do not go through zerospeed.comm)
    timing = time_steps(timed, steps, warmup, barrier=dist.barrier)
    out["step_s"] = timing.median_s
    if engine is not None and not system.startswith("deepspeed"):
        calls = sum(s["count"] for s in comm.COUNTER.snapshot().values())
        out["collectives_per_step"] = round(calls / (steps + warmup), 1)
    # CPU seconds of this process per step (all its threads): what the step costs, whatever else
    # runs on the shared machine; the slower rank's median is reported
    mine = torch.tensor([sorted(cpu[warmup:])[len(cpu[warmup:]) // 2]], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    out["cpu_step_s"] = float(mine.item())
    out["losses"] = losses
    out["peak_rss_bytes"] = peak_rss_bytes()
    if system in ("compile", "deepcompile", "deepcompile aot_eager"):
        rep = engine.compile_report()
        out.update({"compile_s": round(engine.get_compile_time(), 2), "graph_breaks": rep["graph_breaks"],
                    "recompiles": rep["recompiles"]})
    elif system == "deepspeed compile":
        spent = engine.get_compile_time()  # DeepSpeed 0.19.8: a list of per-compilation seconds
        out["compile_s"] = round(float(sum(spent) if isinstance(spent, (list, tuple)) else spent), 2)
    return out


def _run(system: str, stage: int, a: Any) -> dict[str, Any]:
    from zerospeed.testing import run_distributed

    t0 = time.perf_counter()
    try:
        row = run_distributed(_worker, 2, system, stage, a.backend, a.steps, a.warmup, a.layers, a.d_model,
                              a.seq, a.micro, timeout=900)[0]
    except Exception as error:  # a peer that does not run here: its exact error is the result
        lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
        # the first exception line of the rank that failed first (not its peers' lost connections)
        errs = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b.*:", ln)
                and "Connection" not in ln and "DistributedTestError" not in ln]
        row = {"system": system, "stage": stage, "error": (errs[0] if errs else lines[-1])[:400]}
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


def _combine(done: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the rounds of a (system, stage): medians of the timings, the largest peak RSS; the
    per-round step times are kept (``rounds_step_s``)."""
    ok = [r for r in done if "step_s" in r]
    if not ok:
        return done[0]
    row = dict(ok[0])
    for key in ("step_s", "cpu_step_s", "first_step_s"):
        row[key] = statistics.median(r[key] for r in ok)
    row["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in ok)
    row["wall_s"] = round(sum(r["wall_s"] for r in done), 1)
    if len(done) > 1:
        row["rounds_step_s"] = [round(r["step_s"], 4) for r in ok]
        row["rounds_cpu_step_s"] = [round(r["cpu_step_s"], 4) for r in ok]
    return row


def main() -> None:
    from common import write_results

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="inductor")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every system of a stage this many times, interleaved; timings are the medians")
    p.add_argument("--no-write", action="store_true", help="print only (trial runs)")
    a = p.parse_args()
    rows: list[dict[str, Any]] = []
    eager: dict[int, dict[str, Any]] = {}
    for stage in a.stages:
        runs: dict[str, list[dict[str, Any]]] = {}
        for _ in range(a.rounds):  # systems interleaved: a busy spell on the machine hits each of them
            for system in a.systems:
                if system in STAGE3_ONLY and stage != 3:
                    continue
                runs.setdefault(system, []).append(_run(system, stage, a))
        for system, done in runs.items():
            row = _combine(done)
            if system == "eager" and "step_s" in row:
                eager[stage] = row
            base = eager.get(stage)
            if base is not None and "step_s" in row:
                row["ratio_vs_eager"] = round(row["step_s"] / base["step_s"], 3)
                row["cpu_ratio_vs_eager"] = round(row["cpu_step_s"] / base["cpu_step_s"], 3)
                row["max_rel_loss_diff_vs_eager"] = max(abs(x - y) / abs(y) for x, y in zip(row["losses"],
                                                                                            base["losses"]))
            print({k: v for k, v in row.items() if k != "losses"}, flush=True)
            rows.append(row)
    for row in rows:
        row.pop("losses", None)
    if a.no_write:
        return
    json_path, md_path = write_results(
        "compile_bench", rows, params=vars(a),
        notes=["2 gloo processes, 1 torch thread each, on a 2-core machine shared with other jobs: timings are noisy",
               "each (system, stage) runs in fresh processes; peak_rss_bytes is rank 0's peak resident set",
               "first_step_s includes compilation; step_s is the median of the measured steps after warmup",
               "with --rounds N, every system of a stage ran N times interleaved with the others; step_s, "
               "cpu_step_s and first_step_s are the medians over the rounds (rounds_step_s / rounds_cpu_step_s: "
               "each round's)",
               "cpu_step_s: median CPU seconds per step of a rank (all its threads; the slower rank), which "
               "other jobs on the machine inflate much less than wall time; cpu_ratio_vs_eager compares those",
               "ratio_vs_eager: step_s over zerospeed eager's at the same stage; fsdp2+compile is compared "
               "with the stage-3 row",
               "Inductor's on-disk caches were warm from earlier runs on this machine: compile_s is lower than a "
               "first compilation's"])
    print(json_path, md_path)


if __name__ == "__main__":
    main()
