"""Keys DeepSpeed has removed, and DeepSpeed features zerospeed does not build yet.

Both checks run on the raw dict before schema validation, so the user sees *why* a key is
refused instead of a generic "unknown key".

Removed keys (``REMOVED_KEYS``) are refused whatever their value, exactly as current DeepSpeed
refuses them (``_reject_removed_config_keys`` in ``deepspeed/runtime/config.py``).  Sources, found
with the search tool:

* ``deepspeed/runtime/config.py`` (master, 2026): ``_REMOVED_TOP_LEVEL_CONFIG_KEYS`` = nebula,
  compression_training, amp, quantize_training, sparse_gradients, eigenvalue, sparse_attention,
  elasticity, graph_harvesting, curriculum_learning (legacy top-level form), progressive_layer_drop;
  ``_REMOVED_ZERO_CONFIG_KEYS`` = mics_shard_size, mics_hierarchical_params_gather,
  zeropp_loco_param.  Tracking issue deepspeedai/DeepSpeed#8489.
* ``compression_training`` is on that list but zerospeed rebuilds it
  (:mod:`zerospeed.config.compression`, :mod:`zerospeed.compression`), so it is not refused here.
* DeepSpeed release v0.19.8 notes: "Deprecate leftovers of compression library" (#8535, which also
  rejects ``eigenvalue`` next to ``quantize_training``), "Deprecate loco zero++" (#8534),
  "Deprecate sparse_gradients" (#8504), "Deprecate APEX amp" (#8564), "Deprecate legacy curriculum
  learning" (#8566), "Remove Progressive Layer Dropping" (#8562), "Remove elastic training" (#8563);
  the compression library itself went in #8490 and sparse attention in #8493.

Not-yet-supported features (``NOT_YET``) are DeepSpeed keys whose feature zerospeed has not built.
Decision: such a key is refused only when it would turn the feature *on*; a section that is present
but off (``"enabled": false``, a degree of 1, ``false``/``null``
flags) is accepted and dropped, because it asks for nothing zerospeed lacks.
"""

from __future__ import annotations

from typing import Any, Callable

from .errors import ConfigError

REMOVED_PROBLEM = "removed in DeepSpeed and not supported by zerospeed"
NOT_YET_PROBLEM = "not supported by zerospeed yet"

#: dotted key path -> short hint shown after the problem (may be empty).
REMOVED_KEYS: dict[str, str] = {
    "amp": "use 'fp16' or 'bf16' instead of Apex AMP",
    "quantize_training": "",
    "eigenvalue": "",
    "sparse_attention": "",
    "sparse_gradients": "",
    "elasticity": "set the batch sizes directly",
    "progressive_layer_drop": "",
    "curriculum_learning": "the legacy top-level form",
    "graph_harvesting": "",
    "nebula": "",
    "zero_optimization.mics_shard_size": "MiCS",
    "zero_optimization.mics_hierarchical_params_gather": "MiCS",
    "zero_optimization.zeropp_loco_param": "LoCo-ZeRO++",
}


def _falsy(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == {} or value == []


def _enabled_off(value: Any) -> bool:
    """Off unless the section says ``"enabled": <truthy>`` (DeepSpeed's default is disabled)."""
    if isinstance(value, dict):
        return _falsy(value.get("enabled", False))
    return _falsy(value)


def _datastates_off(value: Any) -> bool:
    """DeepSpeed 0.19.8 (``datastates/config.py``) turns DataStates on whenever ``datastates_ckpt`` is present and
    not ``false``, whatever the section holds (even ``{"enabled": false}``); ``null`` is taken as off here."""
    return value is None or value is False


def _timers_off(value: Any) -> bool:
    if not isinstance(value, dict):
        return _falsy(value)
    return all(_enabled_off(v) if isinstance(v, dict) else _falsy(v) for v in value.values())


def _managed(value: Any) -> bool:
    """``managed_gradient_accumulation``: DeepSpeed 0.19.8's default ``true`` (zerospeed's windows) asks for nothing."""
    return value is None or value is True


#: (dotted key path, "is this value off?", short note). Order = order of reporting.
NOT_YET: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("data_efficiency", _enabled_off, "data efficiency: curriculum sampling, random-LTD"),
    ("weight_quantization", _falsy, "weight quantization"),
    ("comet", _enabled_off, "the Comet monitor"),
    ("trackio", _enabled_off, "the Trackio monitor"),
    ("datastates_ckpt", _datastates_off, "DataStates checkpointing"),
    ("timers", _timers_off, "throughput timers"),
    ("zero_optimization.zenflow", _falsy, "ZenFlow"),
    ("zero_optimization.leaf_module", _falsy, "ZeRO-3 leaf modules"),
    ("zero_optimization.offload_optimizer.super_offload", _falsy, "SuperOffload"),
    ("aio.use_gds", _falsy, "GPUDirect Storage"),
    ("checkpoint.writer", _falsy, "the decoupled/fast checkpoint writer"),
    ("managed_gradient_accumulation", _managed, "false: every step() ends a window; set the windows with "
     "engine.set_gradient_accumulation_boundary or engine.no_sync instead"),
)


def _lookup(raw: dict[str, Any], path: str) -> tuple[dict[str, Any] | None, str]:
    """The dict that would hold ``path``'s last key (or None if an intermediate is absent)."""
    *parents, leaf = path.split(".")
    node: Any = raw
    for key in parents:
        node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return None, leaf
    return node, leaf


def reject_removed(raw: dict[str, Any]) -> None:
    """Raise :class:`ConfigError` for the first key DeepSpeed itself has removed."""
    for path, hint in REMOVED_KEYS.items():
        holder, leaf = _lookup(raw, path)
        if holder is not None and leaf in holder:
            problem = f"{REMOVED_PROBLEM} ({hint})" if hint else REMOVED_PROBLEM
            raise ConfigError(path, problem)


def drop_disabled_or_reject_unsupported(raw: dict[str, Any]) -> None:
    """Remove not-yet-supported sections that are off; raise for the first one that is on.

    Mutates ``raw`` (the loader's private deep copy, never the caller's dict).
    """
    for path, is_off, what in NOT_YET:
        holder, leaf = _lookup(raw, path)
        if holder is None or leaf not in holder:
            continue
        if not is_off(holder[leaf]):
            raise ConfigError(path, f"{NOT_YET_PROBLEM} ({what})")
        del holder[leaf]
