"""Model, training loop and rank functions for the checkpoint tests (run in the harness's ranks, or
in a forkserver process that the SIGKILL test kills mid-save)."""

from __future__ import annotations

import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

GLOBAL_BATCH = 8


class CkptNet(nn.Module):
    """Odd sizes (not multiples of 2 or 4), a tied weight, a frozen parameter and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.aux = nn.Linear(7, 13, bias=False)
        self.aux.weight = self.inp.weight  # tied: one parameter, two state_dict names
        self.mid = nn.Linear(13, 5)
        self.out = nn.Linear(5, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3), requires_grad=False)
        self.register_buffer("offset", torch.tensor([0.1, -0.2, 0.3]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x) + 0.5 * self.aux(x))
        out = self.out(torch.tanh(self.mid(h))) * self.scale + self.offset
        return nn.functional.mse_loss(out.float(), y.float())


def make_model(seed: int = 1234) -> CkptNet:
    torch.manual_seed(seed)
    return CkptNet()


def param_groups(model: nn.Module) -> list[dict]:
    first = [model.inp.weight, model.inp.bias]
    rest = [p for n, p in model.named_parameters() if not n.startswith("inp.") and p.requires_grad]
    return [{"params": first, "weight_decay": 0.0}, {"params": rest, "weight_decay": 0.1}]


def config(stage: int, precision: str = "fp32", bucket: int = 40, async_save: bool = False, **zero) -> dict:
    return {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "betas": [0.9, 0.99], "eps": 1e-8}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05,
                                                         "warmup_num_steps": 8, "warmup_type": "linear"}},
            "gradient_clipping": 1.0, "steps_per_print": 0,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                                  **zero},
            "bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": precision == "fp16"},
            "checkpoint": {"async_save": async_save}}


def build(cfg: dict, seed: int = 1234):
    import zerospeed

    model = make_model(seed)
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    return engine


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def train(engine, first_step: int, num_steps: int) -> list[float]:
    rank, world = engine.dp_rank, engine.dp_world_size
    losses = []
    for step in range(first_step, first_step + num_steps):
        x, y = batch(step)
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in engine.module.state_dict(keep_vars=True).items()}


def shard_state(engine) -> dict:
    """Test oracle, independent of the checkpoint code: every kind of state this rank holds as
    ``{kind: {name: [(param_start, 1-D tensor)]}}`` plus scalar optimizer state per name."""
    pieces: dict = {}
    scalars: dict = {}
    opt = engine.optimizer
    for v in engine.strategy.shard_views():
        lay = v.layout
        r = engine.dp_rank if lay.world_size > 1 else 0
        lo = lay.shard_range(r)[0]
        flat = len(v.opt_tensors) == 1 and v.opt_tensors[0].numel() == v.shard_end - v.shard_start
        names = [s.name for s in lay.slots]
        for p in lay.pieces(r):
            pos = lo - v.shard_start + p.shard_start
            name = p.slot.name

            def put(kind, t, at, name=name, p=p):
                part = t.reshape(-1)[at:at + p.numel].float().clone()
                pieces.setdefault(kind, {}).setdefault(name, []).append((p.param_start, part))

            put("weight", v.param_shard, pos)
            put("master", v.master, pos)
            t = v.opt_tensors[0] if flat else v.opt_tensors[names.index(name)]
            for k, val in opt.state.get(t, {}).items():
                if torch.is_tensor(val) and val.dim() > 0:
                    put(k, val, pos if flat else p.param_start)
                else:
                    scalars.setdefault(name, {})[k] = float(val)
    return {"pieces": pieces, "scalars": scalars}


def merge(states: list[dict]) -> dict:
    """Full tensors per (kind, name) from every rank's :func:`shard_state`."""
    out: dict = {}
    for st in states:
        for kind, by_name in st["pieces"].items():
            for name, parts in by_name.items():
                out.setdefault(kind, {}).setdefault(name, {})
                for start, t in parts:
                    out[kind][name][start] = t
    full = {kind: {name: torch.cat([parts[s] for s in sorted(parts)]) for name, parts in by_name.items()}
            for kind, by_name in out.items()}
    scalars: dict = {}
    for st in states:
        for name, sc in st["scalars"].items():
            scalars.setdefault(name, sc)
    return {"full": full, "scalars": scalars}


