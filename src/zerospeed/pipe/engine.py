"""``PipelineEngine``: what ``zerospeed.initialize(model=PipelineModule(...))`` returns.

DeepSpeed's API: ``engine.train_batch(data_iter)`` runs one optimizer step over
``gradient_accumulation_steps`` micro-batches and returns the mean loss (averaged over micro-batches
and data-parallel replicas, the same value on every rank); ``engine.eval_batch(data_iter,
return_logits=False, compute_loss=True, reduce_output="avg", bcast_loss=True)`` runs the forward
only. ``data_iter`` yields ``(inputs, labels)`` micro-batches; only the first stage (inputs) and the
last stage (labels) read it, so other ranks may pass None.

Decisions:

* **Topology** comes from the ``PipelineModule`` (``num_stages`` pipeline ranks x
  ``world / num_stages`` data-parallel replicas, DeepSpeed's rank layout ``rank = stage * dp +
  dp_rank``); ``pipeline.stages`` in the config, when not ``"auto"``, must agree with it.
* **Schedules** are data (``pipeline.schedule``: ``gpipe``, ``1f1b`` (default, DeepSpeed's),
  ``interleaved_1f1b``, ``zero_bubble``); one executor (:mod:`zerospeed.pipe.runtime`) runs this
  rank's action list. A forward-only list for ``eval_batch`` is generated the same way.
* **Virtual stages** (``pipeline.virtual_stages = v`` with ``interleaved_1f1b``): the user builds
  the ``PipelineModule`` for ``p`` pipeline ranks as with DeepSpeed; the engine re-partitions the
  same layer list into ``p * v`` stages and builds one ``PipelineModule`` *chunk* per local virtual
  stage (stage ``s`` on pipeline rank ``s % p``), with the module's own settings (seeding,
  partition method, checkpointing). The module passed in is then not trained (its layers are not
  used); ``engine.module`` is an ``nn.ModuleList`` of the chunks and ``engine.stage_modules`` maps
  virtual stage -> chunk. With ``v == 1`` ``engine.module`` is the module passed in.
* **Data parallelism / ZeRO**: each rank's stage parameters go to one ZeRO strategy over its
  stage's data-parallel group; stages 0 and 1 only (as DeepSpeed: ZeRO-2/3 partition gradients
  per micro-step, which conflicts with pipelining). Gradients accumulate during the schedule and
  are reduced once after it, after tied weights were summed (see ``runtime_tied``).
* **Gradient norm / clipping** is global: the ZeRO strategy's norm hook adds every stage's share
  over the pipeline group, counting tied parameters once.
* **Start-up handshake** (``runtime_probe``): the first ``train_batch``/``eval_batch`` probes one
  micro-batch through the pipeline so shape errors, bad outputs, missing data iterators or a
  failing loss function raise the same :class:`PipelineSetupError` on every rank, never a hang.
* ``pipeline.activation_checkpoint_interval`` > 0 overrides the module's interval.

Files: set-up in ``runtime_setup`` (layout, schedules, stage modules, groups), the action executor
in ``runtime`` (with ``runtime_backward`` for the split backward and ``p2p`` for transfers), tied
weights in ``runtime_tied``, the start-up handshake in ``runtime_probe``; this module wires them.

Layering note: this module reuses the single-model engine (``zerospeed.runtime``) for the ZeRO
strategy, loss scaling and step accounting, as DeepSpeed's ``PipelineEngine`` subclasses its
``DeepSpeedEngine``.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from zerospeed import comm
from zerospeed.config import ConfigError, ZeroSpeedConfig
from zerospeed.pipe.module import PipelineModule
from zerospeed.pipe.p2p import P2P
from zerospeed.pipe.runtime import MicroBatchSource, PipelineExecutor
from zerospeed.pipe.runtime_probe import PipelineSetupError, handshake
from zerospeed.pipe.runtime_setup import (
    Layout,
    agree_on_build,
    broadcast_replicas,
    build_chunks,
    check_topology,
    forward_schedule,
    check_pipeline_config,
    train_schedule,
)
from zerospeed.pipe.runtime_tied import TiedWeights, reduced_sq_norm
from zerospeed.pipe.schedule_action import Action
from zerospeed.runtime.engine import ZeroSpeedEngine

__all__ = ["PipelineEngine", "PipelineError", "PipelineSetupError", "initialize_pipeline"]

logger = logging.getLogger("zerospeed")


class PipelineError(RuntimeError):
    """A call the pipeline engine does not support (e.g. ``engine(x)`` instead of ``train_batch``)."""


def initialize_pipeline(model: PipelineModule, config: ZeroSpeedConfig, *, optimizer: Any = None,
                        model_parameters: Iterable[Any] | None = None, training_data: Any = None,
                        lr_scheduler: Any = None, collate_fn: Callable[..., Any] | None = None,
                        mesh: Any = None, tp_config: Any = None
                        ) -> tuple[PipelineEngine, torch.optim.Optimizer, Any, Any]:
    """Build the pipeline engine; returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``config`` is the call's parsed config (``zerospeed.initialize`` reads the user's once and resolves it for
    this pipeline's data-parallel degree); ``tp_config`` defaults to its ``tensor_parallel`` section.
    With a (pp, dp, tp) ``mesh`` (tensor parallelism, :mod:`zerospeed.runtime.tp_setup`) the
    topology's "data" coordinate is the flattened (dp, tp) pair, so stages talk to the same tp rank;
    each stage is split with AutoTP, and ZeRO, replica broadcast, loss mean and loader use the
    mesh's dp group.
    """
    from zerospeed.runtime.dataloader import build_dataloader
    from zerospeed.runtime.builders import NoOptimizer, optimizer_from_config, param_groups_of, scheduler_from_config

    if not isinstance(config, ZeroSpeedConfig):
        raise TypeError(f"initialize_pipeline: config must be a parsed ZeroSpeedConfig (zerospeed.initialize reads "
                        f"the user's), got {type(config).__name__}")
    tp_config = config.tensor_parallel if tp_config is None else tp_config
    world_size, rank = comm.get_world_size(), comm.get_rank()
    check_topology(model, world_size)
    cfg = check_pipeline_config(model, config)
    layout = Layout(model, cfg, rank)
    actions = train_schedule(layout)
    if layout.virtual > 1 and isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError("optimizer: with pipeline.virtual_stages > 1 the engine builds new stage modules; pass "
                         "the optimizer in the config or as a callable taking parameter groups")
    chunks = agree_on_build(lambda: build_chunks(model, layout, cfg))
    container: nn.Module = model if layout.virtual == 1 else nn.ModuleList([chunks[s] for s in layout.local_stages])
    device = comm.device_for_backend()
    container.to(device)

    if mesh is not None:
        from zerospeed.runtime.tp_setup import prepare_model

        # a stage whose layers the split refuses must fail on every rank, not leave its peers waiting
        container = agree_on_build(lambda: prepare_model(container, mesh, tp_config, optimizer))
    # the groups are the mesh's: the one initialize built (tensor parallelism), else this pipeline's own
    # (pp, dp) grid, built here and not made current; an mpu's mesh gives the dp group, the grid the pipe groups
    grid = mesh if mesh is not None and mesh.topology is not None else comm.build_mesh(pp=layout.num_pp,
                                                                                       current=False)
    pipe_group = grid.pp_group
    data_group = mesh.dp_group if mesh is not None else grid.dp_group
    tied = TiedWeights(chunks, model.tied_stages if layout.virtual == 1 else chunks[layout.pipe_rank].tied_stages,
                       num_pp=layout.num_pp, num_dp=layout.num_dp, pipe_rank=layout.pipe_rank,
                       dp_rank=layout.dp_rank, global_rank=layout.global_rank, mesh=grid)
    tied.broadcast_initial()
    if mesh is not None:
        if mesh.dp_size > 1:
            broadcast_replicas(container, data_group, src=mesh.group_ranks("data")[0])
    elif layout.num_dp > 1:
        broadcast_replicas(container, data_group, src=layout.global_rank(layout.pipe_rank, 0))

    if layout.virtual == 1:
        groups = param_groups_of(container, model_parameters)
    else:
        if model_parameters is not None:
            logger.warning("zerospeed: model_parameters is ignored with virtual stages: the engine builds the "
                           "stage chunks and optimizes all their trainable parameters")
        groups = param_groups_of(container, None)
    opt = optimizer_from_config(cfg, optimizer, groups, container)  # names for Muon's tagging
    if isinstance(opt, NoOptimizer):  # the forward-only engine (issue #27) is built for a plain module only
        raise ConfigError("optimizer", "no optimizer: the pipeline engine trains; set 'optimizer' in the config or "
                          "pass initialize(optimizer=...)")
    engine = PipelineEngine(container, chunks, cfg, opt, layout=layout, actions=actions, tied=tied,
                            pipe_group=pipe_group, data_group=data_group, loss_fn=model.loss_fn,
                            dynamic_shape=model.dynamic_shape)
    engine.lr_scheduler = scheduler_from_config(cfg, lr_scheduler, opt)
    if mesh is not None and mesh.tp_size > 1:
        from zerospeed.runtime.tp_setup import PipelineTPCheckpoints, TPNormHook

        engine.tp_norm_hook = TPNormHook(engine, mesh)
        engine.checkpoint_layout = PipelineTPCheckpoints()
    loader = None
    if training_data is not None:
        # not shuffled: DeepSpeed's pipeline engine builds its loader with shuffle=False
        # (PipelineEngine._build_data_iter), so train_batch() without an iterator sees the same order
        dp_rank, num_dp = (layout.dp_rank, layout.num_dp) if mesh is None else (mesh.dp_rank, mesh.dp_size)
        loader = build_dataloader(training_data, cfg.train_micro_batch_size_per_gpu, dp_rank, num_dp,
                                  collate_fn=collate_fn, drop_last=cfg.dataloader_drop_last, seed=cfg.seed or 0,
                                  shuffle=False)
        engine.training_dataloader = loader
    return engine, opt, loader, engine.lr_scheduler


def _repeat(loader: Any) -> Iterator[Any]:
    """DeepSpeed's RepeatingLoader: restart the loader (next epoch) when it runs out."""
    epoch = 0
    while True:
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


