"""The top-level ``deepspeed`` module of the alias: DeepSpeed's top-level names, read from zerospeed.

The generated ``deepspeed/__init__.py`` calls :func:`install` with its namespace. ``deepspeed.X`` is
``zerospeed.X`` (an attribute of the package, or its submodule ``zerospeed.X``); ``__version__`` is the
alias's version (``0.19.8+zerospeed...``). A name zerospeed lacks raises ``AttributeError`` naming it.
Installing also switches ZeRO-3's ``state_dict()`` guard to DeepSpeed's behaviour (empty placeholders; see
:mod:`zerospeed.zero.stage3.state_dict_guard`).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from zerospeed.deepspeed_alias import finder, guard
from zerospeed.deepspeed_alias.names import FORCE_ENV, alias_version


def _getattr(name: str) -> Any:
    import zerospeed

    if name.startswith("__"):
        raise AttributeError(f"module 'deepspeed' has no attribute {name!r}")
    try:
        return getattr(zerospeed, name)
    except AttributeError:
        pass
    try:
        return importlib.import_module(f"deepspeed.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"deepspeed.{name}":
            raise
    raise AttributeError(f"zerospeed-as-deepspeed: DeepSpeed name 'deepspeed.{name}' is not built by zerospeed "
                         f"(zerospeed has no attribute or module {name!r})")


def _dir() -> list[str]:
    import zerospeed

    return sorted(set(zerospeed.__all__) | {"__version__"})


def install(namespace: dict[str, Any]) -> None:
    """Fill the generated ``deepspeed`` package's namespace; refuse when a real DeepSpeed is importable."""
    if os.environ.get(FORCE_ENV) != "1":
        own = os.path.dirname(os.path.dirname(os.path.abspath(namespace["__file__"])))
        where = guard.real_deepspeed(exclude=[own])
        if where is not None:
            raise ImportError(f"zerospeed-as-deepspeed: a real DeepSpeed is importable ({where}); uninstall it, or "
                              f"set {FORCE_ENV}=1 (zerospeed-as-deepspeed --force) to shadow it with zerospeed")
    finder.install()
    import zerospeed
    from zerospeed.zero.stage3 import state_dict_guard

    state_dict_guard.allow_placeholders()  # DeepSpeed's state_dict() at ZeRO-3 (HF reads it for the keys)

    namespace["__version__"] = alias_version()
    namespace["__version_zerospeed__"] = zerospeed.__version__
    namespace["__getattr__"] = _getattr
    namespace["__dir__"] = _dir
    namespace["__all__"] = list(zerospeed.__all__)


__all__ = ["install"]
