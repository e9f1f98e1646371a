"""The training engine returned by :func:`zerospeed.initialize` (DeepSpeed's engine API).

Responsibilities, and only these: mixed-precision casting of the module, loss scaling in
``backward``, the accumulation boundary, the step (delegated to the ZeRO strategy, then the loss
scaler and the lr scheduler) and step accounting / reporting. Sharding lives in
:mod:`zerospeed.zero`; configuration arrives parsed (:class:`zerospeed.config.ZeroSpeedConfig`).

DeepSpeed semantics kept: ``engine.step()`` is called after every micro-batch and only updates at
the accumulation boundary; ``backward`` divides the loss by ``gradient_accumulation_steps``; an
overflowing fp16 step is skipped on every rank, counts in ``global_steps`` and ``skipped_steps``,
and does not advance the lr scheduler.

Decisions beyond DeepSpeed: floating-point tensor inputs to ``forward`` are cast to the compute
dtype under bf16/fp16, so a float batch works unchanged; a non-finite gradient norm skips the step
in every precision (a weight never receives a nan), not only under fp16.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerospeed import comm
from zerospeed.compression.scheduler import compression_scheduler_for
from zerospeed.config import ConfigError, ZeroSpeedConfig
from zerospeed.monitor import Monitor, StepEvents
from zerospeed.profiling.engine_hook import EngineFlopsProfiler
from zerospeed.runtime.builders import NO_OPTIMIZER, NoOptimizer
from zerospeed.runtime.engine_api import DeepSpeedEngineAPI
from zerospeed.runtime.fast_paths import quiet_choices, settle_adam_kernel, startup_line
from zerospeed.utils.logging import log_dist
from zerospeed.checkpointing.settings import configure_from as configure_checkpointing_from
from zerospeed.runtime.loss_scaler import build_loss_scaler
from zerospeed.runtime.precision_cast import cast_to_compute_dtype
from zerospeed.runtime.precision_options import (DTYPES, autocast_context, autocast_settings, check_unbuilt_values,
                                                 grad_accum_dtype, master_dtype)
from zerospeed.runtime.torch_backward import TorchBackwardHooks
from zerospeed.zero.factory import BUILT_STAGES, build_strategy
from zerospeed.zero.offload import check_offload
from zerospeed.zero.strategy import StageOptions
from zerospeed.zero.partitioned_optimizer import ELEMENTWISE_OPTIMIZERS

logger = logging.getLogger("zerospeed")

SUPPORTED_ZERO_STAGES = BUILT_STAGES


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


def _with_expert_groups(options: StageOptions, model: nn.Module) -> StageOptions:
    """Mixture-of-experts models: expert gradients are reduced (and, from stage 1, expert parameters
    sharded) over their expert-data-parallel group."""
    from dataclasses import replace

    from zerospeed.moe.groups import model_has_experts, rank_independent_names, reduction_group_of

    if not model_has_experts(model):
        return options
    return replace(options, group_of_param=reduction_group_of, unit_name=rank_independent_names(model))


def _enabled(section: Any) -> Any:
    return section if section is not None and section.enabled else None


class ZeroSpeedEngine(DeepSpeedEngineAPI, nn.Module):
    def __init__(self, model: nn.Module, config: ZeroSpeedConfig, optimizer: torch.optim.Optimizer,
                 lr_scheduler: Any = None, dp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        stage = config.zero_optimization.stage
        if stage not in SUPPORTED_ZERO_STAGES:
            raise ConfigError("zero_optimization.stage", f"stage {stage} is not built in this version of zerospeed "
                              f"(built: {', '.join(map(str, SUPPORTED_ZERO_STAGES))})")
        if stage >= 1 and any(g["params"] for g in optimizer.param_groups):  # none held (NoOptimizer): no shard step
            name = type(optimizer).__name__
            whole_matrices = getattr(optimizer, "needs_whole_matrices", False)  # Muon: zero.muon_shards
            if name not in ELEMENTWISE_OPTIMIZERS and not whole_matrices and not config.zero_allow_untested_optimizer:
                raise ConfigError("zero_allow_untested_optimizer",
                                  f"ZeRO stage {stage} runs the optimizer on flat shards, which is exact only for "
                                  f"element-wise optimizers ({', '.join(ELEMENTWISE_OPTIMIZERS)}); {name} is not one. "
                                  "Use stage 0, or set zero_allow_untested_optimizer: true if it is element-wise")
        self.module = model
        self.config = config
        self._autocast = autocast_settings(config)  # validated before anything is built
        check_unbuilt_values(config)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dp_group = dp_group
        self.dp_world_size = comm.get_world_size(dp_group)
        self.dp_rank = comm.get_rank(dp_group)
        self.compute_dtype = DTYPES[config.precision]
        if self.compute_dtype != torch.float32:
            cast_to_compute_dtype(model, self.compute_dtype)  # parameters, not fp32 tables such as RoPE's
        comm_dtype = DTYPES[config.communication_data_type] if config.communication_data_type else None
        prescale = 1.0
        if config.prescale_gradients:
            prescale = 1.0 / (config.gradient_predivide_factor if config.gradient_predivide_factor != 1.0
                              else self.dp_world_size)
        zcfg = config.zero_optimization
        options = StageOptions(stage=stage, reduce_bucket_size=int(zcfg.reduce_bucket_size),
                               allgather_bucket_size=int(zcfg.allgather_bucket_size),
                               overlap_comm=bool(zcfg.overlap_comm), comm_dtype=comm_dtype, prescale=prescale,
                               offload_optimizer=_enabled(zcfg.offload_optimizer),
                               offload_param=_enabled(zcfg.offload_param), aio=config.aio,
                               sub_group_size=int(zcfg.sub_group_size), master_dtype=master_dtype(config),
                               grad_accum_dtype=grad_accum_dtype(config),
                               fast_paths=config.fast_paths)
        options = _with_expert_groups(options, model)
        check_offload(options, optimizer)
        with quiet_choices():  # the start-up line reports the choices made here
            self.strategy = build_strategy(model, optimizer, options, zcfg, dp_group, self.dp_rank,
                                           self.dp_world_size)
            self._settle_fast_paths(stage)
        self._report_fast_paths()
        self.loss_scaler = build_loss_scaler(config.precision, config.fp16)
        self.compression_scheduler = compression_scheduler_for(model, config)  # None without compression_training
        self.micro_steps = 0
        self._boundary_override: bool | None = None  # engine.set_gradient_accumulation_boundary's last value
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._grad_norm: float | None = None
        self._last_step_applied = False
        self._torch_backward = TorchBackwardHooks(self)  # loss.backward() support
        self._in_backward_window = False
        self._timers: dict[str, float] = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self.last_step_comms: dict[str, dict[str, int]] = {}
        self._comms_mark = comm.COUNTER.snapshot()
        self._comms_generation = comm.COUNTER.generation
        #: tensor parallelism (runtime/tp_setup.py): tp-aware global norm, first-forward batch check
        self.norm_sq_hook: Any = None
        self.batch_check: Any = None
        self.checkpoint_layout: Any = None  # full-tensor coordinates of tp shards (checkpoints, state dicts)
        self.monitor = Monitor(config)  # tensorboard / csv_monitor / wandb writers (rank 0)
        self._step_events = StepEvents(self.monitor, dp_group)
        self._flops_hook = EngineFlopsProfiler(config.flops_profiler, self)  # profiles step profile_step
        from zerospeed.runtime.autotuning_probe import AutotuningProbe

        self._autotuning = AutotuningProbe.attach(self)  # None unless run as an autotuning experiment
        configure_checkpointing_from(config)  # the activation_checkpointing section, unless configure() was called

    def _offload_tier(self) -> Any:
        return getattr(getattr(self.strategy, "state", None), "offload", None)

    def _settle_fast_paths(self, stage: int) -> None:
        """Settle the optimizer's Adam kernel (every data-parallel rank runs rank 0's choice; see
        :mod:`zerospeed.runtime.fast_paths`)."""
        exclude = {id(s.master) for s in getattr(self._offload_tier(), "slots", [])}
        settle_adam_kernel(self.optimizer, self.config.fast_paths, exclude=exclude, dp_group=self.dp_group,
                           replicated=True)

    def _report_fast_paths(self) -> None:
        """The one start-up line of the fast paths (rank 0)."""
        tier = self._offload_tier()
        handles = [h for h in (getattr(getattr(tier, "swapper", None), "handle", None),
                               getattr(getattr(self.strategy, "swapper", None), "handle", None)) if h is not None]
        log_dist(startup_line(self.config.fast_paths, self.optimizer, tier, handles), ranks=[0])

    def __getattr__(self, name: str) -> Any:
        """Unknown attributes come from the wrapped module (``engine.generate``, ``engine.device``...),
        as in DeepSpeed; the engine's own names (``config`` is the engine's configuration, as in
        DeepSpeed: the model's is ``engine.module.config``) win. Built on ``nn.Module.__getattr__``
        so the engine's own submodules, parameters and buffers resolve first."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            try:
                return getattr(module, name)
            except AttributeError:
                raise AttributeError(f"'{type(self).__name__}' object and its module "
                                     f"'{type(module).__name__}' have no attribute '{name}'") from None

    # -- DeepSpeed-compatible accessors -----------------------------------------------------------
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:  # set_gradient_accumulation_boundary: sticky, as in DeepSpeed
            return self._boundary_override
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """Unscaled global gradient norm of the last step, before clipping."""
        return self._grad_norm

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    @property
    def zero_stage(self) -> int:
        return self.config.zero_optimization.stage

    # -- the step ---------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        if self.compute_dtype != torch.float32:
            args, kwargs = _cast_floats(args, self.compute_dtype), _cast_floats(kwargs, self.compute_dtype)
        self._step_events.on_forward(args, kwargs)
        self._flops_hook.on_forward()
        if self.batch_check is not None:
            check, self.batch_check = self.batch_check, None
            check(args, kwargs)
        try:
            with autocast_context(*self._autocast, self.device.type):  # torch_autocast section
                call = self.__dict__.get("_zs_module_call") or self.module  # DeepCompile's compiled call
                out = self._torch_backward.attach(call(*args, **kwargs))
        except Exception as error:  # ZeRO-3: name a submodule parameter read without being gathered
            explain = getattr(self.strategy, "explain_forward_error", None)
            hint = explain(error) if explain is not None else None
            if hint is None:
                raise
            raise RuntimeError(hint) from error
        self._timers["forward"] += time.perf_counter() - t0
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError(f"engine.backward expects a scalar loss tensor, got "
                             f"{type(loss).__name__}{'' if not torch.is_tensor(loss) else tuple(loss.shape)}")
        if not loss.requires_grad:
            raise ValueError("engine.backward: the loss does not require grad (was it computed under torch.no_grad()?)")
        if isinstance(self.optimizer, NoOptimizer):
            raise RuntimeError(f"engine.backward: {NO_OPTIMIZER}")
        t0 = time.perf_counter()
        self._step_events.on_backward(loss)
        scale = self.loss_scaler.scale
        if scale_wrt_gas:
            scale /= self.config.gradient_accumulation_steps
        self.strategy.begin_backward(self._reduces_in_backward())
        self._torch_backward.engine_backward_active = True
        try:
            (loss.float() * scale).backward(retain_graph=retain_graph)
        except RuntimeError as error:  # ZeRO-3: name a parameter gathered around the forward, released before backward
            explain = getattr(self.strategy, "explain_backward_error", None)
            hint = explain(error) if explain is not None else None
            if hint is None:
                raise
            raise RuntimeError(hint) from error
        finally:
            self._torch_backward.engine_backward_active = False
            self.strategy.end_backward()
        self._timers["backward"] += time.perf_counter() - t0
        # DeepSpeed 0.19.8 returns the loss divided by gradient_accumulation_steps (when scale_wrt_gas)
        return loss / self.config.gradient_accumulation_steps if scale_wrt_gas else loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        if isinstance(self.optimizer, NoOptimizer):
            raise RuntimeError(f"engine.step: {NO_OPTIMIZER}")
        if self._in_no_sync:  # DeepSpeed's AssertionError and message
            raise AssertionError("It is illegal to call Engine.step() inside no_sync context manager")
        t0 = time.perf_counter()
        if self.is_gradient_accumulation_boundary():
            result = self.strategy.step(self.loss_scaler.scale, self.config.gradient_clipping,
                                        norm_sq_hook=self.norm_sq_hook)
            self._grad_norm = result.grad_norm
            self._last_step_applied = not result.overflow
            self.loss_scaler.update(result.overflow)
            if result.overflow:
                self.skipped_steps += 1
                if self.dp_rank == 0:
                    logger.warning("zerospeed: step %d skipped: non-finite gradients (loss scale now %g)",
                                   self.global_steps + 1, self.loss_scaler.scale)
            elif self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
            self.strategy.zero_grad()
            if self.compression_scheduler is not None:
                self.compression_scheduler.step(self.dp_group)
            self.global_steps += 1
            self.global_samples += self.config.train_batch_size
            self._flops_hook.on_step()
            self._step_events.on_step(self)
            self._account_comms()
            self._report()
            if self._autotuning is not None:
                self._autotuning.after_step()  # ends the process after end_profile_step
        self.micro_steps += 1
        self._timers["step"] += time.perf_counter() - t0

    def zero_grad(self) -> None:
        self.strategy.zero_grad()

    # -- accounting and reporting -----------------------------------------------------------------
    def _account_comms(self) -> None:
        now = comm.COUNTER.snapshot()
        if comm.COUNTER.generation != self._comms_generation:
            self._comms_mark = {}  # someone reset the counter since the last step: count from zero
            self._comms_generation = comm.COUNTER.generation
        delta = {}
        for op, s in now.items():
            before = self._comms_mark.get(op, dict.fromkeys(s, 0))
            d = {k: s[k] - before[k] for k in s}
            if d["count"]:
                delta[op] = d
        self.last_step_comms = delta
        self._comms_mark = now

    def _report(self) -> None:
        cfg = self.config
        if self.dp_rank != 0 or not cfg.steps_per_print or self.global_steps % cfg.steps_per_print:
            return
        logger.info("step=%d skipped=%d lr=%s grad_norm=%s loss_scale=%g", self.global_steps, self.skipped_steps,
                    [round(x, 8) for x in self.get_lr()], self._grad_norm, self.loss_scaler.scale)
        if cfg.comms_logger.enabled:
            for op, d in sorted(self.last_step_comms.items()):
                logger.info("comms %s: %d calls, %d elements, %.3f MB this step; sent %.3f MB inside the host, "
                            "%.3f MB across hosts", op, d["count"], d["elements"], d["bytes"] / 1e6,
                            d.get("intra_host_bytes", 0) / 1e6, d.get("inter_host_bytes", 0) / 1e6)
        if cfg.wall_clock_breakdown:
            logger.info("time (s, cumulative): forward=%.3f backward=%.3f step=%.3f", self._timers["forward"],
                        self._timers["backward"], self._timers["step"])

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of model state held by this rank: parameters, gradients, fp32 masters, optimizer
        states, and the peak of transient communication buffers."""
        out = self.strategy.memory_bytes()
        bucketed = {id(p) for p in self.strategy.managed_parameters()}
        out["params"] += sum(p.numel() * p.element_size() for p in self.module.parameters() if id(p) not in bucketed)
        out["total"] = out["params"] + out["grads"] + out["master_params"] + out["optimizer_states"]
        return out

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) module state dict on data-parallel rank 0, ``{}`` on the others.

        Every rank must call it: under stage 3 it all-gathers the partitioned parameters, under
        tensor parallelism the tp shards (then every tp rank of data-parallel rank 0 holds it all).
        """
        gather = getattr(self.strategy, "consolidated_state_dict", None)
        if gather is not None:
            state = gather()
        elif self.dp_rank != 0:
            state = {}
        else:
            state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        from zerospeed.moe.consolidate import add_experts_of_other_ranks  # ep > 1: other ranks' experts

        state = add_experts_of_other_ranks(self.module, state, self.dp_group, self.dp_rank)
        return state if self.checkpoint_layout is None else self.checkpoint_layout.gather_full(state)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """With ``hybrid_engine.enabled``: rollouts on zerospeed's inference engine over the live weights
        (:meth:`zerospeed.rl.rollout.RolloutEngine.generate`; every data-parallel rank calls it). Otherwise the
        module's own ``generate`` (HF's), as before."""
        rl = self.__dict__.get("rl")
        if rl is not None and rl.enabled:
            return rl.generate(*args, **kwargs)
        return self.module.generate(*args, **kwargs)

    def sync_weights(self, *args: Any, **kwargs: Any) -> Any:
        """Stream the current weights to a generator server (:func:`zerospeed.rl.sync.sync_weights`)."""
        rl = self.__dict__.get("rl")
        if rl is None:
            raise RuntimeError("engine.sync_weights: this engine was not built by zerospeed.initialize")
        return rl.sync_weights(*args, **kwargs)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the consolidated 16-bit (compute-dtype) weights to ``save_dir/save_filename`` on rank 0
        (``*.safetensors`` or a ``torch.save`` file). A collective: every rank calls it. At stage 3 it
        saves only with ``stage3_gather_16bit_weights_on_model_save`` (else returns False, as DeepSpeed)."""
        from zerospeed.runtime.model_save import save_16bit_model

        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def destroy(self) -> None:
        """Release what the engine holds outside the model (DeepSpeed's ``engine.destroy()``): waits
        for an asynchronous checkpoint save, removes the strategy's hooks and deletes NVMe swap files.
        The engine cannot train afterwards."""
        self.wait_for_checkpoint()
        self.monitor.close()
        close = getattr(self.strategy, "close", None)
        if callable(close):
            close()

    @property
    def flops_profiler(self) -> Any:
        """The :class:`~zerospeed.profiling.FlopsProfiler` of the ``flops_profiler`` section (None when off)."""
        return self._flops_hook.profiler

    def wall_clock(self) -> dict[str, float]:
        return dict(self._timers)

    # -- checkpoints (implemented in zerospeed.runtime.checkpointing) -----------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True) -> bool:
        from zerospeed.runtime.checkpointing import save_checkpoint

        return save_checkpoint(self, save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, dict[str, Any] | None]:
        from zerospeed.runtime.checkpointing import load_checkpoint

        loaded = load_checkpoint(self, load_dir, tag=tag, load_module_strict=load_module_strict,
                                 load_optimizer_states=load_optimizer_states,
                                 load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only)
        if self.compression_scheduler is not None:  # the schedule follows the restored step count
            self.compression_scheduler.load_state_dict({"training_steps": self.global_steps})
        return loaded

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save (``checkpoint.async_save``) has been published."""
        from zerospeed.runtime.checkpointing import wait_for_checkpoint

        wait_for_checkpoint(self)


#: DeepSpeed's class name at its module path (``deepspeed.runtime.engine.DeepSpeedEngine``), which TRL and
#: Accelerate use in isinstance checks: the same class, so every zerospeed engine is one.
DeepSpeedEngine = ZeroSpeedEngine
