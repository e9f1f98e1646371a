"""Every parsed config field is read outside config/ or listed here as a deliberate no-op (issue 20).

"Read" is checked statically: the field's name appears as an attribute access (``.name``) or a
string (``"name"``) somewhere in src/zerospeed outside config/. A field nobody reads must be in
:data:`NO_OP_FIELDS` with the reason it may be accepted and ignored; a field that would change the
math if ignored must instead be read (and refused when its value is not built, as
``gradient_allreduce_op`` and ``data_types.*`` are).
"""

from __future__ import annotations

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from zerospeed.config import ZeroSpeedConfig

SRC = Path(__file__).parents[1] / "src" / "zerospeed"

_SAME_RESULT = "only changes how DeepSpeed schedules work; zerospeed's result is the same"
_TP_PENDING = "tensor-parallel option accepted for DeepSpeed configs; zerospeed's AutoTP decides this itself"

NO_OP_FIELDS: dict[str, str] = {
    "aio.io_backend": "the async I/O engine picks its own backend (io_uring/threads)",
    "autotuning.mp_size": "model-parallel degree for DeepSpeed's autotuner memory model; zerospeed's autotuner "
                          "reads the mesh instead",
    "bf16.check_grad_overflow": "zerospeed always skips a step with non-finite gradients, in every precision",
    "bf16.immediate_grad_update": _SAME_RESULT + " (gradients are reduced as buckets fill)",
    "checkpoint.load_universal": "every zerospeed checkpoint is universal (loads at any world size and stage)",
    "checkpoint.parallel_write.pipeline_stage": "each rank writes its own shards anyway",
    "hybrid_engine.tp_gather_partition_size": "sizes DeepSpeed's CUDA-kernel TP gathers; zerospeed's rollouts "
                                              "gather ZeRO-3 buckets, no TP partition gathers",
    "comms_logger.prof_all": "the comms logger always counts every collective",
    "comms_logger.prof_ops": "the comms logger always counts every collective",
    "comms_logger.verbose": "per-call logging is not offered; per-step totals are",
    "compression_training.weight_quantization.shared_parameters.quantize_verbose": "logging knob of DeepSpeed's "
                                                                                    "quantizer",
    "compression_training.weight_quantization.shared_parameters.quantize_weight_in_forward": "zerospeed's QAT "
                                                                                            "always fake-quantizes "
                                                                                            "in forward",
    "compression_training.weight_quantization.shared_parameters.quantizer_kernel": "CUDA kernel choice; "
                                                                                   "zerospeed's quantizer is torch",
    "disable_allgather": _SAME_RESULT + " (legacy broadcast instead of all-gather)",
    "optimizer.legacy_fusion": "DeepSpeed's legacy fp16 optimizer fusion; torch's fused kernels are used",
    "pipeline.grad_partitioned": _SAME_RESULT + " (pipeline gradient partitioning across tensor-parallel ranks)",
    "pipeline.pipe_partitioned": _SAME_RESULT + " (pipeline activation partitioning across tensor-parallel ranks)",
    "seq_parallel_comm_data_type": "the sequence-parallel all-to-all runs in the activations' dtype",
    "tensor_parallel.injection_policy_tuple": "always None (DeepSpeed's internal form of injection_policy)",
    "tensor_parallel.keep_module_on_host": _TP_PENDING,
    "tensor_parallel.partition_config.embedding_partition_dim": _TP_PENDING,
    "tensor_parallel.partition_config.layer_specs.gather_output": _TP_PENDING,
    "tensor_parallel.partition_config.layer_specs.grad_allreduce": _TP_PENDING,
    "tensor_parallel.partition_config.strict_mode": _TP_PENDING,
    "tensor_parallel.replace_with_kernel_inject": "kernel injection is inference-only in DeepSpeed",
    "tensor_parallel.tp.tp_grain_size": _TP_PENDING,
    "tensor_parallel.tp_grain_size": _TP_PENDING,
    "tensor_parallel.tp_overlap_comm": _TP_PENDING,
    "torch_autocast.lower_precision_safe_modules": "validated and reported by the engine; gradients are reduced in "
                                                   "fp32 for every module (exact; DeepSpeed reduces these in the "
                                                   "autocast dtype)",
    "vocabulary_size": "informational in DeepSpeed (used by its autotuner's memory model)",
    "zero_optimization.elastic_checkpoint": "every zerospeed checkpoint reshards on load",
    "zero_optimization.enable_sanity_checks": "debug checks of DeepSpeed's ZeRO-3 internals",
    "zero_optimization.legacy_stage1": "DeepSpeed's pre-2021 stage 1 implementation",
    "zero_optimization.log_trace_cache_warnings": "zerospeed's ZeRO-3 trace reports divergence as errors",
    "zero_optimization.memory_efficient_linear": "DeepSpeed's ZeRO-3 Linear replacement; zerospeed's hooks need none",
    "zero_optimization.offload_optimizer.convert_grad_on_cpu": _SAME_RESULT + " (where fp16->fp32 gradient "
                                                                             "conversion happens)",
    "zero_optimization.offload_optimizer.fast_init": "swap files are always preallocated",
    "zero_optimization.offload_optimizer.pipeline_read": "offloaded reads always overlap the update",
    "zero_optimization.offload_optimizer.pipeline_write": "offloaded writes always overlap the update",
    "zero_optimization.override_module_apply": "zero.Init never patches nn.Module.apply",
    "zero_optimization.pipeline_loading_checkpoint": "pipeline checkpoints load per stage anyway",
    "zero_optimization.round_robin_gradients": _SAME_RESULT + " (gradient partition placement for CPU offload)",
    "zero_optimization.save_muon_momentum_buffer_in_memory": "Muon momentum buffers always stay in memory",
    "zero_optimization.stage3_allgather_sequential": _SAME_RESULT + " (all-gathers per bucket already)",
    "zero_optimization.stage3_module_granularity_threshold": _SAME_RESULT + " (ZeRO-3 gathers per module)",
    "zero_optimization.stage3_partition_stream_chunk_size": _SAME_RESULT,
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": _SAME_RESULT + " (on gloo, all-gathers already run "
                                                                              "as all-reduces, see comm/collectives)",
}
# DeepCompile-only options (config/compile.py): any value but DeepSpeed's default is refused by name, and
# the default asks for nothing zerospeed's DeepCompile does not do (offload_activation and
# free_activation_threshold are built and read)
from zerospeed.config.compile import DEEPCOMPILE_ONLY_DEFAULTS  # noqa: E402

NO_OP_FIELDS.update({f"compile.{k}": "DeepCompile-only option, refused unless at DeepSpeed's default"
                     for k in DEEPCOMPILE_ONLY_DEFAULTS})
# AutoEP keys zerospeed accepts only at DeepSpeed's default (config/expert_parallel.py refuses any other value by
# name): the default asks for nothing zerospeed's expert-parallel replacement does not do
from zerospeed.config.expert_parallel import DEFAULT_ONLY as AUTOEP_DEFAULT_ONLY  # noqa: E402

NO_OP_FIELDS.update({f"expert_parallel.{k}": "AutoEP option, refused unless at DeepSpeed's default"
                     for k in AUTOEP_DEFAULT_ONLY})


def _models(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models(a)]


def _fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        subs = _models(field.annotation)
        out += [p for m in subs for p in _fields(m, prefix + name + ".")] if subs else [prefix + name]
    return out


def test_every_parsed_field_is_read_or_a_listed_no_op():
    text = "\n".join(p.read_text() for p in SRC.rglob("*.py") if "config" not in p.relative_to(SRC).parts[:1])
    unread = []
    for path in sorted(set(_fields(ZeroSpeedConfig))):
        leaf = re.escape(path.rsplit(".", 1)[-1])
        if not re.search(rf"\.{leaf}\b|[\"']{leaf}[\"']", text) and path not in NO_OP_FIELDS:
            unread.append(path)
    assert not unread, (f"config fields parsed but read nowhere outside config/: {unread}; read them (refusing "
                        "values that are not built) or add them to NO_OP_FIELDS with a reason")


def test_no_op_list_has_no_stale_entries():
    fields = set(_fields(ZeroSpeedConfig))
    assert not [k for k in NO_OP_FIELDS if k not in fields]
    assert all(len(reason) > 10 for reason in NO_OP_FIELDS.values())
