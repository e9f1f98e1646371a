"""Set-up of the pipeline engine: who is where, the schedules, the stage modules (the process groups are the mesh's).

Everything here runs once in ``initialize_pipeline`` (``zerospeed.pipe.engine``), in the same
order on every rank, and raises before any process group is created when the configuration
cannot work (each such check depends only on data every rank has, so every rank raises). The one
rank-local step, building this rank's stage modules, goes through :func:`agree_on_build`, which
turns a failure on any rank into the same error on all of them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerospeed import comm
from zerospeed.config import ConfigError, ZeroSpeedConfig
from zerospeed.pipe.module import PipelineModule
from zerospeed.pipe.runtime_probe import PipelineSetupError
from zerospeed.pipe.schedule_action import Action, ActionKind
from zerospeed.pipe.schedule_comm import insert_communication
from zerospeed.pipe.schedules import build_schedule

__all__ = ["Layout", "agree_on_build", "broadcast_replicas", "build_chunks", "check_pipeline_config", "check_topology",
           "forward_schedule", "train_schedule"]

class Layout:
    """Who is where: pipeline ranks, data-parallel replicas, virtual stages."""

    def __init__(self, model: PipelineModule, cfg: ZeroSpeedConfig, rank: int) -> None:
        topo = model.topology()
        self.topo = topo
        self.num_pp = topo.get_dim("pipe")
        self.num_dp = topo.get_dim("data")
        self.pipe_rank = int(topo.get_coord(rank).pipe)
        self.dp_rank = int(topo.get_coord(rank).data)
        self.virtual = cfg.pipeline.virtual_stages
        self.num_stages = self.num_pp * self.virtual
        self.num_microbatches = cfg.gradient_accumulation_steps
        self.schedule = cfg.pipeline.schedule
        self.local_stages = [c * self.num_pp + self.pipe_rank for c in range(self.virtual)]

    def global_rank(self, pipe_rank: int, dp_rank: int | None = None) -> int:
        return int(self.topo.get_rank(pipe=pipe_rank, data=self.dp_rank if dp_rank is None else dp_rank))

    def rank_of_stage(self, stage: int) -> int:
        return self.global_rank(stage % self.num_pp)


def check_topology(model: PipelineModule, world_size: int) -> None:
    topo = model.topology()
    if topo.get_axis_names() != ["pipe", "data"]:
        raise ValueError(f"PipelineModule topology: the pipeline engine supports the axes ['pipe', 'data'], "
                         f"got {topo.get_axis_names()}")
    if topo.world_size() != world_size:
        raise ValueError(f"PipelineModule topology: {topo} has {topo.world_size()} ranks but the world size is "
                         f"{world_size} (was the module built before torch.distributed was initialized? call "
                         "zerospeed.init_distributed() first)")
    if model.num_stages != topo.get_dim("pipe"):
        raise ValueError(f"PipelineModule num_stages: {model.num_stages} stages on {topo.get_dim('pipe')} pipeline "
                         "ranks; build the module with one stage per pipeline rank and set "
                         "pipeline.virtual_stages in the config for interleaving")


def check_pipeline_config(model: PipelineModule, cfg: ZeroSpeedConfig) -> ZeroSpeedConfig:
    """The parsed config's pipeline rules against the module: ``pipeline.stages``, the ZeRO stage, virtual stages."""
    num_pp = model.topology().get_dim("pipe")
    stages = cfg.pipeline.stages
    if stages != "auto" and stages != num_pp:
        raise ConfigError("pipeline.stages", f"{stages} does not match the PipelineModule's {num_pp} stages")
    if cfg.zero_optimization.stage not in (0, 1):
        raise ConfigError("zero_optimization.stage", f"stage {cfg.zero_optimization.stage} cannot be combined with "
                          "pipeline parallelism (it partitions gradients every micro-step); use 0 or 1")
    if cfg.pipeline.schedule != "interleaved_1f1b" and cfg.pipeline.virtual_stages != 1:
        raise ConfigError("pipeline.virtual_stages", f"{cfg.pipeline.virtual_stages} needs schedule "
                          f"'interleaved_1f1b' (schedule is {cfg.pipeline.schedule!r})")
    return cfg


