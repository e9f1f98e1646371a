"""DeepSpeed's ``deepspeed.utils`` names: ``logger``, ``log_dist``, ``RepeatingLoader``.

``logger`` is the ``"zerospeed"`` logger that the engine also writes to. Decision: DeepSpeed's
logger prints INFO to the console out of the box; so that ``logger.info(...)`` in a script shows
up the same way, importing this module gives the logger a console handler at INFO *only* when no
handler is configured for it anywhere (an application's own logging setup is left alone).
"""

from __future__ import annotations

from zerospeed.utils.logging import log_dist, logger
from zerospeed.utils.repeating_loader import RepeatingLoader

__all__ = ["RepeatingLoader", "log_dist", "logger"]


from zerospeed._submodules import lazy_submodules as _lazy_submodules

__getattr__ = _lazy_submodules(__name__)  # zerospeed.<package>.<submodule> after `import zerospeed` (issue #27)
