"""Rank functions for the DeepSpeed-compatibility tests (issue 20), run through run_distributed."""

from __future__ import annotations

import torch
from torch import nn

from engine_cases import TinyNet, config, global_batch, make_model


class LogitsNet(TinyNet):
    """TinyNet returning the (non-scalar) prediction; the loss is computed outside the engine."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def _train(cfg: dict, torch_style: bool, logits: bool, steps: int = 3, user_scale: bool = False) -> dict:
    import torch.distributed as dist

    import zerospeed

    torch.manual_seed(1234)
    model = LogitsNet() if logits else make_model()
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    gas = engine.gradient_accumulation_steps()
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        for xm, ym in zip(xs.chunk(gas), ys.chunk(gas)):
            if logits:
                loss = nn.functional.mse_loss(engine(xm).float(), ym)
            else:
                loss = engine(xm, ym)
            if not torch_style:
                engine.backward(loss)
            elif user_scale:
                engine.scale(loss).backward()
            else:
                loss.backward()
            engine.step()
            losses.append(loss.item())
    weights = {n: p.detach().float().clone() for n, p in engine.consolidated_state_dict().items()}
    norm = engine.get_global_grad_norm()
    engine.destroy()
    return {"losses": losses, "weights": weights, "norm": norm}


def backward_parity(cases: list[tuple[int, str, bool, bool]]) -> list[dict]:
    """For each (stage, precision, logits, user_scale): engine.backward run vs loss.backward run."""
    out = []
    for stage, precision, logits, user_scale in cases:
        cfg = config(stage, 2, precision, bucket=40)
        if precision == "fp16":
            cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
        a = _train(cfg, torch_style=False, logits=logits)
        b = _train(cfg, torch_style=True, logits=logits, user_scale=user_scale)
        out.append({"case": (stage, precision, logits, user_scale), "a": a, "b": b})
    return out


def fp16_logits_refused() -> str:
    cfg = config(0, 2, "fp16")
    try:
        _train(cfg, torch_style=True, logits=True, steps=1)
    except RuntimeError as e:
        return str(e)
    return "no error"


def engine_api_probe() -> dict:
    """Build a world-1... or world-N engine and read DeepSpeed's engine members."""
    import zerospeed
    from zerospeed.runtime.engine_api import LACKS, DeepSpeedEngineAPI
    from zerospeed.runtime.engine import ZeroSpeedEngine

    model = make_model()
    cfg = config(2, 2, "bf16", scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 2}})
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    out = {
        "device": str(engine.device), "local_rank": engine.local_rank, "global_rank": engine.global_rank,
        "world_size": engine.world_size, "fp16": engine.fp16_enabled(), "bf16": engine.bfloat16_enabled(),
        "stage": engine.zero_optimization_stage(), "zero": engine.zero_optimization(),
        "partition_grads": engine.zero_optimization_partition_gradients(),
        "partition_weights": engine.zero_optimization_partition_weights(),
        "batch_info": engine.get_batch_info(), "optimizer_name": engine.optimizer_name(),
        "scheduler_name": engine.scheduler_name(), "clip": engine.gradient_clipping(),
        "comm_dtype": str(engine.communication_data_type), "mom": engine.get_mom(),
        "data_parallel_rank": engine.get_data_parallel_rank(), "flops": engine.flops_profiler_enabled(),
    }
    x, y = global_batch(0)
    assert engine.get_global_grad_norm() is None
    for xm, ym in zip(x[:4].chunk(2), y[:4].chunk(2)):
        engine.backward(engine(xm, ym))
        engine.step()
    out["grad_norm"] = engine.get_global_grad_norm()
    out["applied"] = engine.was_step_applied()
    engine.set_train_batch_size(4 * engine.world_size * 4)
    out["batch_after_set"] = engine.get_batch_info()
    try:
        engine.set_train_batch_size(3)
    except ValueError as e:
        out["bad_batch"] = str(e)
    errors = {}
    for name in LACKS:
        if getattr(ZeroSpeedEngine, name) is not getattr(DeepSpeedEngineAPI, name):
            continue  # implemented by the engine itself meanwhile (e.g. save_16bit_model, issue 19)
        try:
            getattr(engine, name)()
        except NotImplementedError as e:
            errors[name] = str(e)
    out["lack_errors"] = errors
    out["lack_checked"] = len(errors)
    state = engine.module_state_dict()
    out["state_keys"] = sorted(state)
    engine.destroy()
    return out


