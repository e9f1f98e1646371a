"""ZeRO stage 3: partitioned parameters gathered around each module's forward and backward.

See :mod:`zerospeed.zero.stage3.strategy` for the overview. Import-light: submodules load on use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Stage3Strategy": "zerospeed.zero.stage3.strategy",
    "Stage3Bucket": "zerospeed.zero.stage3.bucket",
    "ZeroCollectiveDivergence": "zerospeed.zero.stage3.watchdog",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zerospeed.zero.stage3' has no attribute {name!r}")
