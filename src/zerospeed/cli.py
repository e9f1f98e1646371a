"""zerospeed's command-line entry points, in one table at the top of the package.

``zerospeed`` (the console script, :func:`zerospeed.launcher.runner.main`) is the launcher; the commands built on
the layers above it register in the launcher's table (:mod:`zerospeed.launcher.commands`) from here, so the
launcher imports none of them (issue #34: the lowest floor's launcher knew the top floor's commands):

============================  =================================================================
``zerospeed serve ...``       the OpenAI-compatible server (:func:`zerospeed.inference.serving.cli.main`)
``zerospeed --autotuning ..`` search the config, then train with the best (:func:`zerospeed.autotuning.cli.main`)
============================  =================================================================

:func:`register` runs when the package is imported (``zerospeed/__init__.py``); each entry imports its command
only when it runs, so registering costs nothing. :func:`main` is the same dispatcher as the console script.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from zerospeed.launcher import commands


def serve(argv: Sequence[str]) -> int:
    """``zerospeed serve ARGS``."""
    from zerospeed.config.extras import MissingExtraError

    try:
        from zerospeed.inference.serving.cli import main as serve_main
    except MissingExtraError as err:  # fastapi / uvicorn absent: the install line, not a traceback (issue #33)
        print(f"zerospeed serve: error: {err}", file=sys.stderr)
        return 2
    return serve_main(list(argv))


def autotune(args: Any, argv: list[str], torchrun_argv: list[str]) -> int:
    """``zerospeed --autotuning tune|run ...``: experiments, then (run) training with the optimal config."""
    from zerospeed.autotuning.cli import main as autotune_main

    return autotune_main(args, argv, torchrun_argv)


#: command name -> entry (``zerospeed NAME ...``)
COMMANDS = {"serve": serve}
#: launcher flag -> entry that takes over the launch (``zerospeed --FLAG ...``)
LAUNCH_HOOKS = {"autotuning": autotune}


def register() -> None:
    """Fill the launcher's table (idempotent)."""
    for name, run in COMMANDS.items():
        commands.register_command(name, run)
    for flag, hook in LAUNCH_HOOKS.items():
        commands.register_launch_hook(flag, hook)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``zerospeed`` command: a registered command, or a launch."""
    register()
    from zerospeed.launcher.runner import main as launch

    return launch(argv)


__all__ = ["COMMANDS", "LAUNCH_HOOKS", "main", "register"]
