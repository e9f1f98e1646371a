"""``deepspeed.a.b`` is the module ``zerospeed.a.b``: a meta-path finder that hands back zerospeed's own module.

The loader's ``create_module`` imports ``zerospeed.a.b`` and returns that very object, and ``exec_module``
runs nothing, so ``sys.modules["deepspeed.a.b"] is sys.modules["zerospeed.a.b"]``: one module, one set of
classes, whichever name imported it first. The import system keeps the module's own ``__name__`` and
``__spec__`` (it sets missing attributes only), so pickles, ``repr`` and tracebacks name zerospeed.

A path zerospeed does not build is refused in ``find_spec`` with a ``ModuleNotFoundError`` of one line that
names the DeepSpeed module and the zerospeed module it would be, rather than served by a stand-in.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any, Sequence

PREFIX = "deepspeed."


def target_of(fullname: str) -> str:
    return "zerospeed." + fullname[len(PREFIX):]


class AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``deepspeed.*`` submodules from ``zerospeed.*`` (the top package is the generated file)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None) -> Any:
        if not fullname.startswith(PREFIX):
            return None
        zname = target_of(fullname)
        try:
            zspec = importlib.util.find_spec(zname)
        except ModuleNotFoundError:
            zspec = None
        if zspec is None:
            raise ModuleNotFoundError(f"zerospeed-as-deepspeed: DeepSpeed module {fullname!r} is not built by "
                                      f"zerospeed (no module {zname!r})", name=fullname)
        return importlib.machinery.ModuleSpec(fullname, self, origin=zspec.origin,
                                              is_package=zspec.submodule_search_locations is not None)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(target_of(spec.name))

    def exec_module(self, module: ModuleType) -> None:
        return None  # zerospeed's module already ran


def install() -> AliasFinder:
    """Put the finder first on ``sys.meta_path`` (once per process) and return it."""
    for finder in sys.meta_path:
        if isinstance(finder, AliasFinder):
            return finder
    finder = AliasFinder()
    sys.meta_path.insert(0, finder)
    return finder


__all__ = ["AliasFinder", "install", "target_of"]
