"""Models, data, reference runs and per-rank bodies for the ZeRO-3 tests (imported by the ranks).

``Zoo`` has every shape of parameter use ZeRO-3 must handle: a tied embedding / LM head, a module
called twice, a frozen submodule, a parameter owned by the root, a parameter used outside its
module's forward (registered with ``zero.register_external_parameter``), and sizes that are not
multiples of 2 or 4. ``Chain`` is a plain stack of linears for exact byte and traffic counts.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import zerospeed
from zerospeed import comm, zero

VOCAB, DIM, HID = 11, 6, 7
GLOBAL_BATCH, SEQ = 16, 5
STEPS = 3
EVAL_AFTER = 2  # a no_grad evaluation runs after this many steps, then training continues


class Zoo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.shared = nn.Linear(DIM, DIM)  # called twice per forward
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.mid = nn.Linear(DIM, HID)
        self.out = nn.Linear(HID, DIM)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, DIM))  # owned by the root
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        zero.register_external_parameter(self, self.mid.bias)  # used below, outside mid's forward

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = torch.tanh(self.shared(h))
        h = self.frozen(h)
        h = torch.tanh(self.shared(h))
        h = self.out(torch.tanh(self.mid(h)) + 0.1 * self.mid.bias) * self.gain
        logits = self.head(h)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


class Chain(nn.Module):
    """Linears with sizes that are not multiples of the world size."""

    def __init__(self, sizes: tuple[int, ...] = (7, 13, 9, 5, 3)) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return F.mse_loss(x.float(), y.float())


class CheckpointedChain(Chain):
    """``Chain`` with activation checkpointing of the middle layers: forwards re-run inside backward."""

    use_reentrant = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for i, layer in enumerate(self.layers):
            if 0 < i < len(self.layers) - 1:
                x = checkpoint(lambda t, layer=layer: torch.tanh(layer(t)), x, use_reentrant=self.use_reentrant)
            else:
                x = layer(x)
                if i < len(self.layers) - 1:
                    x = torch.tanh(x)
        return F.mse_loss(x.float(), y.float())


class Blocks(nn.Module):
    """Identical blocks; ``skip_on_rank`` makes one rank skip ``blocks.1`` (control-flow divergence)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.skip_on_rank: int | None = None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i == 1 and self.skip_on_rank == comm.get_rank():
                continue
            x = torch.tanh(block(x))
        return F.mse_loss(x, y)


def make_zoo() -> Zoo:
    torch.manual_seed(1234)
    return Zoo()


def zoo_groups(model: nn.Module) -> list[dict]:
    first = [model.embed.weight, model.shared.weight, model.shared.bias]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith(("embed.", "shared."))]
    return [{"params": first, "lr": 0.02, "weight_decay": 0.0}, {"params": rest, "lr": 0.01, "weight_decay": 0.1}]


def zoo_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return (torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g))


def config(gas: int = 1, precision: str = "fp32", clip: float = 1.0, **zero_knobs) -> dict:
    zcfg = {"stage": 3, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 0,
            "stage3_collective_timeout_s": 60}
    zcfg.update(zero_knobs)
    return {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "betas": [0.9, 0.99], "eps": 1e-8,
                                                    "weight_decay": 0.0}},
            "gradient_clipping": clip, "steps_per_print": 0, "zero_optimization": zcfg,
            "bf16": {"enabled": precision == "bf16"}}


def reference_zoo(gas: int, steps: int = STEPS) -> dict:
    """Plain single-process PyTorch on the whole global batch (``gas`` micro-batches)."""
    model = make_zoo()
    opt = torch.optim.AdamW(zoo_groups(model), lr=0.05, betas=(0.9, 0.99), eps=1e-8, foreach=False)
    losses, eval_loss = [], None
    for step in range(steps):
        if step == EVAL_AFTER:
            with torch.no_grad():
                eval_loss = model(*zoo_batch(100)).item()
        x, y = zoo_batch(step)
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x.chunk(gas), y.chunk(gas)):
            loss = model(xm, ym) / gas
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(total)
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "eval": eval_loss}