def summary(engine) -> dict:
    return {"state": shard_state(engine), "weights": weights(engine), "lr": engine.get_lr(),
            "sched": engine.lr_scheduler.state_dict(), "counters": (engine.global_steps, engine.global_samples,
                                                                    engine.micro_steps, engine.skipped_steps),
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]}


CLIENT_STATE = {"epoch": 3, "note": "hello", "ratio": 0.25, "tup": (1, "a"), "nested": {"t": torch.arange(5.0)},
                "arr": np.arange(4, dtype=np.int32), "none": None}


# -- rank functions -----------------------------------------------------------------------------------

def save_case(cfg: dict, save_dir: str, steps: int, tag: str | None = None) -> dict:
    engine = build(cfg)
    train(engine, 0, steps)
    engine.save_checkpoint(save_dir, tag=tag, client_state=CLIENT_STATE)
    return summary(engine)


def load_case(cfg: dict, load_dir: str, tag: str | None = None, **kwargs) -> dict:
    engine = build(cfg, seed=99)  # different initial weights: everything must come from the checkpoint
    path, client = engine.load_checkpoint(load_dir, tag=tag, **kwargs)
    out = summary(engine)
    out.update(path=path, client=client)
    # the loaded engine trains on: every replica stays identical
    out["next_losses"] = train(engine, engine.global_steps, 2)
    out["after"] = weights(engine)
    return out


def resume_case(cfg: dict, save_dir: str, phase: str) -> dict:
    engine = build(cfg)
    if phase == "straight":
        losses = train(engine, 0, 10)
    elif phase == "first":
        losses = train(engine, 0, 5)
        engine.save_checkpoint(save_dir)
    else:
        engine.load_checkpoint(save_dir)
        losses = train(engine, engine.global_steps, 5)
    return {"losses": losses, "weights": weights(engine), "state": shard_state(engine), "lr": engine.get_lr()}


def failing_rank_case(cfg: dict, save_dir: str) -> dict:
    from zerospeed.checkpoint import CheckpointSaveError

    engine = build(cfg)
    train(engine, 0, 1)
    engine.save_checkpoint(save_dir, tag="good")
    train(engine, 1, 1)
    os.environ["ZEROSPEED_CKPT_TEST_FAIL"] = "1"
    try:
        engine.save_checkpoint(save_dir, tag="bad")
        raised = None
    except CheckpointSaveError as e:
        raised = str(e)
    finally:
        del os.environ["ZEROSPEED_CKPT_TEST_FAIL"]
    dist.barrier()
    listing = sorted(os.listdir(save_dir))
    latest = open(os.path.join(save_dir, "latest")).read()
    engine.save_checkpoint(save_dir, tag="after")  # a later save works
    return {"raised": raised, "listing": listing, "latest": latest}


def async_case(cfg: dict, save_dir: str) -> dict:
    from zerospeed.runtime.checkpointing import checkpoint_pending, wait_for_checkpoint

    engine = build(cfg)
    train(engine, 0, 3)
    at_save = summary(engine)
    # the background writer waits 2 s before writing, so training below certainly overlaps it
    os.environ.update(ZEROSPEED_CKPT_TEST_PAUSE="write", ZEROSPEED_CKPT_TEST_PAUSE_S="2")
    try:
        t0 = time.perf_counter()
        engine.save_checkpoint(save_dir, client_state={"k": 1})
        blocking = time.perf_counter() - t0
        train(engine, 3, 3)  # changes every parameter and optimizer state the snapshot copied
        overlapped = checkpoint_pending(engine)
        stats = wait_for_checkpoint(engine)
    finally:
        del os.environ["ZEROSPEED_CKPT_TEST_PAUSE"]
    return {"at_save": at_save, "blocking_s": blocking, "overlapped": overlapped, "stats": vars(stats)}


