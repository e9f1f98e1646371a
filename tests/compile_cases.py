"""Rank functions for tests/test_compile_*.py: a tiny GPT trained eagerly or with engine.compile()."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zerospeed
from gpt_cases import GPT, GPTConfig
from zerospeed import comm

TINY = GPTConfig(vocab_size=64, n_layer=1, n_head=2, d_model=32, seq_len=16)
STEPS = 3
GLOBAL_BATCH = 4


def config(stage: int) -> dict:
    zcfg = {"stage": stage, "reduce_bucket_size": 2000}
    if stage == 3:
        zcfg.update({"stage3_param_persistence_threshold": 0, "stage3_collective_timeout_s": 60})
    return {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": 1, "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
            "zero_optimization": zcfg}


def batch(step: int, seq: int = TINY.seq_len) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, TINY.vocab_size, (GLOBAL_BATCH, seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def train(stage: int, backend: str | None, steps: int = STEPS, seqs: tuple[int, ...] = (),
          compile_kwargs: dict | None = None, schedule: list | None = None) -> dict:
    """Train ``steps`` steps (then one per extra sequence length in ``seqs``); per-step mean loss
    over ranks, collective calls per step, consolidated weights and the compile report."""
    torch.manual_seed(0)
    model = GPT(TINY)
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
    if backend is not None:
        engine.compile(backend=backend, compile_kwargs=compile_kwargs or {}, schedule=schedule)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, calls = [], []
    lengths = [TINY.seq_len] * steps + list(seqs)
    for step, seq in enumerate(lengths):
        x, y = batch(step, seq)
        comm.COUNTER.reset()
        loss = engine(x.chunk(world)[rank], targets=y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        calls.append(sum(s["count"] for s in comm.COUNTER.snapshot().values()))
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    weights = engine.consolidated_state_dict()
    return {"losses": losses, "calls": calls, "weights": {k: v.float() for k, v in weights.items()},
            "report": engine.compile_report(), "is_compiled": engine.is_compiled,
            "compile_time": engine.get_compile_time(), "param_dtype": str(next(engine.module.parameters()).dtype)}


def eager_vs_compiled(stages: list[int], backend: str, seqs: tuple[int, ...] = (),
                      compile_kwargs: dict | None = None, seqs_at: tuple[int, ...] = (0,),
                      precision: str = "fp32") -> dict:
    """For each stage: the eager run, then the compiled run, in this process (extra sequence
    lengths ``seqs`` only at the stages in ``seqs_at``) (Dynamo's caches are
    reset before each compiled run so one engine's guards do not count as another's recompiles)."""
    import time

    import torch._dynamo

    global config
    plain = config

    def with_precision(stage: int) -> dict:
        cfg = plain(stage)
        if precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        return cfg

    out = {}
    config = with_precision
    try:
        for stage in stages:
            extra = seqs if stage in seqs_at else ()
            eager = train(stage, None, seqs=extra)
            torch._dynamo.reset()
            t0 = time.perf_counter()
            compiled = train(stage, backend, seqs=extra, compile_kwargs=compile_kwargs)
            compiled["wall_s"] = time.perf_counter() - t0
            out[stage] = {"eager": eager, "compiled": compiled}
    finally:
        config = plain
    return out


def deep_vs_eager(stages: list[int], backend: str, precision: str = "fp32", steps: int = STEPS,
                  schedule: list | None = None, seqs: tuple[int, ...] = (), seqs_at: tuple[int, ...] = (),
                  compile_extra: dict | None = None, accumulation: int = 1) -> dict:
    """For each stage: the eager run, then the DeepCompile run (``compile.deepcompile: true``); extra
    sequence lengths ``seqs`` after the steps at the stages in ``seqs_at``; ``steps`` are micro-steps,
    ``accumulation`` of them per optimizer step."""
    import torch._dynamo

    global config
    plain = config
    out = {}
    for stage in stages:
        def accumulate(cfg: dict) -> dict:
            cfg["gradient_accumulation_steps"] = accumulation
            cfg["train_batch_size"] = GLOBAL_BATCH * accumulation
            return cfg

        def deep(stage: int) -> dict:
            cfg = accumulate(plain(stage))
            cfg["compile"] = {"deepcompile": True, **(compile_extra or {})}
            if precision == "bf16":
                cfg["bf16"] = {"enabled": True}
            return cfg

        def eager_cfg(stage: int) -> dict:
            cfg = accumulate(plain(stage))
            if precision == "bf16":
                cfg["bf16"] = {"enabled": True}
            return cfg

        try:
            extra = seqs if stage in seqs_at else ()
            config = eager_cfg
            eager = train(stage, None, steps=steps, seqs=extra)
            torch._dynamo.reset()
            config = deep
            compiled = train(stage, backend, steps=steps, schedule=schedule, seqs=extra)
        finally:
            config = plain
        out[stage] = {"eager": eager, "compiled": compiled, "num_params": len(list(GPT(TINY).parameters()))}
    return out


def deepcompile_refusal(nvme_root: str) -> str:
    """The one-line error of engine.compile() under DeepCompile with ZeRO-3 parameter offload to NVMe."""
    torch.manual_seed(0)
    model = GPT(TINY)
    cfg = config(3)
    cfg["compile"] = {"deepcompile": True}
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme_root, "buffer_count": 1,
                                                 "buffer_size": 100_000}
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    try:
        engine.compile(backend="eager")
    except ValueError as error:
        return str(error)
    finally:
        engine.destroy()
    return ""


def deepcompile_after_a_failed_backward() -> tuple[list[float], list[float]]:
    """ZeRO-3 DeepCompile: a backward that fails after starting a reduce-scatter (simulated: a start
    left without its wait) does not break the next steps; the losses with and without it."""
    import torch._dynamo

    out = []
    for inject in (True, False):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(TINY)
        cfg = config(3)
        cfg["compile"] = {"deepcompile": True}
        engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        engine.compile(backend="eager", schedule=[(0, ["gather_release", "prefetch", "reduce_early", "async_reduce"])])
        owner = engine._zs_compile_state.deepcompile.owner
        rank, world = dist.get_rank(), dist.get_world_size()
        losses = []
        for step in range(3):
            x, y = batch(step)
            if step == 1 and inject:  # what a backward that raised halfway leaves: a started reduce-scatter
                bucket = next(iter(owner.buckets.values()))
                owner.reduce_start([torch.zeros(bucket.padded_numel)], [bucket.index])
            loss = engine(x.chunk(world)[rank], targets=y.chunk(world)[rank])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out.append(losses)
        engine.destroy()
    return out[0], out[1]