def comm_names_probe() -> dict:
    """DeepSpeed's comm names at world 2: values and counting."""
    import zerospeed.comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dist.COUNTER.reset()
    out: dict = {"rank": rank, "world": world, "local_rank": dist.get_local_rank(),
                 "initialized": dist.is_initialized(), "backend": dist.get_backend()}
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out["all_reduce"] = t.item()
    b = torch.tensor([float(rank + 10)])
    dist.broadcast(b, src=1)
    out["broadcast"] = b.item()
    g = torch.zeros(2 * world)
    dist.all_gather_into_tensor(g, torch.full((2,), float(rank)))
    out["all_gather_into_tensor"] = g.tolist()
    lst = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(lst, torch.tensor([float(rank * 3)]))
    out["all_gather_list"] = [x.item() for x in lst]
    inp = torch.arange(2.0 * world) + rank
    keep = inp.clone()
    o = torch.zeros(2)
    dist.reduce_scatter_tensor(o, inp)
    out["reduce_scatter_tensor"] = o.tolist()
    out["input_untouched"] = bool(torch.equal(inp, keep))
    a2a = torch.zeros(world)
    dist.all_to_all_single(a2a, torch.arange(float(world)) + 10 * rank)
    out["all_to_all_single"] = a2a.tolist()
    group = dist.new_group([0, 1])
    t2 = torch.ones(1)
    dist.all_reduce(t2, group=group)
    out["group_sum"] = t2.item()
    out["global_rank_of_1"] = dist.get_global_rank(group, 1)
    dist.barrier()
    snap = dist.COUNTER.snapshot()
    out["counted"] = {op: s["count"] for op, s in snap.items()}
    return out


def accelerator_probe() -> dict:
    from zerospeed.accelerator import get_accelerator

    acc = get_accelerator()
    return {"name": acc.device_name(), "current": acc.current_device(), "count": acc.device_count(),
            "backend": acc.communication_backend_name()}


# -- pipeline (issue 20, point 8) ------------------------------------------------------------------
INPLACE_BOUNDS = [0, 1, 5]  # stage 1 starts with ReLU(inplace=True)


def inplace_layers() -> list:
    torch.manual_seed(7)
    return [nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 2)]


def inplace_batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def _pipe_cfg(gas: int) -> dict:
    return {"train_batch_size": 8, "gradient_accumulation_steps": gas, "steps_per_print": 0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "pipeline": {"schedule": "1f1b"}}


def inplace_pipeline_run(steps: int = 3) -> list[float]:
    import zerospeed
    from zerospeed.pipe import PipelineModule

    model = PipelineModule(inplace_layers(), num_stages=2, loss_fn=nn.functional.mse_loss,
                           partition_method=INPLACE_BOUNDS)
    engine, *_ = zerospeed.initialize(model=model, config=_pipe_cfg(2))
    losses = []
    for step in range(steps):
        x, y = inplace_batches(step)
        losses.append(float(engine.train_batch(iter(list(zip(x.chunk(2), y.chunk(2)))))))
    return losses


def inplace_reference(steps: int = 3) -> list[float]:
    model = nn.Sequential(*inplace_layers())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = inplace_batches(step)
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x.chunk(2), y.chunk(2)):
            loss = nn.functional.mse_loss(model(xm), ym) / 2
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses


