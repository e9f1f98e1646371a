"""Raw-dict rewrites that run before schema validation: legacy forms, aliases and ``"auto"``.

All functions mutate the loader's private deep copy, never the caller's dict.

Decisions:

* Legacy forms DeepSpeed still reads are translated, not refused: ``"zero_optimization": true``
  means stage 1 (DeepSpeed's ``read_zero_config_deprecated``); ``cpu_offload: true`` means
  ``offload_optimizer: {"device": "cpu"}`` and ``cpu_offload_param: true`` means
  ``offload_param: {"device": "cpu"}`` (DeepSpeed ``zero/config.py``), with
  ``cpu_offload_use_pin_memory`` becoming their ``pin_memory``.  Giving a deprecated key and its
  replacement together is an error, as in DeepSpeed.
* An alias given together with its canonical key is accepted when both hold the same value (the
  DeepSpeed aio template lists both ``thread_count`` and ``intra_op_parallelism``) and refused when
  they differ.  Single aliases are resolved by the schema (pydantic ``AliasChoices``) so errors name
  the key the user wrote.
* ``"auto"`` (written by HuggingFace templates) is resolved here, by key:
  batch-size keys -> "not given" (the batch module derives them);
  tuning knobs in ``AUTO_TUNING_KNOBS`` -> removed, so zerospeed's default applies;
  keys that change the numerics (``AUTO_MATH_KEYS``, anything under optimizer/scheduler params)
  -> ConfigError, because only the HF Trainer can fill them in;
  anything else -> ConfigError saying ``"auto"`` is not accepted for that key.
  ``pipeline.stages`` and the ``fast_paths`` switches are exempt: ``"auto"`` is one of their
  ordinary values.
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

#: section path ("" = top level) -> canonical key -> aliases DeepSpeed also accepts.
ALIASES: dict[str, dict[str, tuple[str, ...]]] = {
    "": {"bf16": ("bfloat16",)},
    "aio": {"thread_count": ("intra_op_parallelism",)},
    "zero_optimization": {
        "stage3_gather_16bit_weights_on_model_save": (
            "gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
        ),
        "stage3_prefetch_bucket_size": ("prefetch_bucket_size",),
        "stage3_param_persistence_threshold": ("param_persistence_threshold",),
        "stage3_model_persistence_threshold": ("model_persistence_threshold",),
        "stage3_max_live_parameters": ("max_live_parameters",),
        "stage3_max_reuse_distance": ("max_reuse_distance",),
    },
}

_ZERO = "zero_optimization"
_OFFLOAD_KNOBS = ("buffer_count", "buffer_size", "max_in_cpu", "pin_memory", "fast_init")

#: dotted paths whose "auto" resolves to zerospeed's default (performance-only settings).
AUTO_TUNING_KNOBS: frozenset[str] = frozenset(
    ["steps_per_print", "wall_clock_breakdown", "memory_breakdown"]
    + [f"{_ZERO}.{k}" for k in (
        "reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
        "sub_group_size", "round_robin_gradients", "stage3_module_granularity_threshold",
        "stage3_partition_stream_chunk_size",
    )]
    + [f"{_ZERO}.{k}" for canon, aliases in ALIASES[_ZERO].items() for k in (canon, *aliases)]
    + [f"{_ZERO}.offload_optimizer.{k}" for k in _OFFLOAD_KNOBS]
    + [f"{_ZERO}.offload_param.{k}" for k in _OFFLOAD_KNOBS]
    + [f"aio.{k}" for k in (
        "block_size", "queue_depth", "thread_count", "intra_op_parallelism", "single_submit",
        "overlap_events",
    )]
    + [f"fp16.{k}" for k in (
        "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
        "min_loss_scale",
    )]
)  # fmt: skip

#: dotted paths (or prefixes ending in ".") whose "auto" would change the numerics.
AUTO_MATH_KEYS: tuple[str, ...] = (
    "optimizer.", "scheduler.", "gradient_clipping", "fp16.enabled", "fp16.loss_scale",
    "bf16.enabled", "bfloat16.enabled", "communication_data_type", "prescale_gradients",
    "gradient_predivide_factor",
)  # fmt: skip

_AUTO_VALUE_ALLOWED = frozenset({"pipeline.stages"})


def apply_legacy_forms(raw: dict[str, Any]) -> None:
    """Translate DeepSpeed's deprecated-but-read forms into their current spelling."""
    if raw.get("steps_per_print") == float("inf"):  # Accelerate writes inf for "never"; DeepSpeed takes it: 0 here
        raw["steps_per_print"] = 0
    zero = raw.get(_ZERO)
    if isinstance(zero, bool):
        raw[_ZERO] = {"stage": 1 if zero else 0}
        return
    if not isinstance(zero, dict):
        return
    pin = zero.pop("cpu_offload_use_pin_memory", None)
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if old not in zero:
            continue
        flag = zero.pop(old)
        if not isinstance(flag, bool):
            raise ConfigError(f"{_ZERO}.{old}", f"{flag!r} is not a boolean; use true or false")
        if flag and new in zero:
            raise ConfigError(
                f"{_ZERO}.{old}", f"deprecated form of '{new}'; give only '{_ZERO}.{new}'"
            )
        if flag:
            zero[new] = {"device": "cpu", "pin_memory": bool(pin)}


def merge_aliases(raw: dict[str, Any]) -> None:
    """Drop an alias that repeats its canonical key's value; refuse one that contradicts it."""
    for section, table in ALIASES.items():
        holder = raw.get(section) if section else raw
        if not isinstance(holder, dict):
            continue
        for canonical, aliases in table.items():
            present = [k for k in (canonical, *aliases) if k in holder]
            first = present[0] if present else None
            for extra in present[1:]:
                if holder[extra] != holder[first]:
                    where = f"{section}.{extra}" if section else extra
                    raise ConfigError(
                        where,
                        f"{holder[extra]!r} contradicts '{first}' = {holder[first]!r} "
                        f"('{extra}' is an alias of '{canonical}'); give only one of them",
                    )
                del holder[extra]


def _is_math(path: str) -> bool:
    return any(path.startswith(k) if k.endswith(".") else path == k for k in AUTO_MATH_KEYS)


def resolve_auto(raw: dict[str, Any]) -> tuple[str, ...]:
    """Resolve every ``"auto"`` value in place (see module docstring).

    Returns the batch-size keys that were ``"auto"`` (so a missing batch size can be explained).
    """
    auto_batch: list[str] = []

    def visit(node: Any, prefix: str) -> None:
        items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        for key, value in items:
            path = f"{prefix}{key}"
            if isinstance(value, (dict, list)):
                visit(value, f"{path}.")
                continue
            if not (isinstance(value, str) and value.lower() == "auto"):
                continue
            if path in _AUTO_VALUE_ALLOWED or path.startswith("fast_paths."):
                continue
            if path in BATCH_KEYS:
                auto_batch.append(path)
                del node[key]
            elif _is_math(path):
                raise ConfigError(
                    path, "'auto' cannot be resolved outside the HF Trainer; give a value"
                )
            elif path in AUTO_TUNING_KNOBS:
                del node[key]
            else:
                raise ConfigError(
                    path,
                    "'auto' is not accepted for this key (only for batch sizes and tuning "
                    "knobs); give a value",
                )

    visit(raw, "")
    return tuple(auto_batch)
