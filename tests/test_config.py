"""Unit tests for zerospeed.config: defaults, every rule, and the exact key path of every error."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pydantic
import pytest

from zerospeed.config import (
    OPTIMIZER_NAMES,
    SCHEDULER_NAMES,
    ConfigError,
    ZeroSpeedConfig,
    load_config,
)
from zerospeed.config.removed import REMOVED_KEYS


def cfg(**top: Any) -> dict[str, Any]:
    """A minimal valid config plus the given top-level keys."""
    return {"train_batch_size": 8, **top}


def error_of(config: Any, key_path: str, *fragments: str, dp: int = 1) -> ConfigError:
    """Assert ``load_config`` fails with one one-line ConfigError naming ``key_path``."""
    with pytest.raises(ConfigError) as info:
        load_config(config, dp_world_size=dp)
    err = info.value
    message = str(err)
    assert err.key_path == key_path, message
    assert message.startswith(f"zerospeed config: {key_path}: ") or key_path == ""
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    # no pydantic error chained behind ours
    assert err.__cause__ is None
    assert err.__context__ is None or err.__suppress_context__
    return err


# ----------------------------------------------------------------------------- defaults


def test_defaults_of_a_minimal_config() -> None:
    c = load_config({"train_batch_size": 8})
    assert isinstance(c, ZeroSpeedConfig)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (8, 8, 1)
    assert c.gradient_clipping == 1.0 and c.steps_per_print == 10  # DeepSpeed 0.19.8's default (issue #27)
    assert c.wall_clock_breakdown is False and c.memory_breakdown is False
    assert c.seed is None and c.prescale_gradients is False and c.gradient_predivide_factor == 1.0
    assert c.communication_data_type is None and c.zero_allow_untested_optimizer is False
    assert c.dataloader_drop_last is False and c.optimizer is None and c.scheduler is None
    assert c.precision == "fp32" and c.dp_world_size == 1
    fp16 = c.fp16
    assert (fp16.enabled, fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window) == (
        False, 0.0, 16, 1000)  # fmt: skip
    assert (fp16.hysteresis, fp16.consecutive_hysteresis, fp16.min_loss_scale, fp16.auto_cast) == (
        2, False, 1.0, False)  # fmt: skip
    assert c.bf16.enabled is False and c.bf16.bf16_master_weights_and_grads is False
    assert c.bf16.bf16_optimizer_states is False


def test_zero_defaults() -> None:
    z = load_config(cfg()).zero_optimization
    assert z.stage == 0 and z.contiguous_gradients and z.reduce_scatter
    assert z.reduce_bucket_size == 500_000_000 and z.allgather_bucket_size == 500_000_000
    assert z.allgather_partitions and z.overlap_comm is False and z.load_from_fp32_weights
    assert z.round_robin_gradients is False and z.sub_group_size == 1_000_000_000
    assert z.stage3_prefetch_bucket_size == 50_000_000
    assert z.stage3_param_persistence_threshold == 100_000
    assert z.stage3_max_live_parameters == 1_000_000_000
    assert z.stage3_max_reuse_distance == 1_000_000_000
    assert z.stage3_gather_16bit_weights_on_model_save is False
    assert z.ignore_unused_parameters is True and z.elastic_checkpoint is False
    assert z.offload_optimizer is None and z.offload_param is None


@pytest.mark.parametrize("stage,overlap", [(0, False), (1, False), (2, False), (3, True)])
def test_overlap_comm_default_depends_on_stage(stage: int, overlap: bool) -> None:
    assert load_config(cfg(zero_optimization={"stage": stage})).zero_optimization.overlap_comm is overlap
    explicit = cfg(zero_optimization={"stage": stage, "overlap_comm": not overlap})
    assert load_config(explicit).zero_optimization.overlap_comm is (not overlap)


def test_offload_and_aio_defaults() -> None:
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    c = load_config(cfg(zero_optimization=zero))
    opt, par = c.zero_optimization.offload_optimizer, c.zero_optimization.offload_param
    assert opt is not None and par is not None
    assert (opt.device, opt.nvme_path, opt.pin_memory, opt.buffer_count, opt.fast_init, opt.ratio) == (
        "cpu", None, False, 4, False, 1.0)  # fmt: skip
    assert (par.pin_memory, par.buffer_count, par.buffer_size, par.max_in_cpu) == (
        False, 5, 100_000_000, 1_000_000_000)  # fmt: skip
    aio = c.aio
    assert (aio.block_size, aio.queue_depth, aio.thread_count, aio.single_submit) == (1048576, 8, 1, False)
    assert aio.overlap_events is True and aio.use_gds is False and aio.intra_op_parallelism == 1


def test_other_section_defaults() -> None:
    c = load_config(cfg())
    assert c.comms_logger.enabled is False and c.comms_logger.prof_all is True
    assert c.comms_logger.prof_ops == () and c.comms_logger.verbose is False
    ac = c.activation_checkpointing
    assert not (ac.partition_activations or ac.cpu_checkpointing or ac.contiguous_memory_optimization)
    assert ac.number_checkpoints is None and not ac.synchronize_checkpoint_boundary and not ac.profile
    p = c.pipeline
    assert (p.stages, p.partition, p.seed_layers, p.activation_checkpoint_interval) == (
        "auto", "parameters", False, 0)  # fmt: skip
    assert (p.schedule, p.virtual_stages) == ("1f1b", 1)
    ck = c.checkpoint
    assert (ck.tag_validation, ck.load_universal, ck.use_node_local_storage, ck.async_save) == (
        "Warn", False, False, False)  # fmt: skip
    assert ck.parallel_write.pipeline_stage is False
    assert c.tensorboard.enabled is False and c.wandb.project == "deepspeed"
    assert c.csv_monitor.job_name == "DeepSpeedJobName"


def test_monitor_sections_are_typed() -> None:
    c = load_config(cfg(
        tensorboard={"enabled": True, "output_path": "/tmp/tb", "job_name": "j"},
        wandb={"enabled": True, "team": "t", "group": "g", "project": "p"},
        csv_monitor={"enabled": True, "output_path": "out/"},
        comms_logger={"enabled": True, "verbose": True, "prof_all": False, "prof_ops": ["all_reduce"]},
    ))  # fmt: skip
    assert c.tensorboard.output_path == "/tmp/tb" and c.wandb.team == "t"
    assert c.csv_monitor.enabled and c.comms_logger.prof_ops == ("all_reduce",)
    error_of(cfg(wandb={"enabled": True, "entity": "x"}), "wandb.entity", "unknown key")
    error_of(cfg(tensorboard={"enabled": "yes"}), "tensorboard.enabled", "'yes'", "true or false")


def test_config_is_frozen() -> None:
    c = load_config(cfg())
    with pytest.raises(pydantic.ValidationError):
        c.train_batch_size = 4  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        c.zero_optimization.stage = 3  # type: ignore[misc]


# ----------------------------------------------------------------------------- key errors


def test_stage_out_of_range() -> None:
    error_of(cfg(zero_optimization={"stage": 4}), "zero_optimization.stage", "4 is not one of 0, 1, 2, 3")
    error_of(cfg(zero_optimization={"stage": "3"}), "zero_optimization.stage", "'3'")


@pytest.mark.parametrize(
    "config,path,hint",
    [
        (cfg(zero_optimization={"reduce_bucket_sise": 1}), "zero_optimization.reduce_bucket_sise",
         "did you mean 'reduce_bucket_size'?"),
        (cfg(train_batch_sise=8), "train_batch_sise", "did you mean 'train_batch_size'?"),
        (cfg(zero_optimization={"offload_param": {"device": "cpu", "pin_memry": True}}),
         "zero_optimization.offload_param.pin_memry", "did you mean 'pin_memory'?"),
        (cfg(fp16={"enabled": True, "initial_scale_pwr": 8}), "fp16.initial_scale_pwr",
         "did you mean 'initial_scale_power'?"),
        (cfg(cuda_visible_devices=0), "cuda_visible_devices", "unknown key"),
    ],
)  # fmt: skip
def test_unknown_keys_name_path_and_nearest_key(config: dict, path: str, hint: str) -> None:
    error_of(config, path, "unknown key", hint)


@pytest.mark.parametrize(
    "config,path,fragments",
    [
        (cfg(gradient_clipping="1.0"), "gradient_clipping", ("'1.0'", "not a number")),
        (cfg(steps_per_print=-1), "steps_per_print", ("-1", ">= 0")),
        (cfg(zero_optimization={"reduce_bucket_size": 5.5}), "zero_optimization.reduce_bucket_size",
         ("5.5", "not an integer")),
        (cfg(zero_optimization={"contiguous_gradients": 1}), "zero_optimization.contiguous_gradients",
         ("1", "true or false")),
        (cfg(fp16=[]), "fp16", ("[]", "JSON object")),
        (cfg(zero_optimization={"offload_optimizer": {"device": "gpu"}}),
         "zero_optimization.offload_optimizer.device", ("'gpu'", "'none', 'cpu', 'nvme'")),
        (cfg(checkpoint={"tag_validation": "loud"}), "checkpoint.tag_validation",
         ("'loud'", "'Warn', 'Ignore', 'Fail'")),
        (cfg(pipeline={"schedule": "zigzag"}), "pipeline.schedule", ("'zigzag'", "'1f1b'")),
        (cfg(pipeline={"stages": 0}), "pipeline.stages", ("0", "positive integer or 'auto'")),
        (cfg(pipeline={"partition": "best"}), "pipeline.partition", ("'best'", "'uniform'")),
        (cfg(pipeline={"schedule": "interleaved_1f1b"}), "pipeline.virtual_stages", (">= 2",)),
        (cfg(comms_logger={"prof_ops": "all_reduce"}), "comms_logger.prof_ops", ("JSON list",)),
        (cfg(gradient_predivide_factor=0), "gradient_predivide_factor", ("out of range", "reciprocal")),
        (cfg(optimizer={"type": "Adam", "params": [1]}), "optimizer.params", ("JSON object",)),
        (cfg(optimizer={"params": {}}), "optimizer.type", ("missing",)),
        (cfg(gradient_allreduce_op="max"), "gradient_allreduce_op", ("'max'", "'mean', 'sum'")),
    ],
)  # fmt: skip
def test_bad_values_name_path_value_and_allowed(config: dict, path: str, fragments: tuple) -> None:
    error_of(config, path, *fragments)


def test_integral_floats_are_ints() -> None:
    zero = {"stage": 3, "reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7,
            "sub_group_size": 1e9, "offload_param": {"device": "cpu", "buffer_size": 1e8}}  # fmt: skip
    z = load_config(cfg(zero_optimization=zero)).zero_optimization
    assert z.reduce_bucket_size == 500_000_000 and isinstance(z.reduce_bucket_size, int)
    assert z.stage3_prefetch_bucket_size == 50_000_000 and z.sub_group_size == 10**9
    assert z.offload_param is not None and z.offload_param.buffer_size == 10**8
    assert load_config({"train_batch_size": 32.0}).train_batch_size == 32


# ----------------------------------------------------------------------------- removed / not yet


@pytest.mark.parametrize("path", sorted(REMOVED_KEYS))
def test_removed_keys(path: str) -> None:
    *parents, leaf = path.split(".")
    config: dict[str, Any] = cfg()
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = {"enabled": False}  # removed keys are refused even when off, as in DeepSpeed
    error_of(config, path, "removed in DeepSpeed and not supported by zerospeed")


def test_documented_removed_keys_are_in_the_table() -> None:
    for key in ("amp", "sparse_attention", "elasticity",
                "progressive_layer_drop", "curriculum_learning", "eigenvalue", "quantize_training"):
        assert key in REMOVED_KEYS  # fmt: skip


NOT_YET_CASES = [
    ("data_efficiency", {"enabled": True}, {"enabled": False, "data_routing": {"x": 1}}),
    ("zero_optimization.zenflow", {"topk_ratio": 0.1}, None),
    ("aio.use_gds", True, False),
    ("checkpoint.writer", {"type": "fast"}, None),
]


def _with(path: str, value: Any) -> dict[str, Any]:
    config: dict[str, Any] = cfg()
    *parents, leaf = path.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return config


@pytest.mark.parametrize("path,on,off", NOT_YET_CASES, ids=[c[0] for c in NOT_YET_CASES])
def test_not_yet_supported_features(path: str, on: Any, off: Any) -> None:
    error_of(_with(path, on), path, "not supported by zerospeed yet")
    load_config(_with(path, off))  # present but disabled: accepted and ignored


# ----------------------------------------------------------------------------- "auto"


def test_auto_batch_sizes_mean_not_given() -> None:
    c = load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto",
                     "gradient_accumulation_steps": "auto"}, dp_world_size=4)  # fmt: skip
    assert (c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (8, 1)
    error_of({"train_micro_batch_size_per_gpu": "auto"}, "train_micro_batch_size_per_gpu",
             "'auto' cannot be resolved outside the HF Trainer")  # fmt: skip
    error_of({"train_batch_size": "auto"}, "train_batch_size", "'auto' cannot be resolved")


def test_auto_tuning_knobs_resolve_to_defaults() -> None:
    zero = {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": "auto",
            "overlap_comm": "auto", "stage3_gather_16bit_weights_on_model_save": "auto",
            "offload_param": {"device": "cpu", "buffer_size": "auto"}}  # fmt: skip
    c = load_config(cfg(zero_optimization=zero, steps_per_print="auto", aio={"queue_depth": "auto"}))
    z = c.zero_optimization
    assert z.reduce_bucket_size == 500_000_000 and z.stage3_prefetch_bucket_size == 50_000_000
    assert z.stage3_param_persistence_threshold == 100_000 and z.overlap_comm is True
    assert z.offload_param is not None and z.offload_param.buffer_size == 100_000_000
    assert c.steps_per_print == 10 and c.aio.queue_depth == 8
    assert load_config(cfg(pipeline={"stages": "auto"})).pipeline.stages == "auto"


@pytest.mark.parametrize(
    "config,path",
    [
        (cfg(optimizer={"type": "AdamW", "params": {"lr": "auto"}}), "optimizer.params.lr"),
        (cfg(optimizer={"type": "AdamW", "params": {"betas": "auto"}}), "optimizer.params.betas"),
        (cfg(optimizer={"type": "AdamW", "params": {"weight_decay": "auto"}}),
         "optimizer.params.weight_decay"),
        (cfg(scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}),
         "scheduler.params.warmup_max_lr"),
        (cfg(gradient_clipping="auto"), "gradient_clipping"),
        (cfg(fp16={"enabled": "auto"}), "fp16.enabled"),
        (cfg(bf16={"enabled": "auto"}), "bf16.enabled"),
    ],
)  # fmt: skip
def test_auto_that_changes_the_math_is_an_error(config: dict, path: str) -> None:
    error_of(config, path, "'auto' cannot be resolved outside the HF Trainer")


def test_auto_elsewhere_is_an_error() -> None:
    error_of(cfg(zero_optimization={"stage": "auto"}), "zero_optimization.stage", "'auto' is not accepted")


# ----------------------------------------------------------------------------- batch triple


@pytest.mark.parametrize(
    "given,dp,expected",
    [
        ({"train_batch_size": 32}, 4, (32, 8, 1)),
        ({"train_micro_batch_size_per_gpu": 4}, 2, (8, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2, (32, 8, 2)),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
          "gradient_accumulation_steps": 2}, 2, (16, 4, 2)),
    ],
)  # fmt: skip
def test_batch_triple_derivation(given: dict, dp: int, expected: tuple) -> None:
    c = load_config(given, dp_world_size=dp)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == expected


def test_batch_triple_inconsistent() -> None:
    given = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    err = error_of(given, "train_batch_size", dp=2)
    assert str(err) == (
        "zerospeed config: train_batch_size: 32 != train_micro_batch_size_per_gpu 4 * "
        "gradient_accumulation_steps 2 * data-parallel world size 2 = 16"
    )


@pytest.mark.parametrize(
    "given,dp,fragment",
    [
        ({"train_batch_size": 30}, 4, "30 is not divisible by gradient_accumulation_steps 1 * "
                                      "data-parallel world size 4 = 4"),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 3}, 2,
         "32 is not divisible by train_micro_batch_size_per_gpu 3 * data-parallel world size 2 = 6"),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 3}, 1, "not divisible"),
        ({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 8}, 1, "not divisible"),
        ({"gradient_accumulation_steps": 2}, 1, "neither train_batch_size nor"),
        ({}, 1, "neither train_batch_size nor"),
    ],
)  # fmt: skip
def test_batch_triple_errors(given: dict, dp: int, fragment: str) -> None:
    error_of(given, "train_batch_size", fragment, dp=dp)


@pytest.mark.parametrize("key", ["train_batch_size", "train_micro_batch_size_per_gpu",
                                 "gradient_accumulation_steps"])  # fmt: skip
@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "8"])
def test_batch_values_must_be_positive_ints(key: str, bad: Any) -> None:
    given = {"train_batch_size": 8, key: bad}
    error_of(given, key, repr(bad))


# ----------------------------------------------------------------------------- aliases, legacy


def test_bfloat16_alias_section() -> None:
    c = load_config(cfg(bfloat16={"enabled": True}))
    assert c.bf16.enabled and c.precision == "bf16"
    assert load_config(cfg(bf16={"enabled": True}, bfloat16={"enabled": True})).bf16.enabled
    error_of(cfg(bf16={"enabled": True}, bfloat16={"enabled": False}), "bfloat16", "alias of 'bf16'")


@pytest.mark.parametrize("alias", ["gather_16bit_weights_on_model_save",
                                   "stage3_gather_fp16_weights_on_model_save"])  # fmt: skip
def test_gather_16bit_aliases(alias: str) -> None:
    z = load_config(cfg(zero_optimization={"stage": 3, alias: True})).zero_optimization
    assert z.stage3_gather_16bit_weights_on_model_save is True
    error_of(cfg(zero_optimization={alias: "x"}), f"zero_optimization.{alias}", "'x'")


def test_other_aliases() -> None:
    c = load_config(cfg(aio={"intra_op_parallelism": 4},
                        zero_optimization={"prefetch_bucket_size": 7, "max_live_parameters": 9}))  # fmt: skip
    assert c.aio.thread_count == 4
    assert c.zero_optimization.stage3_prefetch_bucket_size == 7
    assert c.zero_optimization.stage3_max_live_parameters == 9
    assert load_config(cfg(aio={"thread_count": 2, "intra_op_parallelism": 2})).aio.thread_count == 2
    error_of(cfg(aio={"thread_count": 2, "intra_op_parallelism": 3}), "aio.intra_op_parallelism",
             "give only one")  # fmt: skip


def test_deprecated_cpu_offload() -> None:
    z = load_config(cfg(zero_optimization={"stage": 2, "cpu_offload": True})).zero_optimization
    assert z.offload_optimizer is not None and z.offload_optimizer.device == "cpu"
    zero = {"stage": 3, "cpu_offload_param": True, "cpu_offload_use_pin_memory": True}
    z = load_config(cfg(zero_optimization=zero)).zero_optimization
    assert z.offload_param is not None and z.offload_param.pin_memory is True
    off = load_config(cfg(zero_optimization={"cpu_offload": False}))
    assert off.zero_optimization.offload_optimizer is None
    error_of(cfg(zero_optimization={"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}),
             "zero_optimization.cpu_offload", "offload_optimizer")  # fmt: skip


def test_legacy_boolean_zero_optimization() -> None:
    assert load_config(cfg(zero_optimization=True)).zero_optimization.stage == 1
    assert load_config(cfg(zero_optimization=False)).zero_optimization.stage == 0


@pytest.mark.parametrize(
    "spelling,canonical",
    [("float32", "fp32"), ("fp32", "fp32"), ("float16", "fp16"), ("fp16", "fp16"),
     ("bfloat16", "bf16"), ("BF16", "bf16")],
)  # fmt: skip
def test_communication_data_type_spellings(spelling: str, canonical: str) -> None:
    assert load_config(cfg(communication_data_type=spelling)).communication_data_type == canonical


# ----------------------------------------------------------------------------- precision


def test_precision_property_and_exclusivity() -> None:
    assert load_config(cfg(fp16={"enabled": True})).precision == "fp16"
    assert load_config(cfg(bf16={"enabled": True})).precision == "bf16"
    error_of(cfg(fp16={"enabled": True}, bf16={"enabled": True}), "fp16.enabled", "bf16.enabled")


def test_bf16_master_weight_rules() -> None:
    ok = cfg(bf16={"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
             zero_optimization={"stage": 2})  # fmt: skip
    assert load_config(ok).bf16.bf16_optimizer_states is True
    error_of(cfg(bf16={"enabled": True, "bf16_optimizer_states": True}, zero_optimization={"stage": 2}),
             "bf16.bf16_optimizer_states", "bf16_master_weights_and_grads")  # fmt: skip
    error_of(cfg(bf16={"enabled": True, "bf16_master_weights_and_grads": True}),
             "bf16.bf16_master_weights_and_grads", "stage 1, 2 or 3")  # fmt: skip


# ----------------------------------------------------------------------------- optimizer, scheduler


@pytest.mark.parametrize("spelling,canonical", [("adam", "Adam"), ("ADAMW", "AdamW"), ("sgd", "SGD"),
                                                ("Adagrad", "Adagrad"), ("lamb", "Lamb")])  # fmt: skip
def test_optimizer_names_are_canonicalised(spelling: str, canonical: str) -> None:
    c = load_config(cfg(optimizer={"type": spelling, "params": {"lr": 1e-3, "betas": [0.9, 0.99]}}))
    assert c.optimizer is not None and c.optimizer.type == canonical
    assert c.optimizer.params == {"lr": 1e-3, "betas": [0.9, 0.99]}
    assert canonical in OPTIMIZER_NAMES


def test_optimizer_name_errors() -> None:
    error_of(cfg(optimizer={"type": "LBFGS"}), "optimizer.type", "'LBFGS'", "not supported by zerospeed yet")
    error_of(cfg(optimizer={"type": "SparseAdam"}), "optimizer.type", "not supported by zerospeed yet")
    error_of(cfg(optimizer={"type": "AdamX"}), "optimizer.type", "did you mean 'Adam")


def test_scheduler_names() -> None:
    assert set(SCHEDULER_NAMES) == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"}
    c = load_config(cfg(scheduler={"type": "warmupdecaylr", "params": {"total_num_steps": 10}}))
    assert c.scheduler is not None and c.scheduler.type == "WarmupDecayLR"
    error_of(cfg(scheduler={"type": "WarmupCosine"}), "scheduler.type", "did you mean 'WarmupCosineLR'?")
    error_of(cfg(scheduler={"type": "StepLR"}), "scheduler.type", "not supported by zerospeed yet")


# ----------------------------------------------------------------------------- offload


def test_offload_rules() -> None:
    error_of(cfg(zero_optimization={"stage": 3, "offload_optimizer": {"device": "nvme"}}),
             "zero_optimization.offload_optimizer.nvme_path", "nvme")  # fmt: skip
    error_of(cfg(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}}),
             "zero_optimization.offload_param.nvme_path")  # fmt: skip
    nvme = {"device": "nvme", "nvme_path": "/local_nvme"}
    z = load_config(cfg(zero_optimization={"stage": 3, "offload_param": nvme})).zero_optimization
    assert z.offload_param is not None and z.offload_param.nvme_path == "/local_nvme"
    for bad in (0, 1.5, -0.1):
        error_of(cfg(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": bad}}),
                 "zero_optimization.offload_optimizer.ratio", "(0, 1]")  # fmt: skip
    z2 = load_config(cfg(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}))
    assert z2.zero_optimization.offload_optimizer is not None and z2.zero_optimization.offload_optimizer.ratio == 0.5
    z = load_config(cfg(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}))
    assert z.zero_optimization.offload_optimizer is not None
    assert z.zero_optimization.offload_optimizer.ratio == 0.3


# ----------------------------------------------------------------------------- sources, re-resolve


def test_dict_input_is_not_mutated_and_raw_is_kept() -> None:
    given = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": 16, "bfloat16": {"enabled": True},
             "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "cpu_offload": True,
                                   "gather_16bit_weights_on_model_save": True},
             "aio": {"thread_count": 1, "intra_op_parallelism": 1},
             "autotuning": {"enabled": False}}  # fmt: skip
    before = copy.deepcopy(given)
    c = load_config(given, dp_world_size=2)
    assert given == before and c.raw == before
    c.raw["train_batch_size"] = 0  # a copy: the config's own raw dict is unaffected
    assert c.raw == before


def test_re_resolve_for_another_world_size() -> None:
    c1 = load_config({"train_batch_size": 32, "gradient_accumulation_steps": 2})
    assert c1.train_micro_batch_size_per_gpu == 16
    c4 = load_config(c1, dp_world_size=4)
    triple = (c4.train_batch_size, c4.train_micro_batch_size_per_gpu, c4.gradient_accumulation_steps)
    assert triple == (32, 4, 2)
    assert c4.dp_world_size == 4 and c1.train_micro_batch_size_per_gpu == 16
    error_of(c1, "train_batch_size", "not divisible", dp=3)


def test_json_file_paths(tmp_path: Path) -> None:
    good = tmp_path / "ds.json"
    good.write_text(json.dumps({"train_batch_size": 8, "fp16": {"enabled": True}}))
    assert load_config(good).precision == "fp16"
    assert load_config(str(good), dp_world_size=2).train_micro_batch_size_per_gpu == 4

    missing = tmp_path / "nope.json"
    error_of(missing, str(missing), "no such file")
    error_of(str(tmp_path), str(tmp_path), "directory")

    broken = tmp_path / "broken.json"
    broken.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,}\n}\n')
    error_of(broken, str(broken), "invalid JSON at line 3:")

    duplicate = tmp_path / "dup.json"
    duplicate.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    error_of(duplicate, str(duplicate), "duplicate key 'train_batch_size'")

    not_object = tmp_path / "list.json"
    not_object.write_text("[1, 2]")
    error_of(not_object, "", "JSON object")


def test_bad_arguments() -> None:
    error_of(42, "", "expected a dict")
    error_of(cfg(), "", "dp_world_size", dp=0)
