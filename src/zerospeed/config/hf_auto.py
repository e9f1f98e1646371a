"""HuggingFace ``"auto"`` values in a DeepSpeed config, filled from ``TrainingArguments`` (raw dict in, raw dict out).

Part of the parser (config/ is the one place that reads a config file or a raw config dict), used by the HF
Trainer integration; :mod:`zerospeed.integrations.hf_auto`, where it used to live, re-exports it.

The HF Trainer's DeepSpeed templates write ``"auto"`` wherever the value must agree with the
Trainer's own arguments. :func:`fill_auto` replaces each one with the argument's value, as HF does
for DeepSpeed, and refuses an explicit value that contradicts the arguments (the training loop would
otherwise run with one batch size / learning rate and the engine with another), naming the key and
the argument. The result is an ordinary DeepSpeed dict that :func:`zerospeed.config.load_config`
parses; keys not listed here keep zerospeed's own ``"auto"`` handling (tuning knobs take defaults).

Keys and sources (HF's): micro batch = ``per_device_train_batch_size``; accumulation =
``gradient_accumulation_steps``; ``train_batch_size`` = their product times the world size;
``gradient_clipping`` = ``max_grad_norm``; ``fp16.enabled`` / ``bf16.enabled`` = ``fp16`` / ``bf16``;
optimizer ``lr`` / ``betas`` / ``eps`` / ``weight_decay`` = ``learning_rate`` / ``(adam_beta1,
adam_beta2)`` / ``adam_epsilon`` / ``weight_decay``; scheduler ``warmup_min_lr`` = 0,
``warmup_max_lr`` = ``learning_rate``, ``warmup_num_steps`` = ``max(1, get_warmup_steps(max_steps))`` (as
transformers 5.24 fills it: DeepSpeed 0.19.8's WarmupLR refuses 0, then clamps to 2),
``total_num_steps`` = ``max_steps``; with a model ``hidden_size`` h: ``reduce_bucket_size`` = h*h,
``stage3_prefetch_bucket_size`` = 0.9*h*h, ``stage3_param_persistence_threshold`` = 10*h.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from .errors import ConfigError


def read_config(config: Any) -> dict[str, Any]:
    """A DeepSpeed config given as a dict or a JSON file path, as a fresh dict."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                value = json.load(f)
        except OSError as exc:
            raise ConfigError("", f"cannot read the DeepSpeed config file {str(config)!r}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError("", f"{str(config)!r} is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ConfigError("", f"{str(config)!r} does not hold a JSON object")
        return value
    raise ConfigError("", f"the DeepSpeed config must be a dict or a path to a JSON file, got {type(config).__name__}")


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.lower() == "auto"


def _set(holder: dict[str, Any], key: str, value: Any, path: str, source: str, must_match: bool = True) -> None:
    if key not in holder:
        return
    current = holder[key]
    if _is_auto(current):
        holder[key] = value
    elif must_match and current != value and not (isinstance(current, list) and tuple(current) == tuple(value)):
        raise ConfigError(path, f"{current!r} contradicts TrainingArguments.{source} = {value!r}; set it to "
                                f"\"auto\" or make the two agree")


def fill_auto(raw: Any, args: Any, max_steps: int, world_size: int, hidden_size: int | None = None) -> dict[str, Any]:
    """``raw`` with HF's ``"auto"`` values filled from ``args`` (a ``TrainingArguments``)."""
    cfg = read_config(raw)
    mbs, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    _set(cfg, "train_micro_batch_size_per_gpu", mbs, "train_micro_batch_size_per_gpu", "per_device_train_batch_size")
    _set(cfg, "gradient_accumulation_steps", gas, "gradient_accumulation_steps", "gradient_accumulation_steps")
    _set(cfg, "train_batch_size", mbs * gas * world_size, "train_batch_size",
         "per_device_train_batch_size * gradient_accumulation_steps * world size")
    # the loop and the engine must agree on these even when the config leaves them out
    cfg.setdefault("train_micro_batch_size_per_gpu", mbs)
    cfg.setdefault("gradient_accumulation_steps", gas)
    _set(cfg, "gradient_clipping", float(args.max_grad_norm), "gradient_clipping", "max_grad_norm")
    cfg.setdefault("gradient_clipping", float(args.max_grad_norm))
    for section, flag in (("fp16", bool(args.fp16)), ("bf16", bool(args.bf16))):
        if isinstance(cfg.get(section), dict):
            _set(cfg[section], "enabled", flag, f"{section}.enabled", section)
        elif flag:
            cfg[section] = {"enabled": True}
    opt = cfg.get("optimizer")
    if isinstance(opt, dict) and isinstance(opt.get("params"), dict):
        p = opt["params"]
        for key, value, source in (("lr", args.learning_rate, "learning_rate"),
                                   ("betas", [args.adam_beta1, args.adam_beta2], "adam_beta1 / adam_beta2"),
                                   ("eps", args.adam_epsilon, "adam_epsilon"),
                                   ("weight_decay", args.weight_decay, "weight_decay")):
            _set(p, key, value, f"optimizer.params.{key}", source)
    sched = cfg.get("scheduler")
    if isinstance(sched, dict) and isinstance(sched.get("params"), dict):
        p = sched["params"]
        for key, value, source in (("warmup_min_lr", 0.0, "(0)"), ("warmup_max_lr", args.learning_rate, "learning_rate"),
                                   ("warmup_num_steps", max(1, args.get_warmup_steps(max_steps)), "warmup_steps / _ratio"),
                                   ("total_num_steps", max_steps, "max_steps")):
            _set(p, key, value, f"scheduler.params.{key}", source, must_match=False)
    zero = cfg.get("zero_optimization")
    if isinstance(zero, dict) and hidden_size:
        h = int(hidden_size)
        for key, value in (("reduce_bucket_size", h * h), ("stage3_prefetch_bucket_size", int(0.9 * h * h)),
                           ("stage3_param_persistence_threshold", 10 * h)):
            _set(zero, key, value, f"zero_optimization.{key}", "(model hidden_size)", must_match=False)
    return cfg


__all__ = ["fill_auto", "read_config"]
