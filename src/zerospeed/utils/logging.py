"""``logger`` and ``log_dist`` (DeepSpeed's rank-filtered logging)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable

from zerospeed import comm

logger = logging.getLogger("zerospeed")
if not logger.hasHandlers():
    _handler = logging.StreamHandler(sys.stdout)
    _handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d] %(message)s"))
    logger.addHandler(_handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


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
        logger.log(level, "[Rank %d] %s", rank, message)
