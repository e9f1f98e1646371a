"""The ``zerospeed`` launcher: DeepSpeed-style flags and hostfiles translated to torchrun.

See :mod:`zerospeed.launcher.runner` for the translation rules and
:mod:`zerospeed.launcher.hostfile` for the hostfile and ``--include``/``--exclude`` formats.
The runner's names are loaded lazily so that ``python -m zerospeed.launcher.runner`` does not
find the module already imported by its package (runpy warns about that).
"""

from __future__ import annotations

from typing import Any

from zerospeed.launcher.hostfile import (
    HostEntry,
    LaunchError,
    filter_hosts,
    parse_hostfile,
    parse_hostfile_text,
)

_RUNNER_NAMES = ("LaunchPlan", "build_plan", "main", "parse_args")

__all__ = [
    "HostEntry",
    "LaunchError",
    "LaunchPlan",
    "build_plan",
    "filter_hosts",
    "main",
    "parse_args",
    "parse_hostfile",
    "parse_hostfile_text",
]


def __getattr__(name: str) -> Any:
    if name in _RUNNER_NAMES:
        from zerospeed.launcher import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