class _Indexed(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((4,), float(i)), torch.zeros(2)


def pipeline_loader_order() -> dict:
    """train_batch() without an iterator: which samples the first stage read, in order."""
    import zerospeed
    from zerospeed.pipe import PipelineModule

    seen: list[float] = []

    class Spy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.extend(x[:, 0].tolist())
            return x

    torch.manual_seed(0)
    model = PipelineModule([Spy(), nn.Linear(4, 4), nn.Linear(4, 2)], num_stages=2,
                           loss_fn=nn.functional.mse_loss, partition_method=[0, 2, 3])
    engine, _, loader, _ = zerospeed.initialize(model=model, config=_pipe_cfg(2), training_data=_Indexed())
    for _ in range(2):
        engine.train_batch()
    return {"seen": seen, "loader_first": next(iter(loader))[0][:, 0].tolist()}


# -- ZeRO-3 and parameters read outside their module's forward (issue 20, point 6) ----------------
class AttnNet(nn.Module):
    """nn.MultiheadAttention (reads out_proj.weight without calling out_proj) and a TransformerEncoderLayer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(6, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.block = nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.0, batch_first=True)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = nn.functional.relu(self.inp(x), inplace=True)  # in place on a view (Linear on 3-D input)
        h, _ = self.attn(h, h, h, need_weights=False)
        h = self.block(h)
        return nn.functional.mse_loss(self.out(h).mean(dim=1), y)


class UnregisteredReader(nn.Module):
    """Reads ``proj.weight`` without calling ``proj`` and without registering it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(nn.functional.linear(x, self.proj.weight), y)


def attn_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(8, 4, 6, generator=g), torch.randn(8, 3, generator=g)


def _attn_cfg() -> dict:
    return {"train_batch_size": 8, "gradient_accumulation_steps": 1, "steps_per_print": 0,
            # SGD: the key part of in_proj_bias has a gradient of zero in exact arithmetic (softmax is
            # shift-invariant); Adam would turn its rounding noise into full-size steps
            "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def attn_reference(steps: int = 3) -> dict:
    model = AttnNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        x, y = attn_batch(step)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # _attn_cfg has no gradient_clipping: 1.0 (DeepSpeed's)
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        x, y = attn_batch(99)
        eval_loss = model(x, y).item()
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "eval": eval_loss}


def attn_zero3_run(steps: int = 3) -> dict:
    import torch.distributed as dist

    import zerospeed

    engine, *_ = zerospeed.initialize(model=AttnNet(), config=_attn_cfg())
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        x, y = attn_batch(step)
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    engine.eval()
    with torch.no_grad():  # TransformerEncoderLayer's fast path reads its children's weights directly
        x, y = attn_batch(99)
        total = engine(x.chunk(world)[rank], y.chunk(world)[rank]).detach().clone()
        dist.all_reduce(total)
    weights = engine.consolidated_state_dict()
    engine.destroy()
    return {"losses": losses, "weights": weights, "eval": total.item() / world}


def unregistered_reader_error() -> str:
    import zerospeed

    engine, *_ = zerospeed.initialize(model=UnregisteredReader(), config=_attn_cfg())
    x, y = attn_batch(0)
    try:
        engine(x[:4, 0], y[:4])
    except RuntimeError as e:
        return f"{e} | cause: {type(e.__cause__).__name__}"
    return "no error"


# -- bf16 masters / optimizer states and torch_autocast (issue 20, point 7) -------------------------
def precision_run(extra: dict, stage: int = 2, steps: int = 8) -> dict:
    import torch.distributed as dist

    import zerospeed

    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(7, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
    cfg = {"train_batch_size": 16, "gradient_accumulation_steps": 1, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 10_000, "allgather_bucket_size": 10_000}}
    cfg.update(extra)
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        out = engine(x.chunk(world)[rank])
        loss = nn.functional.mse_loss(out.float(), y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    state_dtypes = sorted({str(v.dtype) for s in engine.optimizer.state.values() for v in s.values()
                           if torch.is_tensor(v) and v.numel() > 1})
    numel = sum(p.numel() for p in model.parameters())
    return {"losses": losses, "memory": engine.memory_breakdown(), "numel": numel, "state_dtypes": state_dtypes,
            "out_dtype": str(out.dtype), "param_dtype": str(next(model.parameters()).dtype)}


def precision_runs(cases: list[dict]) -> list[dict]:
    """Each case a config overlay; an optional "_stage" key picks the ZeRO stage (default 2)."""
    return [precision_run({k: v for k, v in c.items() if k != "_stage"}, stage=c.get("_stage", 2)) for c in cases]


def initialize_with_two_configs() -> str:
    import argparse

    import zerospeed

    args = zerospeed.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepspeed_config", "x.json"])
    try:
        zerospeed.initialize(args=args, model=make_model(), config=config(0, 1))
    except ValueError as e:
        return str(e)
    return "no error"


class _SumNet(nn.Module):
    """DeepSpeed's test_zero_torch_func model: the engine's output is the scalar it is differentiated for."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))).sum()


def torch_func_through_engine(stage: int) -> dict:
    """torch.func transforms called on the engine (whose output passes through torch_backward._Entry) against
    the same transforms on a copy of the model, at 4 accumulation steps (not applied under a transform, as in
    DeepSpeed); then 3 steps of loss.backward() after the transforms against 3 steps without them. ZeRO-3 (nothing
    persistent): the transforms' backward gathers the modules and releases them at its end (``live_after`` 0)."""
    import copy

    import zerospeed

    def build() -> tuple:
        torch.manual_seed(0)
        model = _SumNet()
        baseline = copy.deepcopy(model)
        zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
               "zero_optimization": zero, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
        engine, *_ = zerospeed.initialize(model=model, config=cfg)
        return engine, baseline

    func = torch.func
    engine, baseline = build()
    x, t = torch.randn(8), torch.randn(8)
    xs = torch.stack([x, x + 0.1, x - 0.1])
    f, g = (lambda xi: engine(xi)), (lambda xi: baseline(xi))
    pairs = {
        "grad": (func.grad(f)(x), func.grad(g)(x)),
        "grad_and_value": (torch.cat([v.reshape(-1) for v in func.grad_and_value(f)(x)]),
                           torch.cat([v.reshape(-1) for v in func.grad_and_value(g)(x)])),
        "jacrev": (func.jacrev(f)(x), func.jacrev(g)(x)),
        "vmap_grad": (func.vmap(func.grad(f))(xs), func.vmap(func.grad(g))(xs)),
        "vmap": (func.vmap(f)(xs), func.vmap(g)(xs)),
        "jvp": (func.jvp(f, (x,), (t,))[1], func.jvp(g, (x,), (t,))[1]),
    }
    errors = {k: float((a - b).detach().abs().max()) for k, (a, b) in pairs.items()}
    # ZeRO-3: the transforms' backward gathered each module again and released it when its autograd pass ended
    live_after = getattr(getattr(engine.strategy, "runtime", None), "live_numel", 0)

    def train(e) -> list[torch.Tensor]:
        for i in range(3):
            for _ in range(e.gradient_accumulation_steps()):
                loss = e(x.unsqueeze(0) + i)
                loss.backward()
                e.step()
        return [p.detach().clone() for p in e.module.parameters()]

    after_transforms = train(engine)
    plain, _ = build()
    reference = train(plain)
    return {"errors": errors, "live_after": live_after,
            "train_equal": all(torch.equal(a, b) for a, b in zip(after_transforms, reference))}