# ---------------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------------
class PipelineEngine(ZeroSpeedEngine):
    """Pipeline-parallel training of one rank's stage(s); see the module docstring."""

    def __init__(self, container: nn.Module, chunks: dict[int, PipelineModule], config: ZeroSpeedConfig,
                 optimizer: torch.optim.Optimizer, *, layout: Layout, actions: list[Action], tied: TiedWeights,
                 pipe_group: dist.ProcessGroup, data_group: dist.ProcessGroup,
                 loss_fn: Callable[..., Any] | None, dynamic_shape: bool) -> None:
        super().__init__(container, config, optimizer, dp_group=data_group)
        self.stage_modules = chunks
        self.layout = layout
        self.num_stages = layout.num_pp
        self.stage_id = layout.pipe_rank
        self.micro_batches = layout.num_microbatches
        self.pipe_group = pipe_group
        self.tied = tied
        self.train_actions = actions
        self._eval_actions: dict[int, list[Action]] = {}
        self.training_dataloader: Any = None
        self._data_iter: Iterator[Any] | None = None
        self.device = comm.device_for_backend()
        self.executor = PipelineExecutor(
            chunks, layout.num_stages, layout.rank_of_stage, loss_fn, P2P(self.device),
            begin_backward=lambda: self.strategy.begin_backward(False), end_backward=self.strategy.end_backward,
            dynamic_shape=dynamic_shape)
        self._probed_loss: bool | None = None  # None: no handshake yet; else whether it checked the loss
        self.agg_train_loss: torch.Tensor | None = None
        self.tp_norm_hook: Callable[[torch.Tensor], torch.Tensor] | None = None  # set under tensor parallelism
        self.last_step_time_s = 0.0

    # -- DeepSpeed-compatible queries ---------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    @property
    def is_pipe_parallel(self) -> bool:
        return self.num_stages > 1

    @property
    def is_data_parallel(self) -> bool:
        return self.layout.num_dp > 1

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        raise RuntimeError("engine.set_gradient_accumulation_boundary: the pipeline engine's accumulation window "
                           "is one train_batch() of gradient_accumulation_steps micro-batches; it takes none")

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        self._data_iter = iterator

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("the pipeline engine runs whole batches: use engine.train_batch(data_iter) or "
                            "engine.eval_batch(data_iter), not engine(...)")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("the pipeline engine runs backward inside train_batch(); do not call backward()")

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise PipelineError("the pipeline engine steps inside train_batch(); do not call step()")

    # -- training -------------------------------------------------------------------------------
    def _iterator(self, data_iter: Iterator[Any] | None) -> Iterator[Any] | None:
        if data_iter is not None:
            return data_iter if hasattr(data_iter, "__next__") else iter(data_iter)
        if self._data_iter is None and self.training_dataloader is not None:
            self._data_iter = _repeat(self.training_dataloader)
        return self._data_iter

    def _source(self, data_iter: Iterator[Any] | None, needs_labels: bool) -> MicroBatchSource:
        stages = self.executor.chunks
        return MicroBatchSource(data_iter, needs_inputs=0 in stages,
                                needs_labels=needs_labels and self.layout.num_stages - 1 in stages,
                                dtype=self.compute_dtype, device=self.device)

    def _ensure_handshake(self, source: MicroBatchSource, needs_loss: bool) -> None:
        if self._probed_loss is None or (needs_loss and not self._probed_loss):
            handshake(self.executor, source, rank=comm.get_rank(), needs_loss=needs_loss, device=self.device)
            self._probed_loss = needs_loss

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; returns the mean loss."""
        if not torch.is_grad_enabled():
            raise PipelineError("train_batch() needs gradients enabled (called under torch.no_grad()?); "
                                "use eval_batch() for inference")
        t0 = time.perf_counter()
        self.module.train()
        source = self._source(self._iterator(data_iter), needs_labels=True)
        self._ensure_handshake(source, needs_loss=True)
        losses, _ = self.executor.run(self.train_actions, source, self.micro_batches, train=True,
                                      loss_scale=self.loss_scaler.scale)
        self._reduce_and_step()
        self.agg_train_loss = self._mean_loss(losses, broadcast=True)
        self.last_step_time_s = time.perf_counter() - t0
        self._step_events.on_backward(self.agg_train_loss)  # monitors: the step's loss, lr, norm, memory
        self._step_events.on_step(self)
        return self.agg_train_loss

    def _reduce_and_step(self) -> None:
        t0 = time.perf_counter()
        self.tied.reduce_grads()
        self.strategy.begin_backward(True)  # an empty boundary micro-step: reduce every bucket now
        self.strategy.end_backward()
        result = self.strategy.step(self.loss_scaler.scale, self.config.gradient_clipping,
                                    norm_sq_hook=self._global_norm_sq)
        self._grad_norm = result.grad_norm
        self.loss_scaler.update(result.overflow)
        if result.overflow:
            self.skipped_steps += 1
            if self.dp_rank == 0 and self.stage_id == 0:
                logger.warning("zerospeed: step %d skipped: non-finite gradients (loss scale now %g)",
                               self.global_steps + 1, self.loss_scaler.scale)
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.strategy.zero_grad()
        if self.compression_scheduler is not None:
            self.compression_scheduler.step(self.dp_group)
        self.global_steps += 1
        self.global_samples += self.config.train_batch_size
        self.micro_steps += self.micro_batches
        self._account_comms()
        self._report()
        self._timers["step"] += time.perf_counter() - t0

    def _global_norm_sq(self, norm_sq: torch.Tensor) -> torch.Tensor:
        """Data-parallel squared norm of this stage -> global over the pipeline (tied counted once)."""
        if self.tp_norm_hook is not None:  # first the stage's norm over its tp shards
            norm_sq = self.tp_norm_hook(norm_sq)
        twice = self.tied.counted_twice()
        if twice:
            correction = reduced_sq_norm(self.strategy.buckets, twice).to(norm_sq.device)
            if self.zero_stage >= 1:  # each replica holds a shard of the reduced gradient
                comm.all_reduce(correction, group=self.dp_group)
            norm_sq = norm_sq - correction
        norm_sq = norm_sq.clone()
        comm.all_reduce(norm_sq, group=self.pipe_group)
        return norm_sq

    def _mean_loss(self, losses: list[torch.Tensor], broadcast: bool) -> torch.Tensor:
        """Mean over micro-batches and data-parallel replicas, from the last stage to the pipeline."""
        value = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.is_last_stage():
            value = torch.stack(losses).mean()
            if self.dp_world_size > 1:
                comm.all_reduce(value, group=self.dp_group)
                value /= self.dp_world_size
        if broadcast and self.num_stages > 1:
            comm.broadcast(value, src=self.layout.global_rank(self.num_stages - 1), group=self.pipe_group)
        return value

    # -- evaluation -----------------------------------------------------------------------------
    def eval_batch(self, data_iter: Iterator[Any] | None, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> Any:
        """Forward ``num_micro_batches`` (default: gradient_accumulation_steps) micro-batches.

        Returns the mean loss (``reduce_output="avg"``, averaged over data-parallel replicas, on every
        rank when ``bcast_loss``) or the per-micro-batch losses (``reduce_output=None``, last stage).
        With ``compute_loss=False`` the last stage's outputs are returned instead (averaged over
        micro-batches for ``"avg"``). ``return_logits=True`` also returns the last stage's outputs
        concatenated over micro-batches: ``(result, logits)`` (``logits`` None on other stages).
        """
        if reduce_output not in ("avg", None):
            raise ValueError(f"reduce_output: must be 'avg' or None, got {reduce_output!r}")
        num = self.micro_batches if num_micro_batches is None else int(num_micro_batches)
        if num < 1:
            raise ValueError(f"num_micro_batches: must be >= 1, got {num_micro_batches!r}")
        if num not in self._eval_actions:
            self._eval_actions[num] = forward_schedule(self.layout, num)
        was_training = self.module.training
        source = self._source(self._iterator(data_iter), needs_labels=compute_loss)
        self._ensure_handshake(source, needs_loss=compute_loss)
        self.module.eval()
        try:
            with torch.no_grad():
                losses, outputs = self.executor.run(self._eval_actions[num], source, num, train=False,
                                                    compute_loss=compute_loss)
        finally:
            self.module.train(was_training)
        if compute_loss:
            if reduce_output == "avg":
                result: Any = self._mean_loss(losses, broadcast=bcast_loss)
                if not bcast_loss and not self.is_last_stage():
                    result = None
            else:
                result = losses if self.is_last_stage() else None
        else:
            result = None
            if self.is_last_stage():
                result = _mean_outputs(outputs) if reduce_output == "avg" else outputs
        if return_logits:
            logits = _concat(outputs) if self.is_last_stage() else None
            return result, logits
        return result

    # -- measurements (benchmarks) --------------------------------------------------------------
    def enable_profiling(self, trace: bool = True, memory: bool = True) -> None:
        """Record each action's time and the activation memory (for ``bench/pipeline_bench.py``)."""
        self.executor.trace_enabled = trace
        self.executor.measure_memory = memory

    def last_step_profile(self) -> dict[str, Any]:
        """Timing of the last ``train_batch`` on this rank: schedule time, compute time, bubble."""
        trace = self.executor.trace
        if not trace:
            return {}
        start, end = trace[0].start, trace[-1].end
        compute = sum(t.end - t.start for t in trace if t.action.kind.is_compute)
        span = end - start
        return {"schedule_time_s": span, "compute_time_s": compute,
                "bubble_fraction": (span - compute) / span if span > 0 else 0.0,
                "step_time_s": self.last_step_time_s,
                "peak_activation_bytes": self.executor.peak_activation_bytes,
                "per_kind_s": _per_kind(trace)}


def _per_kind(trace: list) -> dict[str, float]:
    out: dict[str, float] = {}
    for t in trace:
        out[t.action.kind.name] = out.get(t.action.kind.name, 0.0) + (t.end - t.start)
    return out


def _concat(outputs: list[Any]) -> Any:
    if outputs and all(torch.is_tensor(o) for o in outputs):
        return torch.cat(outputs)
    return outputs


def _mean_outputs(outputs: list[Any]) -> Any:
    if outputs and all(torch.is_tensor(o) and o.shape == outputs[0].shape for o in outputs):
        return torch.stack([o.float() for o in outputs]).mean(0)
    return outputs
