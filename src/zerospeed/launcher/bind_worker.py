"""Worker entry under ``--bind_cores_to_rank``: pin this process to its cores, then exec the script.

``python -m zerospeed.launcher.bind_worker [--module] SCRIPT ARGS...``; see
:mod:`zerospeed.launcher.binding` for the rule. ``exec`` keeps the script's ``python SCRIPT``
semantics (``sys.argv``, ``__main__``, ``sys.path[0]``) and the affinity is inherited.
"""

from __future__ import annotations

import os
import sys

from zerospeed.launcher.binding import CORES_ENV, NPROC_ENV, cores_for_rank
from zerospeed.launcher.hostfile import LaunchError


def main(argv: list[str]) -> None:
    module = bool(argv) and argv[0] == "--module"
    rest = argv[1:] if module else argv
    if not rest:
        raise SystemExit("zerospeed bind_worker: no script to run")
    try:
        cores = [int(c) for c in os.environ[CORES_ENV].split(",")]
        nproc = int(os.environ.get(NPROC_ENV) or os.environ.get("LOCAL_WORLD_SIZE", "1"))
        mine = cores_for_rank(cores, nproc, int(os.environ.get("LOCAL_RANK", "0")))
    except (KeyError, ValueError, LaunchError) as e:
        raise SystemExit(f"zerospeed bind_worker: {e}") from None
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))
    command = [sys.executable, *(["-m"] if module else []), *rest]
    sys.stdout.flush()
    os.execv(sys.executable, command)


if __name__ == "__main__":
    main(sys.argv[1:])