def train_schedule(layout: Layout) -> list[Action]:
    try:
        schedule = build_schedule(layout.schedule, num_stages=layout.num_stages,
                                  num_microbatches=layout.num_microbatches, num_ranks=layout.num_pp,
                                  virtual_stages_per_rank=layout.virtual)
    except ValueError as exc:
        raise ConfigError("gradient_accumulation_steps", f"{layout.num_microbatches} micro-batches cannot run "
                          f"schedule {layout.schedule!r} on {layout.num_pp} pipeline ranks: {exc}") from None
    return schedule[layout.pipe_rank]


def forward_schedule(layout: Layout, num_microbatches: int) -> list[Action]:
    """Forward-only actions (eval): each rank's stages micro-batch by micro-batch, sends placed by
    the same rule as training schedules."""
    orders = {r: [Action(ActionKind.FORWARD, c * layout.num_pp + r, mb)
                  for mb in range(num_microbatches) for c in range(layout.virtual)]
              for r in range(layout.num_pp)}
    return insert_communication(orders)[layout.pipe_rank]


def build_chunks(model: PipelineModule, layout: Layout, cfg: ZeroSpeedConfig) -> dict[int, PipelineModule]:
    if model.stage_id != layout.pipe_rank:
        raise ValueError(f"PipelineModule stage_id: {model.stage_id} on a rank of pipeline stage {layout.pipe_rank}")
    if layout.virtual == 1:
        chunks = {layout.pipe_rank: model}
    else:
        specs = model._layer_specs
        if layout.num_stages > len(specs):
            raise ValueError(f"pipeline.virtual_stages: {layout.num_pp} ranks x {layout.virtual} virtual stages = "
                             f"{layout.num_stages} stages, more than the {len(specs)} layers")
        method = getattr(model, "partition_method", cfg.pipeline.partition)
        chunks = {}
        for stage in layout.local_stages:
            chunks[stage] = PipelineModule(
                specs, num_stages=layout.num_stages, topology=model.topology(), loss_fn=model.loss_fn,
                seed_layers=model.seed_layers, seed_fn=model.seed_fn, base_seed=model.base_seed,
                partition_method=method, activation_checkpoint_interval=model.activation_checkpoint_interval,
                activation_checkpoint_func=model.activation_checkpoint_func,
                checkpointable_layers=model.checkpointable_layers, dynamic_shape=model.dynamic_shape,
                stage_id=stage)
    interval = cfg.pipeline.activation_checkpoint_interval
    for chunk in chunks.values():
        if interval > 0:
            chunk.activation_checkpoint_interval = interval
        if not any(p.requires_grad for p in chunk.parameters()):
            raise ValueError(f"pipeline stage {chunk.stage_id} (layers {chunk.local_layer_indices}) has no trainable "
                             "parameters; use partition_method='parameters' or fewer stages")
    return chunks


def agree_on_build(build: Callable[[], dict[int, PipelineModule]]) -> dict[int, PipelineModule]:
    """Build this rank's chunks; if any rank fails, every rank raises the first failure (a rank
    raising alone would leave the others waiting in the process-group creation that follows)."""
    error: str | None = None
    chunks: dict[int, PipelineModule] = {}
    try:
        chunks = build()
    except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
        error = f"{type(exc).__name__}: {exc}"
    failures = [(rank, e) for rank, e in enumerate(comm.all_gather_object(error)) if e is not None]
    if failures:
        rank, message = failures[0]
        raise PipelineSetupError(f"building the pipeline stages failed on rank {rank}: {message}")
    return chunks


@torch.no_grad()
def broadcast_replicas(module: nn.Module, data_group: dist.ProcessGroup, src: int) -> None:
    """Data-parallel replicas start from replica 0's parameters and buffers (as DeepSpeed does)."""
    tensors = [t for t in list(module.parameters()) + list(module.buffers())]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        comm.broadcast(flat, src=src, group=data_group)
        pos = 0
        for t in group:
            t.copy_(flat[pos:pos + t.numel()].view_as(t))
            pos += t.numel()
