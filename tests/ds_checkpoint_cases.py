"""Rank functions of the DeepSpeed-checkpoint tests (issue #26): build a zerospeed engine on the
fixture model, load a folder DeepSpeed 0.19.8 wrote, report the loaded state, train on."""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures", "deepspeed")
sys.path.insert(0, FIXTURES)

from tiny_model import batch, config, make_model, param_groups  # noqa: E402

from checkpoint_cases import shard_state  # noqa: E402


def zs_config(stage: int, precision: str, world: int, offload: bool = False) -> dict:
    cfg = copy.deepcopy(config(stage, precision, world))
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def build(cfg: dict, seed: int = 99, groups: bool = False):
    """The fixture model; ``groups``: with tiny_model.param_groups, as the ``*_groups`` fixtures trained."""
    import zerospeed

    model = make_model(seed)
    params = param_groups(model) if groups else model.parameters()
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=params, config=cfg)
    return engine


def train(engine, first: int, num: int) -> list[float]:
    rank, world = engine.dp_rank, engine.dp_world_size
    losses = []
    dtype = engine.compute_dtype
    for step in range(first, first + num):
        x, y = batch(step)
        loss = engine(x.chunk(world)[rank].to(dtype), y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def resume_case(cfg: dict, load_dir: str, num_steps: int, groups: bool = False, **load_kwargs) -> dict:
    engine = build(cfg, groups=groups)
    path, client = engine.load_checkpoint(load_dir, **load_kwargs)
    state = shard_state(engine)
    scaler = getattr(engine, "loss_scaler", None)
    out = {"path": path, "client_keys": sorted(client) if client is not None else None,
           "client": {k: client[k] for k in ("epoch", "note", "best") if client and k in client},
           "client_weights": client["weights"].tolist() if client and "weights" in client else None,
           "state": state, "global_steps": engine.global_steps, "global_samples": engine.global_samples,
           "skipped_steps": engine.skipped_steps,
           "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
           "loss_scale": None if scaler is None else float(scaler.scale),
           "weights": {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
           if engine.dp_world_size == 1 or cfg["zero_optimization"]["stage"] < 3 else None}
    out["losses"] = train(engine, int(engine.global_steps), num_steps) if num_steps else []
    return out


def error_case(cfg: dict, load_dir: str) -> str:
    engine = build(cfg)
    try:
        engine.load_checkpoint(load_dir)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return "no error"


class Wrapped(torch.nn.Module):
    """The fixture model one level down: every parameter name gains a ``net.`` prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model(99)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(x, y)


def resume_many(items: list[tuple[str, dict, int, dict]]) -> list[dict]:
    """``resume_case`` for several (fixture, config, steps, load options) in one set of processes."""
    return [resume_case(cfg, os.path.join(FIXTURES, case, "ckpt"), steps, groups=case.endswith("_groups"), **opts)
            for case, cfg, steps, opts in items]


def mismatch_case(cfg: dict, load_dir: str) -> str:
    import zerospeed

    model = Wrapped()
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    try:
        engine.load_checkpoint(load_dir)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return "no error"


def resave_case(cfg: dict, load_dir: str, save_dir: str, num_steps: int = 0) -> list[float]:
    """Load a DeepSpeed folder, train ``num_steps``, save a zerospeed checkpoint; the losses trained."""
    engine = build(cfg)
    engine.load_checkpoint(load_dir)
    losses = train(engine, int(engine.global_steps), num_steps) if num_steps else []
    engine.save_checkpoint(save_dir, client_state={"epoch": 2})
    return losses


# -- pipeline-parallel and tensor-parallel DeepSpeed folders (make_parallel_fixtures.py) -----------------------------
def _pipe_losses(engine, first: int, num: int, pipeline: bool) -> list[float]:
    """``num`` steps from ``first`` on this rank's replica of the global batch, as DeepSpeed's train_batch
    reports them (the mean over micro-batches and replicas)."""
    from tiny_model import PIPE_MICRO_BATCHES, batch, mse

    rank, world = engine.dp_rank, engine.dp_world_size
    losses = []
    for step in range(first, first + num):
        x, y = batch(step)
        xs_all, ys_all = x.chunk(world)[rank], y.chunk(world)[rank]
        micro = list(zip(xs_all.chunk(PIPE_MICRO_BATCHES), ys_all.chunk(PIPE_MICRO_BATCHES)))
        if pipeline:
            losses.append(float(engine.train_batch(iter(micro))))
            continue
        total = torch.zeros(())
        for xs, ys in micro:
            loss = mse(engine(xs), ys)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / len(micro)
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def pipe_resume(cfg: dict, load_dir: str, num_stages: int, num_steps: int, kind: str = "plain") -> dict:
    """A zerospeed PipelineModule of ``num_stages`` stages (0: an nn.Sequential of the same layers in the plain
    engine) loads a DeepSpeed pipeline folder and trains on. ``kind``: the layers, tiny_model's
    make_pipe_layers ("plain"), make_tied_pipe_layers ("tied") or make_pipe_tp_layers ("tp": the full layers a
    pipeline x tensor-parallel run trained slices of)."""
    import zerospeed
    from tiny_model import make_pipe_layers, make_pipe_tp_layers, make_tied_pipe_layers, mse

    plain = make_pipe_tp_layers if kind == "tp" else make_pipe_layers
    if num_stages:
        from zerospeed.pipe import PipelineModule, TiedLayerSpec

        layers = make_tied_pipe_layers(TiedLayerSpec, 99) if kind == "tied" else plain(99)
        model = PipelineModule(layers, num_stages=num_stages, loss_fn=mse, partition_method="uniform")
    else:
        model = torch.nn.Sequential(*plain(99))
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    path, client = engine.load_checkpoint(load_dir)
    out = {"path": path, "client": {k: client[k] for k in ("epoch", "note", "best")},
           "client_weights": client["weights"].tolist(), "state": shard_state(engine),
           "global_steps": engine.global_steps, "global_samples": engine.global_samples,
           "lr_scheduler": engine.lr_scheduler.state_dict()}
    out["losses"] = _pipe_losses(engine, int(engine.global_steps), num_steps, bool(num_stages))
    return out


def tp_resume(cfg: dict, load_dir: str, num_steps: int) -> dict:
    """TPNet (tensor-parallel when ``cfg`` says so) loads a DeepSpeed tensor-parallel folder and trains on;
    ``state``: this rank's pieces in its own (tp-local) coordinates, ``tp_rank`` which slice it holds."""
    import zerospeed
    from zerospeed import comm
    from tiny_model import batch, make_tp_model

    model = make_tp_model(99)
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    path, client = engine.load_checkpoint(load_dir)
    mesh = comm.get_mesh() if "tensor_parallel" in cfg else None
    out = {"path": path, "client": {k: client[k] for k in ("epoch", "note", "best")}, "state": shard_state(engine),
           "tp_rank": mesh.tp_rank if mesh is not None else 0, "global_steps": engine.global_steps,
           "global_samples": engine.global_samples, "lr_scheduler": engine.lr_scheduler.state_dict()}
    rank, world = engine.dp_rank, engine.dp_world_size
    losses = []
    for step in range(int(engine.global_steps), int(engine.global_steps) + num_steps):
        x, y = batch(step)
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        if world > 1:
            dist.all_reduce(total, group=engine.dp_group)
        losses.append(total.item() / world)
    out["losses"] = losses
    if mesh is not None:
        comm.reset_mesh()
    return out


def fsdp2_load_dcp(dcp_dir: str) -> dict:
    """The fixture model under PyTorch's FSDP2 (fully_shard over this world) loads a DCP folder with
    torch.distributed.checkpoint.load into its sharded state dict; returns the full tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model(3)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=dcp_dir)
    model.load_state_dict(sd)
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}
