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
"""

from __future__ import annotations

import os
import re
from typing import Any

from torch import nn

from zerospeed.config import ConfigError, ZeroSpeedConfig, load_config
from zerospeed.config.compression import CompressionConfig
from zerospeed.config.loader import _read_json  # noqa: PLC2701 - the loader's JSON reader (one error style)

from .layers import ActQuantSpec, CompressedLayer, PruneSpec, WeightQuantSpec, kind_of
from .reduction import reduce_layers
from .scheduler import CompressionScheduler, scheduler_of

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
    if isinstance(config, (str, os.PathLike)):
        from pathlib import Path

        config = _read_json(Path(config).expanduser())
    if not isinstance(config, dict):
        raise ConfigError("", f"expected a DeepSpeed config dict, JSON path or ZeroSpeedConfig, got "
                              f"{type(config).__name__}")
    if "compression_training" not in config:
        return None
    return load_config({"train_batch_size": 1, "compression_training": config["compression_training"]}
                       ).compression_training


def matches(name: str, patterns: list[str]) -> bool:
    return any(p == "*" or re.search(p, name) for p in patterns)


def _listing(model: nn.Module) -> str:
    names = [n for n, _ in model.named_modules() if n]
    shown = ", ".join(names[:_SHOWN_NAMES])
    more = f", ... ({len(names) - _SHOWN_NAMES} more)" if len(names) > _SHOWN_NAMES else ""
    return f"{shown}{more}"


def _matched(model: nn.Module, key: str, patterns: list[str], kinds: tuple[str, ...],
             excluded: list[str] = ()) -> list[str]:
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
    those layers).  ``mpu`` (tensor-parallel groups) is not supported yet and must be None.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"init_compression: model must be a torch.nn.Module, got {type(model).__name__}")
    if mpu is not None:
        raise ValueError("init_compression: mpu (tensor parallelism) is not supported yet; pass None")
    if scheduler_of(model) is not None:
        raise ValueError("init_compression: this model is already compressed")
    cfg = compression_section(deepspeed_config)
    if cfg is None:
        raise ConfigError("compression_training", "the config has no compression_training section")
    root = "compression_training"
    if cfg.layer_reduction.enabled:
        reduce_layers(model, cfg.layer_reduction, teacher_model)
    layers: dict[str, CompressedLayer] = {}

    wq = cfg.weight_quantization
    if wq.shared_parameters.enabled:
        sp = wq.shared_parameters
        for gname, group in wq.different_groups.items():
            key = f"{root}.weight_quantization.different_groups.{gname}.modules"
            for name in _matched(model, key, group.modules, APPLIES_TO["weight_quantization"]):
                mix = sp.fp16_mixed_quantize
                _wrap(model, name, layers).add_weight_quant(WeightQuantSpec(
                    group.params.start_bits, group.params.target_bits, group.params.quantization_period,
                    sp.schedule_offset, sp.quantize_groups, sp.quantization_type == "symmetric",
                    sp.rounding == "stochastic", mix.quantize_change_ratio if mix.enabled else None))
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
    CompressionScheduler(model, layers)
    return model
