"""``import zerospeed.as_deepspeed`` (first, before Accelerate / Transformers / TRL / PEFT): zerospeed is ``deepspeed``.

The in-process twin of ``zerospeed-as-deepspeed COMMAND``: see :mod:`zerospeed.deepspeed_alias`. Importing
this module is the opt-in; nothing else in zerospeed switches the alias on. ``DIRECTORY`` is the generated
folder on ``sys.path`` and ``PYTHONPATH``.
"""

from __future__ import annotations

from zerospeed.deepspeed_alias.activate import activate

DIRECTORY = activate()

__all__ = ["DIRECTORY"]
