"""Is a real DeepSpeed importable? The alias refuses to shadow one unless forced.

"Real" means a ``deepspeed`` module or a ``deepspeed`` distribution that is not the alias: an imported
module whose file lacks the alias's marker, a ``deepspeed`` package found on ``sys.path`` (the alias's own
directory left out), or a ``deepspeed`` distribution whose version is not ``...+zerospeed...``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import os
import sys
from typing import Any, Iterable

from zerospeed.deepspeed_alias.names import MARKER


def _is_alias_file(path: str | None) -> bool:
    if not path or not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        return MARKER in f.read(512)


def is_alias_module(module: Any) -> bool:
    return _is_alias_file(getattr(module, "__file__", None))


def _real(path: str | None) -> str:
    return os.path.realpath(path or os.getcwd())


def real_deepspeed(exclude: Iterable[str] = (), search_path: list[str] | None = None) -> str | None:
    """Where a real DeepSpeed is importable (one phrase for an error line), or None.

    ``exclude``: directories left out of the search (the alias's own); ``search_path``: defaults to ``sys.path``.
    """
    module = sys.modules.get("deepspeed")
    if module is not None and not is_alias_module(module):
        return f"the imported module at {getattr(module, '__file__', None) or module!r}"
    skip = {_real(p) for p in exclude}
    paths = [p for p in (sys.path if search_path is None else search_path) if _real(p) not in skip]
    spec = importlib.machinery.PathFinder.find_spec("deepspeed", paths)
    if spec is not None:
        origin = spec.origin if spec.origin not in (None, "namespace") else None
        if origin is None and spec.submodule_search_locations:
            origin = list(spec.submodule_search_locations)[0]
        if not _is_alias_file(spec.origin):
            return f"the package at {origin}"
    for dist in importlib.metadata.distributions(name="deepspeed", path=paths):
        version = dist.metadata["Version"] or ""
        if "+zerospeed" not in version:
            return f"the distribution deepspeed {version} ({getattr(dist, '_path', '?')})"
    return None


__all__ = ["is_alias_module", "real_deepspeed"]