def _train(engine, batch_fn, steps: int, first: int = 0, after_step=None) -> tuple[list[float], list[dict]]:
    """Train ``steps`` steps on this rank's slice of each global batch; per step: the mean loss over
    ranks, and the counter's snapshot plus ``traffic`` (``COUNTER.traffic_elements()``).
    ``after_step(engine)`` runs after each optimizer step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gas = engine.gradient_accumulation_steps()
    losses, comms = [], []
    for step in range(first, first + steps):
        x, y = batch_fn(step)
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        total = torch.zeros(())
        comm.COUNTER.reset()
        for xm, ym in zip(xs.chunk(gas), ys.chunk(gas)):
            loss = engine(xm, ym)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / gas
        comms.append({"ops": comm.COUNTER.snapshot(), "traffic": comm.COUNTER.traffic_elements()})
        if after_step is not None:
            after_step(engine)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses, comms


def zoo_run(cfg: dict, use_init: bool = False) -> dict:
    """Train the Zoo with ZeRO-3; return losses, consolidated weights (rank 0), eval loss, stats."""
    if use_init:
        with zero.Init(config_dict_or_path=cfg):
            model = make_zoo()
        partitioned_at_build = all(zero.is_partitioned(p) and p.numel() == 0 for p in model.parameters())
    else:
        model = make_zoo()
        partitioned_at_build = False
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=zoo_groups(model), config=cfg)
    losses, _ = _train(engine, zoo_batch, EVAL_AFTER)
    engine.eval()
    x, y = zoo_batch(100)
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        comm.COUNTER.reset()
        eval_loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        eval_comms = comm.COUNTER.snapshot()
    eval_t = eval_loss.detach().float().reshape(1)
    dist.all_reduce(eval_t)
    live_after_eval = engine.memory_breakdown()["gathered_params_live"]
    engine.train()
    losses += _train(engine, zoo_batch, STEPS - EVAL_AFTER, first=EVAL_AFTER)[0]
    memory = engine.memory_breakdown()
    weights = engine.strategy.consolidated_state_dict()
    return {"losses": losses, "weights": {k: v.float() for k, v in weights.items()},
            "eval": eval_t.item() / world, "eval_comms": eval_comms, "memory": memory,
            "live_after_eval": live_after_eval,
            "partitioned_at_build": partitioned_at_build,
            "all_partitioned_after": all(p.numel() == 0 for b in engine.strategy.buckets if not b.persistent
                                         for _, p in b.live_params()),
            "persistent_gathered": all(p.numel() > 0 for b in engine.strategy.buckets if b.persistent
                                       for _, p in b.live_params()),
            "num_buckets": engine.strategy.num_buckets}


def zoo_runs(cfgs: list[dict]) -> list[dict]:
    """Several configs in one launch (process start-up is the expensive part on 2 cores)."""
    return [zoo_run(cfg) for cfg in cfgs]


# -- bytes and traffic ---------------------------------------------------------------------------
def chain_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def chain_accounting(cfg: dict) -> dict:
    torch.manual_seed(7)
    model = Chain()
    num_params = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses, comms = _train(engine, chain_batch, 2)
    buckets = engine.strategy.buckets
    return {"psi": num_params, "padded": sum(b.padded_numel for b in buckets), "num_buckets": len(buckets),
            "num_parameters": engine.strategy.num_parameters(),
            "largest": max(b.padded_numel for b in buckets), "memory": engine.memory_breakdown(),
            "comms": comms, "gathered_peak_numel": engine.strategy.runtime.live_peak_numel}


def reference_chain(model_cls: type = Chain, steps: int = 3) -> list[float]:
    torch.manual_seed(7)
    model = model_cls()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0,
                            foreach=False)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = model(*chain_batch(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def checkpointed_chain_run(cfg: dict, use_reentrant: bool, steps: int = 3) -> list[float]:
    torch.manual_seed(7)
    model = CheckpointedChain()
    model.use_reentrant = use_reentrant
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return _train(engine, chain_batch, steps)[0]


# -- zero.Init -----------------------------------------------------------------------------------
class Big(nn.Module):
    """Many equal layers built in a list comprehension (none is attached before all are built)."""

    def __init__(self, num_layers: int = 32, dim: int = 512) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim, dim) for _ in range(num_layers)])


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def _current_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def init_peak_memory(label: str) -> dict:
    """Peak RSS growth while building ``Big`` under zero.Init (``label="init"``) or without it.

    Large allocations are forced onto mmap (``mallopt(M_MMAP_THRESHOLD)``), so freed tensors leave
    the resident set at once and the high-water mark measures live tensors, not heap reuse.
    8 layers of 1024 x 1024 (4 MiB each, 32 MiB in all): the high-water mark also counts a few hundred
    KiB that are not tensors (first-touched pages, Python objects): 0.2-0.3 of a layer with the former
    32 layers of 512 x 512 (1 MiB), which left the test 0.7 MiB below its bound; under 0.06 of a layer
    here, which leaves it ~3.9 MiB below.
    """
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD; also stops its dynamic growth
    cfg = config()
    with zero.Init(config_dict_or_path=cfg):  # warm up: imports (config parsing...) are not the model
        nn.Linear(2, 2)
    torch.manual_seed(0)
    dist.barrier()
    resettable = _reset_peak_rss()
    base = _current_rss_bytes()
    dim = 1024
    if label == "init":
        with zero.Init(config_dict_or_path=cfg):
            model = Big(num_layers=8, dim=dim)
    else:
        model = Big(num_layers=8, dim=dim)
    peak = _peak_rss_bytes() - base
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    layer = (dim * dim + dim) * 4
    return {"peak": peak, "resettable": resettable, "held": held, "full": 8 * layer, "layer": layer}


# -- GatheredParameters --------------------------------------------------------------------------
def gathered_parameters_case(precision: str) -> dict:
    rank = dist.get_rank()
    model = make_zoo()
    cfg = config(precision=precision)
    cfg["optimizer"]["params"]["lr"] = 0.0  # a step must keep the new values (fp32 masters re-partitioned)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=trainable, config=cfg)
    out: dict = {"partitioned_shape": tuple(model.mid.weight.shape)}
    with zero.GatheredParameters(model.mid.weight):
        out["read_shape"] = tuple(model.mid.weight.shape)
        out["read"] = model.mid.weight.detach().float().clone()
    with zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        with torch.no_grad():
            model.mid.weight.fill_(0.25 if rank == 0 else -9.0)  # rank 1's write must lose
            model.embed.weight[0].fill_(2.0 if rank == 0 else -9.0)
            model.gain.data = torch.full((DIM,), 3.0 if rank == 0 else -9.0, dtype=model.gain.dtype)
    out["after_modify_shape"] = tuple(model.mid.weight.shape)
    with zero.GatheredParameters(model.out.weight):  # no modifier rank: a change is discarded
        with torch.no_grad():
            model.out.weight.fill_(123.0)
    x, y = zoo_batch(0)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    out["weights"] = {k: v.float() for k, v in engine.strategy.consolidated_state_dict().items()}
    return out


# -- divergence and dead peers -------------------------------------------------------------------
def blocks_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(900 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 8, generator=g)


def divergence_case(mode: str, timeout_s: float) -> float:
    """At step 1 rank 1 skips ``blocks.1`` (mode "skip") or dies (mode "die"); "skip_first" skips at
    step 0, before a trace exists (only the time-out can catch that)."""
    torch.manual_seed(3)
    model = Blocks()
    cfg = config(stage3_collective_timeout_s=timeout_s)
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.monotonic()
    for step in range(2):
        if step == (0 if mode == "skip_first" else 1):
            t0 = time.monotonic()
            if mode in ("skip", "skip_first"):
                model.skip_on_rank = 1
            elif mode == "die" and rank == 1:
                os._exit(0)
        x, y = blocks_batch(step)
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
    return time.monotonic() - t0


def persistent_regather_case() -> dict:
    """Persistent buckets re-gathered after a step: one all-gather for all of them (same group and dtype), and
    each parameter's full value equals the concatenation of every rank's shard of it."""
    cfg = config(1, stage3_param_persistence_threshold=1 << 20)  # every bucket of the Zoo persistent
    model = make_zoo()
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=zoo_groups(model), config=cfg)
    _train(engine, zoo_batch, 1)
    persistent = [b for b in engine.strategy.buckets if b.persistent]
    comm.COUNTER.reset()
    engine.strategy.runtime.gather_persistent()
    gathers = comm.COUNTER.count("all_gather")
    world = dist.get_world_size()
    exact = True
    for b in persistent:
        shards = [torch.empty_like(b.shard) for _ in range(world)]
        dist.all_gather(shards, b.shard)
        flat = torch.cat(shards)
        for i, p in b.live_params():
            slot = b.layout.slots[i]
            exact &= bool(torch.equal(p.detach().reshape(-1), flat.narrow(0, slot.offset, slot.numel)))
    return {"persistent": len(persistent), "gathers": gathers, "exact": exact}
