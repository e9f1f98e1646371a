"""``import zerospeed.as_deepspeed``: the alias switched on inside a running interpreter (and for its children).

The generated directory (:mod:`~zerospeed.deepspeed_alias.layout`) goes first on ``sys.path`` and on
``PYTHONPATH`` (so processes this one starts - ``torchrun`` workers, ``accelerate launch`` - see it too), and
``deepspeed`` is imported once, which installs the finder. It is removed when the interpreter exits.

It refuses with one line when a real DeepSpeed is importable (unless ``ZEROSPEED_AS_DEEPSPEED_FORCE=1``), when
a real ``deepspeed`` module is already imported (it cannot be replaced then, forced or not), and when
Accelerate or Transformers' DeepSpeed integration was imported first: both decide at import time whether
DeepSpeed exists, so the switch must come before them.
"""

from __future__ import annotations

import atexit
import importlib
import os
import sys

from zerospeed.deepspeed_alias import guard, layout
from zerospeed.deepspeed_alias.names import DIR_ENV, FORCE_ENV

#: modules that look for DeepSpeed when they are imported
DECIDES_AT_IMPORT = ("accelerate", "transformers.integrations.deepspeed")

_active_dir: list[str] = []


def activate(force: bool | None = None) -> str:
    """Make ``import deepspeed`` give zerospeed in this process; returns the generated directory."""
    if _active_dir:
        return _active_dir[0]
    if force is None:
        force = os.environ.get(FORCE_ENV) == "1"
    module = sys.modules.get("deepspeed")
    if module is not None and not guard.is_alias_module(module):
        raise ImportError(f"zerospeed.as_deepspeed: a real DeepSpeed is already imported ({module.__file__}); "
                          "import zerospeed.as_deepspeed first, in a process without DeepSpeed")
    if not force:
        where = guard.real_deepspeed()
        if where is not None:
            raise ImportError(f"zerospeed.as_deepspeed: a real DeepSpeed is importable ({where}); uninstall it, or "
                              f"set {FORCE_ENV}=1 to shadow it with zerospeed")
    late = [name for name in DECIDES_AT_IMPORT if name in sys.modules]
    if late:
        raise ImportError(f"zerospeed.as_deepspeed: import it before {', '.join(late)} (already imported: "
                          "they look for DeepSpeed when they are imported)")
    root = layout.write()
    atexit.register(layout.remove, root)
    sys.path.insert(0, root)
    importlib.invalidate_caches()
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = root if not previous else root + os.pathsep + previous
    os.environ[DIR_ENV] = root
    if force:
        os.environ[FORCE_ENV] = "1"
    _active_dir.append(root)
    importlib.import_module("deepspeed")
    return root


__all__ = ["DECIDES_AT_IMPORT", "activate"]
