"""``logger`` and ``log_dist`` (DeepSpeed's rank-filtered logging)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable

from zerospeed import comm

logger = logging.getLogger("zerospeed")


def configure_default_logger() -> logging.Logger:
    """DeepSpeed's logger prints INFO out of the box (its own level, whatever the root logger's): so does ours.

    Issue #33: ``steps_per_print`` printed nothing when the script had set up logging itself (``basicConfig()``
    leaves the root at WARNING, and our logger, level unset, inherited it). Now the ``"zerospeed"`` logger gets
    level INFO whenever its level is unset (a level the application set is kept), and a console handler
    (stdout) only when no handler exists for it anywhere: an application's own handlers, with their format,
    print our records. Runs when this module is imported, which the engine does.
    """
    if not logger.hasHandlers():
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d] %(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    return logger


configure_default_logger()


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the listed ranks (``-1`` in ``ranks`` means every rank).

    As in DeepSpeed: before ``init_distributed`` every process logs; afterwards only the ranks
    listed (``ranks=None`` or ``[]`` logs nowhere), each line prefixed with ``[Rank N]``.
    """
    wanted = list(ranks or [])
    if not comm.is_initialized():
        rank, should = -1, True
    else:
        rank = comm.get_rank()
        should = bool(wanted) and (wanted[0] == -1 or rank in set(wanted))
    if should:
        logger.log(level, "[Rank %d] %s", rank, message, stacklevel=2)  # the caller's file:line, not this one
