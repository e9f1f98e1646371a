"""Process-wide maps from live parameters / modules to ZeRO-3 state (nothing is stored on them).

* parameter -> (its :class:`~zerospeed.zero.stage3.bucket.Stage3Bucket`, slot position): filled by
  ``zero.Init`` and by the stage-3 strategy; read by ``GatheredParameters`` and by the strategy
  when it adopts a model that ``zero.Init`` already partitioned.
* module -> external parameters (``zero.register_external_parameter``): parameters a module's
  forward uses although another module owns them; the runtime gathers them around that forward.
* leaf modules (DeepSpeed's ``set_z3_leaf_modules``): a leaf's whole subtree is gathered at the leaf's forward and
  nothing below it is hooked (mixture-of-experts blocks, whose experts run in a data-dependent order). Read when an
  engine builds its buckets.

Adding a parameter also gives it DeepSpeed's read-only ``ds_*`` attributes, a view that reads this table
(:mod:`zerospeed.zero.stage3.param_view`), and a ``ds_id``: a number in the order parameters were first
partitioned, kept here (by parameter, weakly) so that re-bucketing keeps it.

Entries are keyed by ``id()`` and hold the parameter / module through a weak reference whose
callback removes the entry, so the registry never keeps a model alive. The registry holds buckets
strongly: a bucket lives as long as any of its parameters does (the bucket holds its parameters
weakly), which is what keeps a ``zero.Init`` model's shards alive until an engine adopts them.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable

from torch import nn

from zerospeed.zero.stage3 import param_view

_params: dict[int, tuple[weakref.ref, Any, int]] = {}
_external: dict[int, tuple[weakref.ref, list[weakref.ref]]] = {}
_listeners: "weakref.WeakSet[Any]" = weakref.WeakSet()
_ds_ids: dict[int, tuple[weakref.ref, int]] = {}
_leaves: dict[int, tuple[weakref.ref]] = {}
_next_ds_id = itertools.count()


def _dropper(table: dict[int, Any], key: int) -> Callable[[Any], None]:
    def drop(ref: weakref.ref) -> None:
        entry = table.get(key)
        if entry is not None and entry[0] is ref:
            del table[key]

    return drop


def add_bucket(bucket: Any) -> None:
    for pos, p in bucket.live_params():
        key = id(p)
        _params[key] = (weakref.ref(p, _dropper(_params, key)), bucket, pos)
        entry = _ds_ids.get(key)
        if entry is None or entry[0]() is not p:
            _ds_ids[key] = (weakref.ref(p, _dropper(_ds_ids, key)), next(_next_ds_id))
        param_view.adopt(p, lookup, ds_id)


def remove_bucket(bucket: Any) -> None:
    for key in [k for k, (_, b, _) in _params.items() if b is bucket]:
        del _params[key]


def lookup(param: Any) -> tuple[Any, int] | None:
    """The bucket holding ``param`` and its slot position, or None when it is not partitioned."""
    entry = _params.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1], entry[2]


def ds_id(param: Any) -> int | None:
    """DeepSpeed's ``ds_id`` of a parameter that was partitioned, or None."""
    entry = _ds_ids.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]


def add_external(module: nn.Module, param: nn.Parameter) -> None:
    key = id(module)
    entry = _external.get(key)
    if entry is None or entry[0]() is not module:
        entry = (weakref.ref(module, _dropper(_external, key)), [])
        _external[key] = entry
    if not any(r() is param for r in entry[1]):
        entry[1].append(weakref.ref(param))
    for listener in list(_listeners):
        listener.on_external_parameter(module, param)


def remove_external(module: nn.Module, param: nn.Parameter) -> None:
    entry = _external.get(id(module))
    if entry is None or entry[0]() is not module:
        return
    entry[1][:] = [r for r in entry[1] if r() is not None and r() is not param]
    for listener in list(_listeners):
        listener.on_external_parameter_removed(module, param)


def externals_of(module: nn.Module) -> list[nn.Parameter]:
    entry = _external.get(id(module))
    if entry is None or entry[0]() is not module:
        return []
    return [p for r in entry[1] if (p := r()) is not None]


def set_leaf(module: nn.Module, flag: bool) -> None:
    """Mark ``module`` as a ZeRO-3 leaf (``flag``) or unmark it."""
    key = id(module)
    if flag:
        _leaves[key] = (weakref.ref(module, _dropper(_leaves, key)),)
    else:
        _leaves.pop(key, None)


def is_leaf(module: nn.Module) -> bool:
    entry = _leaves.get(id(module))
    return entry is not None and entry[0]() is module


def leaf_modules() -> list[nn.Module]:
    """Every live module flagged as a leaf."""
    return [m for (ref,) in list(_leaves.values()) if (m := ref()) is not None]


def leaf_units(root: nn.Module) -> dict[int, nn.Module]:
    """``id(module) -> the outermost leaf module it is inside`` (a leaf maps to itself) for ``root``'s modules."""
    out: dict[int, nn.Module] = {}
    prefixes: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        owner = next((leaf for prefix, leaf in prefixes if prefix == "" or name.startswith(prefix)), None)
        if owner is None and is_leaf(module):
            owner = module
            prefixes.append((name + "." if name else "", module))
        if owner is not None:
            out[id(module)] = owner
    return out


def listen(listener: Any) -> None:
    """``listener.on_external_parameter(module, param)`` is called on every new registration."""
    _listeners.add(listener)
