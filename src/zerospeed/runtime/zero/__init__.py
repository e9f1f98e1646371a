"""``zerospeed.runtime.zero``: DeepSpeed's module path ``deepspeed.runtime.zero`` (issue #27).

In DeepSpeed ``deepspeed.zero`` *is* ``deepspeed.runtime.zero``; here the names live in :mod:`zerospeed.zero` and this
package is a view of them under DeepSpeed's path, holding nothing of its own: ``Init``, ``GatheredParameters``,
``register_external_parameter``, ``unregister_external_parameter``, ``ZeroParamStatus``, and the submodule
:mod:`~zerospeed.runtime.zero.partition_parameters` (which transformers' ``integrations/deepspeed.py`` and TRL
import). DeepSpeed names zerospeed does not build here (``TiledLinear``, ``DeepSpeedZeRoOffload``...) raise
``AttributeError``.
"""

from __future__ import annotations

from typing import Any

from zerospeed._submodules import lazy_submodules as _lazy_submodules

_FORWARDED = ("Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter",
              "ZeroParamStatus")

__all__ = list(_FORWARDED)


def _lazy_name(name: str) -> Any:
    if name in _FORWARDED:
        import zerospeed.zero

        return getattr(zerospeed.zero, name)
    raise AttributeError(f"module 'zerospeed.runtime.zero' has no attribute {name!r}")


__getattr__ = _lazy_submodules(__name__, _lazy_name)
