"""DeepSpeed's public engine methods on :class:`zerospeed.runtime.engine.ZeroSpeedEngine`.

DeepSpeed 0.19.8's ``DeepSpeedEngine`` has 180 public methods (listed in
:data:`DEEPSPEED_ENGINE_METHODS`, read from ``deepspeed/runtime/engine.py`` with ``ast``). Each is,
on a zerospeed engine, one of:

* **has** (:data:`HAS`): the engine defined it before this list was made;
* **adds** (:data:`ADDS`): defined here, in :class:`DeepSpeedEngineAPI`, a mixin the engine inherits
  (rank and device properties, precision and ZeRO queries, config accessors, ``scale(loss)``...).
  Queries about DeepSpeed features that zerospeed's config refuses to turn on (flops profiler,
  autotuning, curriculum learning, data efficiency, random-LTD, DeepCompile...) answer "off";
* **lacks on purpose** (:data:`LACKS`, kept with the "off" queries in :mod:`zerospeed.runtime.engine_api_absent`):
  calling it raises ``NotImplementedError`` that names the
  method and says why or what to use instead.

Two **differences in kind** are deliberate and documented here: ``engine.loss_scale`` is a
property (the current loss scale, a float) where DeepSpeed has a method returning the *static*
loss scale of the config (``engine.fp16.loss_scale`` there is our ``engine.config.fp16.loss_scale``);
``engine.memory_breakdown()`` returns the per-rank bytes of model state, where DeepSpeed's returns
the ``memory_breakdown`` config flag (our ``engine.config.memory_breakdown``).

``tests/test_compat_engine_api.py`` checks that the three lists cover DeepSpeed's methods exactly
and that every listed name behaves as its list says.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from zerospeed import comm
from zerospeed.runtime.engine_api_absent import LACKS, OFF_QUERIES, lacking, off
from zerospeed.runtime.precision_options import DTYPES

# fmt: off
DEEPSPEED_ENGINE_METHODS: tuple[str, ...] = tuple("""
destroy collect_python_gc get_batch_info set_train_batch_size set_train_micro_batch_size set_data_post_process_func
set_custom_curriculum_learning_schedule get_global_grad_norm checkpoint_serialization_enabled checkpoint_writer_enabled
checkpoint_tag_validation_enabled checkpoint_tag_validation_fail data_efficiency_enabled data_efficiency_config
data_sampling_enabled data_sampling_config curriculum_learning_enabled curriculum_learning_config random_ltd_enabled
random_ltd_config random_ltd_initialize get_data_parallel_rank get_tensor_parallel_rank get_model_parallel_rank
get_sequence_parallel_group wall_clock_breakdown flops_profiler_enabled flops_profiler_recompute_fwd_factor
flops_profiler_profile_step flops_profiler_module_depth flops_profiler_top_modules flops_profiler_detailed
flops_profiler_output_file memory_breakdown autotuning_enabled autotuning_start_profile_step autotuning_end_profile_step
autotuning_metric_path autotuning_model_info_path autotuning_metric autotuning_profile_model_info train_batch_size
train_micro_batch_size_per_gpu optimizer_name optimizer_params optimizer_legacy_fusion scheduler_name scheduler_params
zero_optimization zero_allow_untested_optimizer zero_force_ds_cpu_optimizer zero_reduce_scatter zero_overlap_comm
zero_offload_optimizer zero_offload_param zero_use_cpu_optimizer zero_cpu_offload zero_partial_offload super_offload
cpuadam_cores_perc zero_sub_group_size zero_optimization_stage compile_zero_optimization_stage compile_autosp
compile_autotp uses_parallelization_pass_only zero_reduce_bucket_size zero_multi_rank_bucket_allreduce
zero_allgather_bucket_size zero_compute_grad_norm zero_optimization_partition_gradients
zero_optimization_partition_weights is_first_weights_partition_group zero_contiguous_gradients
zero_load_from_fp32_weights zero_elastic_checkpoint zero_nvme_offload_optimizer zero_max_live_parameters
zero_max_reuse_distance zero_prefetch_bucket_size zero_module_granularity_threshold zero_param_persistence_threshold
zero_model_persistence_threshold zero_gather_16bit_weights_on_model_save zero_legacy_stage1
zero_ignore_unused_parameters zero_save_muon_momentum_buffer_in_memory tensor_parallel_config autotp_size fp16_enabled
bfloat16_enabled fp16_master_weights_and_gradients bf16_master_weights_and_gradients bf16_optimizer_states
torch_autocast_enabled torch_autocast_dtype torch_autocast_lower_precision_safe_modules fp16_auto_cast loss_scale
gradient_accumulation_steps managed_gradient_accumulation use_node_local_storage load_universal_checkpoint log_level
communication_data_type postscale_gradients gradient_predivide_factor steps_per_print zero_allgather_partitions
zero_round_robin_gradients zero_parameter_alignment zero_hpz_partition_size zero_quantized_weights
zero_quantized_nontrainable_weights zero_quantized_gradients zero_log_trace_cache_warnings zero_allgather_sequential
is_sanity_checks_enabled dump_state gradient_clipping dynamic_loss_scale initial_dynamic_scale dynamic_loss_scale_args
swap_tensor_config aio_config zenflow_config get_data_types get_optimizer_configuration is_map_style_dataset
is_iterable_style_dataset dataloader_drop_last was_step_applied deepspeed_io train eval forward print_forward_breakdown
allreduce_gradients no_sync coalesce_grad_reduction scale backward is_gradient_accumulation_boundary
set_gradient_accumulation_boundary zero_grad clip_fp32_gradients step get_wall_clock_timers get_lr get_type get_mom
allreduce_bucket allreduce_and_copy allreduce_no_retain buffered_allreduce_fallback sparse_allreduce_no_retain
sparse_allreduce_bucket sparse_allreduce sparse_all_gather all_gather_scalar module_state_dict load_moe_state_dict
load_module_state_dict load_checkpoint save_checkpoint save_fp16_model save_16bit_model empty_partition_cache
get_autosp_backend get_autotp_backend get_deepcompile_backend get_deepspeed_compile_backend compile get_compile_time
register_compile_pass is_deepcompile_enabled is_deepcompile_active is_compiled offload_states reload_states
""".split())
# fmt: on

#: defined on the engine before this list was made
HAS: tuple[str, ...] = (
    "destroy", "get_global_grad_norm", "memory_breakdown", "train_batch_size", "train_micro_batch_size_per_gpu",
    "loss_scale", "gradient_accumulation_steps", "train", "eval", "forward", "backward",
    "is_gradient_accumulation_boundary", "zero_grad", "step", "get_lr", "load_checkpoint", "save_checkpoint",
    "save_16bit_model",
)


class DeepSpeedEngineAPI:
    """Mixin: the DeepSpeed engine methods zerospeed adds (see the module docstring).

    Reads only what the engine already holds: ``self.config`` (parsed), ``self.module``,
    ``self.optimizer``, ``self.lr_scheduler``, ``self.loss_scaler``, ``self.dp_rank`` /
    ``self.dp_world_size`` and ``self.skipped_steps``.
    """

    _in_no_sync = False  # inside engine.no_sync()

    # -- ranks and device ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device this rank computes on (its CUDA device under NCCL, else the CPU)."""
        fixed = self.__dict__.get("_device")
        if fixed is not None:
            return fixed
        for p in self.module.parameters():  # type: ignore[attr-defined]
            if p.device.type != "meta":
                return p.device if p.device.type != "cuda" else torch.device("cuda", p.device.index or 0)
        return comm.device_for_backend()

    @device.setter
    def device(self, value: torch.device) -> None:  # the pipeline engine fixes it
        self.__dict__["_device"] = torch.device(value)

    @property
    def local_rank(self) -> int:
        return comm.get_local_rank()

    @property
    def global_rank(self) -> int:
        return comm.get_rank()

    @property
    def world_size(self) -> int:
        """Data-parallel world size (DeepSpeed: ``world_size`` is the data-parallel degree)."""
        return self.dp_world_size  # type: ignore[attr-defined]

    @property
    def mp_world_size(self) -> int:
        return 1

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank  # type: ignore[attr-defined]

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_sequence_parallel_group(self) -> Any:
        """The mesh's sequence-parallel group (``sequence_parallel_size`` ranks, or the mpu's given to initialize);
        one rank's own group when sequence parallelism is off."""
        return comm.current_mesh().sp_group

    def get_tensor_parallel_rank(self) -> int:
        return 0

    def is_first_weights_partition_group(self) -> bool:
        return True

    # -- precision -------------------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return self.config.precision == "fp16"  # type: ignore[attr-defined]

    def bfloat16_enabled(self) -> bool:
        return self.config.precision == "bf16"  # type: ignore[attr-defined]

    def fp16_master_weights_and_gradients(self) -> bool:
        return bool(self.config.fp16.fp16_master_weights_and_grads)  # type: ignore[attr-defined]

    def bf16_master_weights_and_gradients(self) -> bool:
        return bool(self.config.bf16.bf16_master_weights_and_grads)  # type: ignore[attr-defined]

    def bf16_optimizer_states(self) -> bool:
        return bool(self.config.bf16.bf16_optimizer_states)  # type: ignore[attr-defined]

    def fp16_auto_cast(self) -> bool:
        return bool(self.config.fp16.auto_cast)  # type: ignore[attr-defined]

    def torch_autocast_enabled(self) -> bool:
        return bool(self._autocast[0])  # type: ignore[attr-defined]

    def torch_autocast_dtype(self) -> torch.dtype | None:
        enabled, dtype = self._autocast  # type: ignore[attr-defined]
        return (dtype or torch.get_autocast_dtype(self.device.type)) if enabled else None

    def torch_autocast_lower_precision_safe_modules(self) -> list[str] | None:
        return self.config.torch_autocast.lower_precision_safe_modules  # type: ignore[attr-defined]

    def dynamic_loss_scale(self) -> bool:
        return self.fp16_enabled() and self.config.fp16.loss_scale == 0  # type: ignore[attr-defined]

    def initial_dynamic_scale(self) -> float:
        return float(2 ** self.config.fp16.initial_scale_power)  # type: ignore[attr-defined]

    def dynamic_loss_scale_args(self) -> dict[str, Any] | None:
        if not self.dynamic_loss_scale():
            return None
        f = self.config.fp16  # type: ignore[attr-defined]
        return {"init_scale": 2 ** f.initial_scale_power, "scale_window": f.loss_scale_window,
                "delayed_shift": f.hysteresis, "consecutive_hysteresis": f.consecutive_hysteresis,
                "min_scale": f.min_loss_scale}

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(model dtype, gradient accumulation dtype), as DeepSpeed reports them."""
        model = self.compute_dtype  # type: ignore[attr-defined]
        return model, torch.float32 if self.zero_optimization_stage() > 0 or model == torch.float32 else model

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current loss scale, for ``engine.scale(loss).backward()`` (DeepSpeed's
        manual form under fp16); accumulation scaling is applied by the engine's output hook."""
        if not torch.is_tensor(loss) or loss.numel() != 1 or loss.grad_fn is None:
            raise ValueError("engine.scale expects a scalar loss tensor with a grad_fn")
        self._torch_backward.expect_user_scaled()  # type: ignore[attr-defined]
        return loss * self.loss_scaler.scale  # type: ignore[attr-defined]

    # -- ZeRO ------------------------------------------------------------------------------------
    def zero_optimization_stage(self) -> int:
        return int(self.config.zero_optimization.stage)  # type: ignore[attr-defined]

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() >= 3

    def _zero(self, name: str) -> Any:
        return getattr(self.config.zero_optimization, name)  # type: ignore[attr-defined]

    def zero_offload_optimizer(self) -> Any:
        section = self._zero("offload_optimizer")
        return section if section is not None and section.enabled else None

    def zero_offload_param(self) -> Any:
        section = self._zero("offload_param")
        return section if section is not None and section.enabled else None

    def zero_cpu_offload(self) -> bool:
        section = self.zero_offload_optimizer()
        return section is not None and section.device == "cpu"

    def zero_use_cpu_optimizer(self) -> bool:
        return self.zero_offload_optimizer() is not None

    def zero_allow_untested_optimizer(self) -> bool:
        return bool(self.config.zero_allow_untested_optimizer)  # type: ignore[attr-defined]

    def zero_force_ds_cpu_optimizer(self) -> bool:
        return bool(self.config.zero_force_ds_cpu_optimizer)  # type: ignore[attr-defined]

    def zero_reduce_scatter(self) -> bool:
        return bool(self._zero("reduce_scatter"))

    def zero_overlap_comm(self) -> bool:
        return bool(self._zero("overlap_comm"))

    def zero_sub_group_size(self) -> int:
        return int(self._zero("sub_group_size"))

    def zero_reduce_bucket_size(self) -> int:
        return int(self._zero("reduce_bucket_size"))

    def zero_multi_rank_bucket_allreduce(self) -> bool:
        return bool(self._zero("use_multi_rank_bucket_allreduce"))

    def zero_allgather_bucket_size(self) -> int:
        return int(self._zero("allgather_bucket_size"))

    def zero_allgather_partitions(self) -> bool:
        return bool(self._zero("allgather_partitions"))

    def zero_compute_grad_norm(self) -> bool:
        return True

    def zero_contiguous_gradients(self) -> bool:
        return bool(self._zero("contiguous_gradients"))

    def zero_load_from_fp32_weights(self) -> bool:
        return bool(self._zero("load_from_fp32_weights"))

    def zero_max_live_parameters(self) -> int:
        return int(self._zero("stage3_max_live_parameters"))

    def zero_max_reuse_distance(self) -> int:
        return int(self._zero("stage3_max_reuse_distance"))

    def zero_prefetch_bucket_size(self) -> int:
        return int(self._zero("stage3_prefetch_bucket_size"))

    def zero_param_persistence_threshold(self) -> int:
        return int(self._zero("stage3_param_persistence_threshold"))

    def zero_model_persistence_threshold(self) -> int:
        return int(self._zero("stage3_model_persistence_threshold"))

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(self._zero("stage3_gather_16bit_weights_on_model_save"))

    def zero_ignore_unused_parameters(self) -> bool:
        return bool(getattr(self.config.zero_optimization, "ignore_unused_parameters", True))  # type: ignore

    def zero_parameter_alignment(self) -> int:
        return 1

    # -- other config accessors ------------------------------------------------------------------
    def optimizer_name(self) -> str | None:
        opt = self.config.optimizer  # type: ignore[attr-defined]
        return opt.type if opt is not None else type(self.optimizer).__name__  # type: ignore[attr-defined]

    def optimizer_params(self) -> dict[str, Any] | None:
        opt = self.config.optimizer  # type: ignore[attr-defined]
        return dict(opt.params) if opt is not None else None

    def get_optimizer_configuration(self) -> tuple[str | None, dict[str, Any] | None]:
        return self.optimizer_name(), self.optimizer_params()

    def scheduler_name(self) -> str | None:
        sch = self.config.scheduler  # type: ignore[attr-defined]
        return sch.type if sch is not None else None

    def scheduler_params(self) -> dict[str, Any] | None:
        sch = self.config.scheduler  # type: ignore[attr-defined]
        return dict(sch.params) if sch is not None else None

    def gradient_clipping(self) -> float:
        return float(self.config.gradient_clipping)  # type: ignore[attr-defined]

    def steps_per_print(self) -> int:
        return int(self.config.steps_per_print)  # type: ignore[attr-defined]

    def wall_clock_breakdown(self) -> bool:
        return bool(self.config.wall_clock_breakdown)  # type: ignore[attr-defined]

    def dump_state(self) -> bool:
        return bool(self.config.dump_state)  # type: ignore[attr-defined]

    def dataloader_drop_last(self) -> bool:
        return bool(self.config.dataloader_drop_last)  # type: ignore[attr-defined]

    @property
    def communication_data_type(self) -> torch.dtype:
        name = self.config.communication_data_type  # type: ignore[attr-defined]
        return DTYPES[name] if name else self.compute_dtype  # type: ignore[attr-defined]

    def postscale_gradients(self) -> bool:
        return not self.config.prescale_gradients  # type: ignore[attr-defined]

    def gradient_predivide_factor(self) -> float:
        return float(self.config.gradient_predivide_factor)  # type: ignore[attr-defined]

    def aio_config(self) -> Any:
        return self.config.aio  # type: ignore[attr-defined]

    def swap_tensor_config(self) -> Any:
        return self.zero_offload_param() or self.zero_offload_optimizer()

    def tensor_parallel_config(self) -> Any:
        return getattr(self.config, "tensor_parallel", None)  # type: ignore[attr-defined]

    def autotp_size(self) -> int:
        return 1

    def checkpoint_tag_validation_enabled(self) -> bool:
        return self._tag_validation() != "IGNORE"

    def checkpoint_tag_validation_fail(self) -> bool:
        return self._tag_validation() == "FAIL"

    def _tag_validation(self) -> str:
        return str(getattr(self.config.checkpoint, "tag_validation", "WARN")).upper()  # type: ignore[attr-defined]

    def _flops(self, name: str) -> Any:
        return getattr(self.config.flops_profiler, name)  # type: ignore[attr-defined]

    def flops_profiler_enabled(self) -> bool:
        return bool(self._flops("enabled"))

    def flops_profiler_recompute_fwd_factor(self) -> float:
        return float(self._flops("recompute_fwd_factor"))

    def flops_profiler_profile_step(self) -> int:
        return int(self._flops("profile_step"))

    def flops_profiler_module_depth(self) -> int:
        return int(self._flops("module_depth"))

    def flops_profiler_top_modules(self) -> int:
        return int(self._flops("top_modules"))

    def flops_profiler_detailed(self) -> bool:
        return bool(self._flops("detailed"))

    def flops_profiler_output_file(self) -> str | None:
        return self._flops("output_file")

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin", *args: Any,
                        **kwargs: Any) -> Any:
        """DeepSpeed's older name of ``save_16bit_model``."""
        return self.save_16bit_model(save_dir, save_filename, *args, **kwargs)  # type: ignore[attr-defined]

    def log_level(self) -> int:
        import logging

        return logging.getLogger("zerospeed").getEffectiveLevel()

    # -- batch sizes -----------------------------------------------------------------------------
    def get_batch_info(self) -> tuple[int, int, int]:
        c = self.config  # type: ignore[attr-defined]
        return c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps

    def _set_batch(self, micro: int, gas: int) -> None:
        if self.micro_steps % self.config.gradient_accumulation_steps:  # type: ignore[attr-defined]
            raise RuntimeError("cannot change the batch size in the middle of an accumulation window; call it "
                               "after engine.step() at a boundary")
        self.config = self.config.model_copy(update={  # type: ignore[attr-defined]
            "train_batch_size": micro * gas * self.dp_world_size,  # type: ignore[attr-defined]
            "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas})
        self.micro_steps = 0  # type: ignore[attr-defined]

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing the accumulation steps (the micro batch stays)."""
        micro = self.config.train_micro_batch_size_per_gpu  # type: ignore[attr-defined]
        per_step = micro * self.dp_world_size  # type: ignore[attr-defined]
        if not isinstance(train_batch_size, int) or train_batch_size <= 0 or train_batch_size % per_step:
            raise ValueError(f"set_train_batch_size: {train_batch_size} is not a positive multiple of micro batch "
                             f"{micro} x data-parallel size {self.dp_world_size}")  # type: ignore[attr-defined]
        self._set_batch(micro, train_batch_size // per_step)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro batch (the accumulation steps stay, so the global batch changes)."""
        if not isinstance(micro_batch_size, int) or micro_batch_size <= 0:
            raise ValueError(f"set_train_micro_batch_size: {micro_batch_size!r} is not a positive int")
        self._set_batch(micro_batch_size, self.config.gradient_accumulation_steps)  # type: ignore[attr-defined]

    # -- step results and optimizer views --------------------------------------------------------
    def was_step_applied(self) -> bool:
        """Whether the last optimizer step updated the weights (False after an overflow skip)."""
        return self._last_step_applied  # type: ignore[attr-defined]

    def get_mom(self) -> list[Any]:
        out = []
        for g in self.optimizer.param_groups:  # type: ignore[attr-defined]
            out.append(g["betas"] if "betas" in g else g.get("momentum"))
        return out

    def get_type(self) -> list[str]:
        return [str(g.get("type", type(self.optimizer).__name__)) for g in self.optimizer.param_groups]  # type: ignore

    def get_wall_clock_timers(self) -> dict[str, float]:
        return self.wall_clock()  # type: ignore[attr-defined]

    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The module's state dict (under ZeRO-3 the full one on data-parallel rank 0, gathered
        collectively: every rank must call it)."""
        if self.zero_optimization_partition_weights():
            state = self.consolidated_state_dict()  # type: ignore[attr-defined]
        else:
            state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)  # type: ignore
        if exclude_frozen_parameters:
            frozen = {prefix + n for n, p in self.module.named_parameters() if not p.requires_grad}  # type: ignore
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    # -- data ------------------------------------------------------------------------------------
    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        return isinstance(obj, torch.utils.data.IterableDataset)

    def deepspeed_io(self, dataset: Any, batch_size: int | None = None, route: Any = None, pin_memory: bool = True,
                     data_sampler: Any = None, collate_fn: Any = None, num_local_io_workers: Any = None) -> Any:
        """A loader giving this data-parallel rank its micro-batches (what ``initialize`` returns)."""
        from zerospeed.runtime.dataloader import build_dataloader

        if data_sampler is not None:
            raise ValueError("deepspeed_io: data_sampler is not supported; the loader shards with a "
                             "DistributedSampler over data-parallel ranks")
        c = self.config  # type: ignore[attr-defined]
        return build_dataloader(dataset, batch_size or c.train_micro_batch_size_per_gpu, self.dp_rank,  # type: ignore
                                self.dp_world_size, collate_fn=collate_fn,  # type: ignore[attr-defined]
                                drop_last=c.dataloader_drop_last, seed=c.seed or 0)

    def collect_python_gc(self) -> None:
        import gc

        gc.collect()

    # -- torch.compile (zerospeed.compile) --------------------------------------------------------
    def compile(self, backend: Any = "inductor", compile_kwargs: dict[str, Any] | None = None,
                schedule: Any = None) -> None:
        """torch.compile the wrapped module in place (the ZeRO machinery stays outside the graph), or,
        with ``compile.deepcompile: true``, move the ZeRO gathers and reductions into the graphs."""
        from zerospeed.compile.engine_compile import compile_engine

        compile_engine(self, backend, compile_kwargs, schedule)

    @property
    def is_compiled(self) -> bool:
        from zerospeed.compile.engine_compile import state_of

        return state_of(self).compiled

    def get_compile_time(self) -> float:
        """Seconds Dynamo and the backend spent compiling frames since ``engine.compile()``."""
        from zerospeed.compile.engine_compile import state_of

        return float(state_of(self).report().get("compile_time_s", 0.0))

    def compile_report(self) -> dict[str, Any]:
        """zerospeed addition: graphs, graph breaks, recompiles (with reasons) and compile time."""
        from zerospeed.compile.engine_compile import state_of

        return state_of(self).report()

    def is_deepcompile_enabled(self) -> bool:
        return bool(self.config.compile.deepcompile)

    def is_deepcompile_active(self) -> bool:
        from zerospeed.compile.engine_compile import state_of

        return state_of(self).deepcompile is not None

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """DeepSpeed's private name, which Accelerate's ``get_state_dict`` and Transformers' ``Trainer.save_model``
        call at ZeRO-3: the whole module state dict on data-parallel rank 0, ``{}`` on the others (a collective;
        :meth:`consolidated_state_dict`), without the frozen parameters when asked."""
        state = self.consolidated_state_dict()  # type: ignore[attr-defined]
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}  # type: ignore[attr-defined]
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    _consolidated_16bit_state_dict = _zero3_consolidated_16bit_state_dict  # DeepSpeed's name under AutoTP

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's manual accumulation boundary, sticky until set again: while False, backwards only accumulate
        (no reduction at stages 0-1) and ``step()`` only counts the micro-batch; while True, each backward ends a window
        (reduced gradients, ``step()`` steps), whatever ``gradient_accumulation_steps`` says. The loss is still divided
        by ``gradient_accumulation_steps``, as in DeepSpeed 0.19.8. Refused on the pipeline engine (its window is one
        ``train_batch()``)."""
        if not isinstance(is_boundary, (bool, int)) or is_boundary not in (0, 1):
            raise TypeError(f"engine.set_gradient_accumulation_boundary: is_boundary must be a bool, "
                            f"got {is_boundary!r}")
        self._boundary_override = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DeepSpeed's ``no_sync`` at ZeRO 0-1 (Accelerate's ``accumulate`` enters it between syncs at those stages):
        backwards inside only accumulate, unreduced; the next backward at the accumulation boundary outside reduces
        the sum. ``step()`` inside, nesting, and stages 2-3 (which reduce-scatter every backward) are refused with
        DeepSpeed's ``AssertionError`` messages."""
        stage = self.config.zero_optimization.stage  # type: ignore[attr-defined]
        if stage >= 2:
            raise AssertionError(f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO "
                                 f"stage {stage}: it reduce-scatters every backward (set_gradient_accumulation_boundary"
                                 "(False) accumulates there)")
        if self._in_no_sync:
            raise AssertionError("no_sync context manager reentry is unsupported")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def _reduces_in_backward(self) -> bool:
        """Whether the coming backward reduces gradients: at the accumulation boundary, outside ``no_sync``."""
        return self.is_gradient_accumulation_boundary() and not self._in_no_sync  # type: ignore[attr-defined]

    def managed_gradient_accumulation(self) -> bool:
        """True, DeepSpeed's default: windows follow gradient_accumulation_steps or set_gradient_accumulation_boundary
        (the ``managed_gradient_accumulation: false`` config key, where every step() ends a window, is not built)."""
        return True

    def register_compile_pass(self, name: str, fn: Any) -> None:
        """Register a graph pass ``(graph_module, profile) -> graph_module`` under ``name``."""
        from zerospeed.compile.engine_compile import state_of

        state_of(self).passes.register(name, fn)


for _name, _reason in LACKS.items():
    setattr(DeepSpeedEngineAPI, _name, lacking(_name, _reason))
for _name, _value in OFF_QUERIES.items():
    setattr(DeepSpeedEngineAPI, _name, off(_name, _value))

#: defined here (everything of DeepSpeed's list that is neither in HAS nor in LACKS)
ADDS: tuple[str, ...] = tuple(n for n in DEEPSPEED_ENGINE_METHODS if n not in HAS and n not in LACKS)
