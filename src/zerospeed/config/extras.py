"""Optional dependencies: a missing one is one line naming the ``pip install 'zerospeed[extra]'`` to run.

Each optional package belongs to one extra of ``pyproject.toml`` (``tests/test_extras.py`` checks this table
against it). :func:`require` imports a module of such a package; when the package is not installed at all it raises
:class:`MissingExtraError`, whose message names the feature that needs it and the install line. A package that is
installed but fails to import (a broken install, a missing shared library) raises its own error unchanged: that is a
real error, not a missing extra.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

#: top-level import name -> (distribution on PyPI, zerospeed's extra that installs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "transformers": ("transformers", "hf"),
    "accelerate": ("accelerate", "hf"),
    "tokenizers": ("tokenizers", "hf"),
    "jinja2": ("jinja2", "hf"),
    "fastapi": ("fastapi", "serve"),
    "uvicorn": ("uvicorn", "serve"),
    "prometheus_client": ("prometheus_client", "serve"),
    "llguidance": ("llguidance", "serve"),
    "tensorboard": ("tensorboard", "monitor"),
    "wandb": ("wandb", "monitor"),
    "matplotlib": ("matplotlib", "monitor"),
    "optuna": ("optuna", "autotune"),
    "sklearn": ("scikit-learn", "autotune"),
    "torchao": ("torchao", "quant"),
}


class MissingExtraError(ImportError):
    """An optional package is not installed; the message is one line with the install command."""


def missing_message(package: str, feature: str) -> str:
    dist, extra = EXTRAS[package]
    return f"{feature} needs {dist}, which is not installed: pip install 'zerospeed[{extra}]'"


def check(*packages: str, feature: str) -> None:
    """Raise :class:`MissingExtraError` for the first of ``packages`` (top-level names in :data:`EXTRAS`) that is
    not installed."""
    for package in packages:
        if package not in EXTRAS:
            raise KeyError(f"zerospeed.config.extras: {package!r} is not an optional dependency (EXTRAS)")
        if importlib.util.find_spec(package) is None:
            raise MissingExtraError(missing_message(package, feature)) from None


def require(module: str, feature: str) -> ModuleType:
    """``import module`` (e.g. ``"optuna"``, ``"sklearn.ensemble"``), after :func:`check` of its package."""
    check(module.split(".", 1)[0], feature=feature)
    return importlib.import_module(module)


__all__ = ["EXTRAS", "MissingExtraError", "check", "missing_message", "require"]
