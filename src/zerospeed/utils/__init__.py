"""DeepSpeed's ``deepspeed.utils`` names: ``logger``, ``log_dist``, ``RepeatingLoader``; the tensor-fragment API
(``safe_get_full_grad``...: :mod:`zerospeed.utils.tensor_fragment`) and ZeRO-3 leaf modules (``set_z3_leaf_modules``...:
:mod:`zerospeed.utils.z3_leaf_module`), loaded on first use since they sit above zero/ (see LAYERS).

``logger`` is the ``"zerospeed"`` logger that the engine also writes to. Decision: DeepSpeed's
logger prints INFO to the console out of the box; so that ``logger.info(...)`` in a script shows
up the same way, importing this module gives the logger a console handler at INFO *only* when no
handler is configured for it anywhere (an application's own logging setup is left alone).
"""

from __future__ import annotations

from zerospeed.utils.init_on_device import OnDevice
from zerospeed.utils.logging import log_dist, logger
from zerospeed.utils.repeating_loader import RepeatingLoader

__all__ = ["OnDevice", "RepeatingLoader", "log_dist", "logger"]


import importlib as _importlib

from zerospeed._submodules import lazy_submodules as _lazy_submodules

_LAZY = {
    "tensor_fragment": ("safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
                        "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
                        "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
                        "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
                        "safe_update_full_grad_vectorized"),
    "z3_leaf_module": ("set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
                       "z3_leaf_parameter", "set_z3_leaf_module", "set_z3_leaf_modules_by_name",
                       "set_z3_leaf_modules_by_suffix"),
}
_LAZY_NAME = {name: module for module, names in _LAZY.items() for name in names}


def _lazy_name(name: str):
    if name not in _LAZY_NAME:
        raise AttributeError(name)
    return getattr(_importlib.import_module(f"{__name__}.{_LAZY_NAME[name]}"), name)


# zerospeed.<package>.<submodule> after `import zerospeed` (issue #27), and the names above
__getattr__ = _lazy_submodules(__name__, _lazy_name)
