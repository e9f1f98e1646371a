"""The DeepSpeed engine methods a zerospeed engine answers without the feature behind them (split out of
:mod:`zerospeed.runtime.engine_api`, which installs them on :class:`~zerospeed.runtime.engine_api.DeepSpeedEngineAPI`).

* :data:`LACKS`: name -> why it is not there; calling it raises ``NotImplementedError`` saying so;
* :data:`OFF_QUERIES`: queries about DeepSpeed features zerospeed's config refuses to turn on, with the value they
  always answer ("off": False, or None for a missing section).
"""

from __future__ import annotations

from typing import Any

_INTERNAL = "an internal step of DeepSpeed's engine; zerospeed's ZeRO strategy does it inside backward/step"
_NO_COMPILE = ("DeepSpeed's backend getters are not in zerospeed: set compile.deepcompile: true and call "
               "engine.compile() (the backend itself is zerospeed.compile.backend_fn)")
_NO_FEATURE = "the feature is not in zerospeed (its config section is refused when enabled)"

#: name -> why it is not there (the error says it)
LACKS: dict[str, str] = {
    "set_data_post_process_func": "data efficiency / curriculum learning is not in zerospeed",
    "set_custom_curriculum_learning_schedule": "curriculum learning was removed from DeepSpeed's config too",
    "random_ltd_initialize": "random-LTD is not in zerospeed",
    "print_forward_breakdown": "use wall_clock_breakdown in the config; engine.wall_clock() returns the times",
    "allreduce_gradients": _INTERNAL,
    "coalesce_grad_reduction": _INTERNAL,
    "clip_fp32_gradients": _INTERNAL + " (set gradient_clipping in the config)",
    "allreduce_bucket": _INTERNAL,
    "allreduce_and_copy": _INTERNAL,
    "allreduce_no_retain": _INTERNAL,
    "buffered_allreduce_fallback": _INTERNAL,
    "sparse_allreduce_no_retain": "sparse gradients were removed from DeepSpeed and are not in zerospeed",
    "sparse_allreduce_bucket": "sparse gradients were removed from DeepSpeed and are not in zerospeed",
    "sparse_allreduce": "sparse gradients were removed from DeepSpeed and are not in zerospeed",
    "sparse_all_gather": "sparse gradients were removed from DeepSpeed and are not in zerospeed",
    "all_gather_scalar": "use zerospeed.comm.all_gather_into_tensor",
    "load_moe_state_dict": "expert parameters are saved and loaded by name with the model: use engine.load_checkpoint()",
    "load_module_state_dict": "use engine.load_checkpoint(..., load_module_only=True) or load into engine.module",
    "empty_partition_cache": "ZeRO-3 releases gathered parameters itself after each module (zero_optimization."
                             "stage3_max_live_parameters bounds what stays)",
    "get_autosp_backend": _NO_COMPILE,
    "get_autotp_backend": _NO_COMPILE,
    "get_deepcompile_backend": _NO_COMPILE,
    "get_deepspeed_compile_backend": _NO_COMPILE,
    "offload_states": "offloading states between steps is not in zerospeed; use zero_optimization.offload_optimizer",
    "reload_states": "offloading states between steps is not in zerospeed; use zero_optimization.offload_optimizer",
}


def lacking(name: str, reason: str) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"engine.{name}() is not supported by zerospeed: {reason}")

    method.__name__ = name
    method.__doc__ = f"Not supported: {reason}."
    return method


def off(name: str, value: Any = False) -> Any:
    def method(self: Any) -> Any:
        return value

    method.__name__ = name
    method.__doc__ = f"DeepSpeed's {name}: {_NO_FEATURE}, so always {value!r}."
    return method


OFF_QUERIES: dict[str, Any] = {
    **dict.fromkeys((
        "checkpoint_serialization_enabled", "data_efficiency_enabled", "data_sampling_enabled",
        "curriculum_learning_enabled", "random_ltd_enabled", "autotuning_enabled",
        "autotuning_profile_model_info", "optimizer_legacy_fusion", "zero_partial_offload", "super_offload",
        "compile_autosp", "compile_autotp", "uses_parallelization_pass_only", "zero_legacy_stage1",
        "zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
        "zero_hpz_partition_size", "zero_save_muon_momentum_buffer_in_memory",
        "use_node_local_storage", "load_universal_checkpoint", "is_sanity_checks_enabled",
        "zero_log_trace_cache_warnings", "zero_allgather_sequential", "zero_nvme_offload_optimizer",
        "zero_elastic_checkpoint", "zero_round_robin_gradients",
    ), False),
    **dict.fromkeys((
        "data_efficiency_config", "data_sampling_config", "curriculum_learning_config", "random_ltd_config",
        "autotuning_start_profile_step", "autotuning_end_profile_step", "autotuning_metric_path",
        "autotuning_model_info_path", "autotuning_metric", "zenflow_config", "compile_zero_optimization_stage",
        "cpuadam_cores_perc", "zero_module_granularity_threshold", "checkpoint_writer_enabled",
    ), None),
}
