"""ZeRO sharding strategies (stages 0-3) and DeepSpeed's ``deepspeed.zero`` user API.

``zerospeed.zero.Init``, ``GatheredParameters``, ``register_external_parameter`` and
``unregister_external_parameter`` are DeepSpeed's names (and ``ZeroParamStatus``, the ``ds_status`` values of
stage-3 parameters: :mod:`zerospeed.zero.stage3.param_view`); they load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Init": "zerospeed.zero.init",
    "GatheredParameters": "zerospeed.zero.init",
    "register_external_parameter": "zerospeed.zero.init",
    "unregister_external_parameter": "zerospeed.zero.init",
    "is_partitioned": "zerospeed.zero.init",
    "ZeroParamStatus": "zerospeed.zero.stage3.param_view",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zerospeed.zero' has no attribute {name!r}")
