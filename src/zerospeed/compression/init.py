"""``init_compression``: wrap the modules a ``compression_training`` config names, in place.

Module patterns are regular expressions searched in the module's dotted name (``re.search``), as in
DeepSpeed; ``"*"`` matches every module.  Only modules of a kind a technique applies to are wrapped:
weight quantization and sparse pruning: Linear, HF Conv1D, Conv2d, Embedding; activation quantization:
Linear, Conv1D, Conv2d; row and head pruning: Linear, Conv1D; channel pruning: Conv2d.  A group whose
patterns match no such module is an error that lists the model's module names (a silent no-op was
DeepSpeed's most confusing failure).

Call it before ``zerospeed.initialize`` (so the optimizer and ZeRO see the wrapped layers and the
learnable ``topk`` scores); the engine then advances the schedule at each optimizer step.
``quantize_weight_in_forward: false`` is treated like ``true``: zerospeed always quantizes in the
forward pass (decision: DeepSpeed's in-place variant rewrote master weights and silently did
nothing under ZeRO, where the master is a flat shard).

Tensor parallelism (see :mod:`.tp` for the semantics), in either order:

* split first (DeepSpeed's order with a Megatron ``mpu``): ``tp_model_init(model, tp)`` or
  ``auto_tp(model, group)``, then ``init_compression(model, config, mpu=...)``: AutoTP's column / row
  layers are wrapped with shard-aware compression; ``mpu`` may be omitted (each tp layer knows its
  group), and when given its group must be the layers'.  Given an ``mpu`` of tp > 1 and a model
  that is not split yet, init_compression splits it first with AutoTP over the mpu's group.
* compress first: ``init_compression(model, config)`` on the whole model, then ``initialize`` with
  ``tensor_parallel.autotp_size`` (or an ``mpu``): before training, ``initialize`` unwraps the layers,
  splits the model and applies the same compression to the split layers (:func:`split_compressed`).

The vocabulary-parallel LM head and tied input embedding are not compressed under tp: a pattern
that matches one is an error naming it.
"""

from __future__ import annotations

import os
import re
from typing import Any

from torch import nn

from zerospeed.config import ConfigError, ZeroSpeedConfig, load_section
from zerospeed.config.compression import CompressionConfig

from .layers import ActQuantSpec, CompressedLayer, PruneSpec, WeightQuantSpec, kind_of
from .reduction import reduce_layers
from .scheduler import _SCHEDULERS, CompressionScheduler, scheduler_of
from .tp import is_tp_linear, is_unsupported_tp, tp_group_of

ALL = ("linear", "conv1d", "conv2d", "embedding")
APPLIES_TO = {
    "weight_quantization": ALL,
    "activation_quantization": ("linear", "conv1d", "conv2d"),
    "sparse_pruning": ALL,
    "row_pruning": ("linear", "conv1d"),
    "head_pruning": ("linear", "conv1d"),
    "channel_pruning": ("conv2d",),
}
_SHOWN_NAMES = 40


def compression_section(config: Any) -> CompressionConfig | None:
    """The parsed ``compression_training`` section of a DeepSpeed config (dict, path or parsed)."""
    if isinstance(config, CompressionConfig):
        return config
    if isinstance(config, ZeroSpeedConfig):
        return config.compression_training
    if not isinstance(config, (dict, str, os.PathLike)):
        raise ConfigError("", f"expected a DeepSpeed config dict, JSON path or ZeroSpeedConfig, got "
                              f"{type(config).__name__}")
    return load_section(config, "compression_training")


def matches(name: str, patterns: list[str]) -> bool:
    return any(p == "*" or re.search(p, name) for p in patterns)


def _listing(model: nn.Module) -> str:
    names = [n for n, _ in model.named_modules() if n]
    shown = ", ".join(names[:_SHOWN_NAMES])
    more = f", ... ({len(names) - _SHOWN_NAMES} more)" if len(names) > _SHOWN_NAMES else ""
    return f"{shown}{more}"


def _matched(model: nn.Module, key: str, patterns: list[str], kinds: tuple[str, ...],
             excluded: list[str] = ()) -> list[str]:
    refused = [n for n, m in model.named_modules() if n and is_unsupported_tp(m) and matches(n, patterns)
               and not matches(n, list(excluded))]
    if refused:
        raise ConfigError(key, f"{patterns} match {refused[0]}, a vocabulary-parallel {type(model.get_submodule(refused[0])).__name__} "
                               "under tensor parallelism, which compression does not support; narrow the pattern "
                               "(or add it to excluded_modules)")
    found = [n for n, m in model.named_modules() if n and kind_of(m) in kinds and matches(n, patterns)
             and not matches(n, list(excluded))]
    if not found:
        raise ConfigError(key, f"{patterns} match no {'/'.join(kinds)} module of the model; its modules are: "
                               f"{_listing(model)}")
    return found


def _wrap(model: nn.Module, name: str, layers: dict[str, CompressedLayer]) -> CompressedLayer:
    if name in layers:
        return layers[name]
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    layer = CompressedLayer(getattr(parent, child), name)
    setattr(parent, child, layer)
    layers[name] = layer
    return layer


