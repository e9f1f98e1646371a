"""Which ZeRO strategy holds a parameter's sharded state: a process-wide, weak map (nothing on the parameter).

:func:`zerospeed.zero.factory.build_strategy` registers each strategy's managed parameters (stages 0-2: the bucketed
trainable ones; stage 3: all of them); :func:`strategy_of` answers for DeepSpeed's tensor-fragment API
(``deepspeed.utils.safe_get_full_grad`` and its companions, :mod:`zerospeed.utils.tensor_fragment`), which is given a
parameter alone. Entries hold both sides weakly, so neither a model nor an engine is kept alive by this table; a
parameter wrapped by a newer engine answers with the newer one.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

_owners: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def register(strategy: Any, params: Iterable[Any]) -> None:
    owner = weakref.ref(strategy)
    for p in params:
        key = id(p)

        def drop(ref: weakref.ref, key: int = key) -> None:
            entry = _owners.get(key)
            if entry is not None and entry[0] is ref:
                del _owners[key]

        _owners[key] = (weakref.ref(p, drop), owner)


def strategy_of(param: Any) -> Any | None:
    """The live strategy that manages ``param``, or None."""
    entry = _owners.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


__all__ = ["register", "strategy_of"]
