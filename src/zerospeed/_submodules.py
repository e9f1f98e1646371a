"""Submodules reachable as attributes, as after ``import deepspeed`` (issue #27).

``import deepspeed`` imports most of its module tree eagerly, so a script may write
``deepspeed.runtime.utils.set_random_seed(...)`` after the top-level import alone. zerospeed keeps ``import zerospeed``
light (submodules load on first use) and gets the same attribute chains by giving each package a module-level
``__getattr__`` (PEP 562) built here: an attribute that is not a name of the package but is one of its submodules
imports that submodule and returns it. Names starting with ``_`` are never looked up (dunder probes stay cheap), and a
name that is neither raises the usual ``AttributeError``.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable


def lazy_submodules(package: str, names: Callable[[str], Any] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``names(name)`` first (the package's own lazy names, which raises
    ``AttributeError`` for a name it does not know), then the submodule ``package.name`` if there is one."""

    def __getattr__(name: str) -> Any:
        if names is not None:
            try:
                return names(name)
            except AttributeError:
                pass
        if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


__all__ = ["lazy_submodules"]