def init_compression(model: nn.Module, deepspeed_config: Any, teacher_model: nn.Module | None = None,
                     mpu: Any = None) -> nn.Module:
    """Apply ``compression_training`` to ``model`` in place and return it.

    ``teacher_model`` is used by layer reduction (the student's kept layers are copied from the
    teacher's ``teacher_layer`` layers; without a teacher the model's own layer list is cut down to
    those layers).  ``mpu``: the tensor-parallel groups (see the module docstring).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"init_compression: model must be a torch.nn.Module, got {type(model).__name__}")
    if scheduler_of(model) is not None:
        raise ValueError("init_compression: this model is already compressed")
    cfg = compression_section(deepspeed_config)
    if cfg is None:
        raise ConfigError("compression_training", "the config has no compression_training section")
    tp = tp_group_of(mpu, "init_compression") if mpu is not None else None
    if cfg.layer_reduction.enabled:
        reduce_layers(model, cfg.layer_reduction, teacher_model)
    if tp is not None:
        _check_mpu(model, *tp)
    return _compress(model, cfg)


def _check_mpu(model: nn.Module, group: Any, size: int, rank: int) -> None:
    """The model's tp layers must use the mpu's group; an unsplit model is split over it (tp > 1)."""
    from zerospeed.module_inject import auto_tp

    tp_layers = [(n, m) for n, m in model.named_modules() if is_tp_linear(m) or is_unsupported_tp(m)]
    if not tp_layers:
        if size > 1:
            auto_tp(model, group)
        return
    for name, layer in tp_layers:
        if layer.tp_size != size or layer.tp_rank != rank or (group is not None and layer.tp_group is not group
                                                             and comm_ranks(layer.tp_group) != comm_ranks(group)):
            raise ValueError(f"init_compression: {name} is split over a tensor-parallel group of {layer.tp_size} ranks "
                             f"(rank {layer.tp_rank}) other than the mpu's ({size} ranks, rank {rank})")


def comm_ranks(group: Any) -> list[int]:
    from zerospeed import comm

    return list(comm.get_all_ranks_from_group(group)) if group is not None else list(range(comm.get_world_size()))


def split_compressed(model: nn.Module, tp_group: Any, tp_config: Any = None) -> nn.Module:
    """Split a model compressed whole (``init_compression`` before ``initialize``) over ``tp_group``:
    the compressed layers are unwrapped (their Parameters go back to the original modules), AutoTP
    splits the model and the same compression is applied to the split layers.  Only before training
    (the schedule at step 0), since the masks and ranges are rebuilt from the weights."""
    from zerospeed.module_inject import auto_tp

    scheduler = scheduler_of(model)
    if scheduler is None:
        return auto_tp(model, tp_group, partition_config=tp_config)
    if scheduler.training_steps:
        raise ValueError(f"tensor parallelism: the compressed model has trained {scheduler.training_steps} steps "
                         "already; split it before training (initialize it with tensor_parallel from the start)")
    for name, layer in scheduler.layers.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer.original)
    _SCHEDULERS.pop(model, None)
    auto_tp(model, tp_group, partition_config=tp_config)
    return _compress(model, scheduler.config)


def _compress(model: nn.Module, cfg: CompressionConfig) -> nn.Module:
    root = "compression_training"
    layers: dict[str, CompressedLayer] = {}

    wq = cfg.weight_quantization
    if wq.shared_parameters.enabled:
        sp = wq.shared_parameters
        for gname, group in wq.different_groups.items():
            key = f"{root}.weight_quantization.different_groups.{gname}.modules"
            for name in _matched(model, key, group.modules, APPLIES_TO["weight_quantization"]):
                mix = sp.fp16_mixed_quantize
                spec = WeightQuantSpec(
                    group.params.start_bits, group.params.target_bits, group.params.quantization_period,
                    sp.schedule_offset, sp.quantize_groups, sp.quantization_type == "symmetric",
                    sp.rounding == "stochastic", mix.quantize_change_ratio if mix.enabled else None)
                layer = _wrap(model, name, layers)
                try:
                    layer.add_weight_quant(spec)
                except ValueError as exc:
                    raise ConfigError(f"{root}.weight_quantization.shared_parameters.quantize_groups", str(exc)) from None
    aq = cfg.activation_quantization
    if aq.shared_parameters.enabled:
        sp = aq.shared_parameters
        for gname, group in aq.different_groups.items():
            key = f"{root}.activation_quantization.different_groups.{gname}.modules"
            for name in _matched(model, key, group.modules, APPLIES_TO["activation_quantization"]):
                _wrap(model, name, layers).add_act_quant(ActQuantSpec(
                    group.params.bits, sp.quantization_type == "symmetric", sp.range_calibration == "static",
                    sp.schedule_offset))
    for section, what in (("sparse_pruning", "sparse"), ("row_pruning", "row"), ("head_pruning", "head"),
                          ("channel_pruning", "channel")):
        tech = getattr(cfg, section)
        sp = tech.shared_parameters
        if not sp.enabled:
            continue
        excluded = getattr(sp, "excluded_modules", [])
        for gname, group in tech.different_groups.items():
            key = f"{root}.{section}.different_groups.{gname}.modules"
            spec = PruneSpec(sp.method, group.params.dense_ratio, sp.schedule_offset)
            if what == "sparse":
                rows, cols = (int(v) for v in sp.block_pattern.split("x"))
                spec.offset_end, spec.stride = sp.schedule_offset_end, sp.schedule_offset_stride
                spec.block = (rows, cols) if sp.method == "snip_momentum" else (1, 1)
            if what == "head":
                spec.num_heads = sp.num_heads
            spec.related = [list(r) for r in (group.related_modules or [])]
            for name in _matched(model, key, group.modules, APPLIES_TO[section], excluded):
                _wrap(model, name, layers).add_pruning(what, spec)
    CompressionScheduler(model, layers, cfg)
    return model
