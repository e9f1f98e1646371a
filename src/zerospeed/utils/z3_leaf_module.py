"""DeepSpeed's ZeRO-3 leaf modules (``deepspeed.utils.set_z3_leaf_modules`` and its companions).

A leaf module is gathered as a whole: at its forward (and before its backward) every parameter of its subtree is
gathered at once, and no module below it is hooked. Mixture-of-experts blocks need this: their experts run in a
data-dependent order, different on every rank and every step, which per-module gathering cannot follow (zerospeed's
watchdog would report ranks calling different modules). Accelerate calls ``set_z3_leaf_modules`` for the classes named
in ``transformer_moe_cls_names``; transformers and TRL scripts call it for MoE models.

The flag is kept in zerospeed's ZeRO-3 registry (keyed by module, weakly), not on the module, and is read when an
engine builds its buckets: set it before ``deepspeed.initialize`` (as in DeepSpeed, where hooks are installed then).
Setting it on a model whose engine already exists warns that it takes effect for engines built afterwards.
"""

from __future__ import annotations

import sys
import types
import warnings
from typing import Union

import torch
from torch import nn

from zerospeed.zero.stage3 import registry

ClassList = Union[list[type], list[str]]


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` is flagged as a ZeRO-3 leaf module."""
    return registry.is_leaf(model)


def z3_leaf_parameter(model: torch.nn.Parameter) -> bool:
    """Whether a parameter belongs to a module flagged as a leaf (directly or below it)."""
    return any(any(p is model for p in leaf.parameters()) for leaf in registry.leaf_modules())


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` flagged as leaves."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Flag (or unflag) ``model`` itself."""
    _warn_if_built(model)
    registry.set_leaf(model, flag)


def _qualified(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _matches(module: nn.Module, wanted: ClassList) -> bool:
    for cls in wanted:
        if isinstance(cls, type) and isinstance(module, cls):
            return True
        if isinstance(cls, str) and cls in (type(module).__name__, _qualified(module)):
            return True
    return False


def _set(model: nn.Module, leaf_module_classes: ClassList, flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    if not isinstance(leaf_module_classes, (list, tuple)) or \
            not all(isinstance(c, (type, str)) for c in leaf_module_classes):
        raise ValueError(f"leaf_module_classes must be a list of types or names, got {leaf_module_classes!r}")
    found = [m for m in model.modules() if _matches(m, list(leaf_module_classes))]
    if not found and raise_if_not_found:
        raise ValueError(f"No modules of type {list(leaf_module_classes)} found in model {type(model).__name__}")
    for m in found:
        set_z3_leaf_module(m, flag)
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: ClassList,
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Flag every module of ``model`` that is an instance of (or whose class is named as) one of
    ``leaf_module_classes``; returns them. None found: ``ValueError`` unless ``raise_if_not_found=False``."""
    return _set(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: ClassList,
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """Remove the flag from those modules; returns them."""
    return _set(model, leaf_module_classes, False, raise_if_not_found)


def _by(model: nn.Module, keys: list[str], flag: bool, raise_if_not_found: bool, match: str
        ) -> tuple[list[nn.Module], list[str]]:
    named = list(model.named_modules())
    found: list[nn.Module] = []
    missing: list[str] = []
    for key in keys:
        hits = [m for n, m in named if (n == key if match == "name" else n.endswith(key))]
        if not hits:
            missing.append(key)
        for m in hits:
            if all(m is not f for f in found):
                found.append(m)
    if missing and raise_if_not_found:
        what = "named" if match == "name" else "matching suffixes"
        raise ValueError(f"No modules {what} {missing} found in model {type(model).__name__}")
    for m in found:
        set_z3_leaf_module(m, flag)
    return found, missing


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: list[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules named (as ``named_modules()`` names them); returns (modules, names not found)."""
    return _by(model, module_names, flag, raise_if_not_found, "name")


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: list[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules whose ``named_modules()`` name ends with one of the suffixes."""
    return _by(model, module_name_suffixes, flag, raise_if_not_found, "suffix")


def _warn_if_built(module: nn.Module) -> None:
    for p in module.parameters():
        found = registry.lookup(p)
        if found is not None and getattr(found[0].owner, "plans", None) is not None:
            warnings.warn(f"set_z3_leaf_modules: {type(module).__name__} already belongs to a ZeRO-3 engine, whose "
                          "hooks were installed when it was built; the leaf flag takes effect for engines built after "
                          "this call (call it before deepspeed.initialize)", UserWarning, stacklevel=3)
            return


__all__ = ["get_z3_leaf_modules", "set_z3_leaf_module", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter"]


class _CallableModule(types.ModuleType):
    """``deepspeed.utils.z3_leaf_module`` is both this module's path and, as an attribute of ``deepspeed.utils``, the
    function ``z3_leaf_module`` (DeepSpeed's package re-binds the name). Importing a submodule sets it as an attribute
    of its package, so ``zerospeed.utils.z3_leaf_module`` may be this module: calling it calls the function."""

    def __call__(self, model: nn.Module) -> bool:
        return z3_leaf_module(model)


sys.modules[__name__].__class__ = _CallableModule