def bad_inputs_case(cfg: dict, ckpt_dir: str, scratch: str) -> dict:
    """Every bad input, in one process; returns {case: (exception class, message)}."""
    import shutil

    from zerospeed.checkpoint import CheckpointError

    engine = build(cfg, seed=7)
    before = weights(engine)
    out = {}

    def attempt(case, fn):
        try:
            fn()
            out[case] = (None, "")
        except Exception as e:  # noqa: BLE001
            out[case] = (type(e).__name__, str(e), isinstance(e, CheckpointError))

    attempt("missing_dir", lambda: engine.load_checkpoint(os.path.join(scratch, "nope"), tag="global_step4"))
    out["missing_dir_no_tag"] = engine.load_checkpoint(os.path.join(scratch, "nope"))  # DeepSpeed: (None, None)
    attempt("unknown_tag", lambda: engine.load_checkpoint(ckpt_dir, tag="global_step999"))
    stale = os.path.join(scratch, "stale")
    shutil.copytree(ckpt_dir, stale)
    with open(os.path.join(stale, "latest"), "w") as f:
        f.write("global_step42")
    attempt("latest_missing_tag", lambda: engine.load_checkpoint(stale))
    empty = os.path.join(scratch, "empty")
    os.makedirs(empty)
    out["no_latest_result"] = engine.load_checkpoint(empty)
    tag = open(os.path.join(ckpt_dir, "latest")).read().strip()

    def corrupted(name, mutate):
        d = os.path.join(scratch, name)
        shutil.copytree(ckpt_dir, d)
        mutate(os.path.join(d, tag))
        return d

    def truncate(path):
        f = os.path.join(path, "rank00001.safetensors")
        os.truncate(f, os.path.getsize(f) - 7)

    def flip(path):
        f = os.path.join(path, "rank00000.safetensors")
        with open(f, "r+b") as fh:
            fh.seek(os.path.getsize(f) - 40)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0x10]))

    def bad_index(path):
        f = os.path.join(path, "index.json")
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)

    def missing_file(path):
        os.unlink(os.path.join(path, "rank00001.safetensors"))

    for name, mutate in (("truncated", truncate), ("bitflip", flip), ("bad_index", bad_index),
                         ("missing_file", missing_file)):
        d = corrupted(name, mutate)
        attempt(name, lambda d=d: engine.load_checkpoint(d))
    out["unchanged_after_failures"] = all((weights(engine)[k] == v).all().item() for k, v in before.items())
    # warm start: weights only; counters, optimizer and scheduler stay as they are
    path, client = engine.load_checkpoint(ckpt_dir, load_module_only=True)
    out["module_only"] = {"weights": weights(engine), "global_steps": engine.global_steps,
                          "optimizer_state": len(engine.optimizer.state), "client": client}
    attempt("bad_client_state", lambda: engine.save_checkpoint(os.path.join(scratch, "cs"), client_state={"f": print}))
    attempt("bad_tag", lambda: engine.save_checkpoint(os.path.join(scratch, "cs"), tag="../escape"))
    return out


def readonly_case(cfg: dict, ro_dir: str) -> tuple:
    engine = build(cfg)
    try:
        engine.save_checkpoint(ro_dir)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None, ""


def stage3_case(cfg: dict, save_dir: str, phase: str) -> dict:
    if phase == "save":
        return save_case(cfg, save_dir, 3)
    return load_case(cfg, save_dir)


# -- the SIGKILL test's process ---------------------------------------------------------------------

def kill_save_target(save_dir: str, point: str, marker: str) -> None:
    """Save tag "a", train, then save again pausing at ``point`` (the test SIGKILLs us there).
    "swap" re-saves tag "a" (killed between its two renames); the other points save a new tag "b"."""
    os.environ.update(OMP_NUM_THREADS="1", ZEROSPEED_CKPT_TEST_PAUSE_S="120")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        os.environ.pop(key, None)
    torch.set_num_threads(1)
    engine = build(config(1))
    train(engine, 0, 2)
    engine.save_checkpoint(save_dir, tag="a")
    train(engine, 2, 1)
    os.environ.update(ZEROSPEED_CKPT_TEST_PAUSE=point, ZEROSPEED_CKPT_TEST_PAUSE_MARKER=marker)
    engine.save_checkpoint(save_dir, tag="a" if point == "swap" else "b")
