"""The launcher's table of commands: what ``zerospeed <command> ...`` and ``zerospeed --autotuning ...`` run.

The launcher is the lowest floor: it imports nothing above it, so it cannot know the commands built on top of
it (``zerospeed serve``, the autotuner). They register here instead, from one place at the top,
:mod:`zerospeed.cli`, which the package root runs on import: every way into the launcher (the ``zerospeed``
console script, ``python -m zerospeed.launcher.runner``, ``zerospeed.launcher.runner.main(argv)``) imports the
package first and so finds the table filled.

Two kinds of entries:

* a **command** takes the whole command line: ``zerospeed serve MODEL_DIR ...`` calls the ``serve`` entry with
  ``["MODEL_DIR", ...]`` and exits with its status;
* a **launch hook** takes over a launch once the launcher flags are parsed and the torchrun command is built:
  ``--autotuning tune|run`` calls the ``autotuning`` hook with ``(args, argv, torchrun_argv)``.

Registering a name twice replaces the entry (the last registration wins, as a re-import would).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Command = Callable[[Sequence[str]], int]
LaunchHook = Callable[[Any, list[str], list[str]], int]

_COMMANDS: dict[str, Command] = {}
_LAUNCH_HOOKS: dict[str, LaunchHook] = {}


def register_command(name: str, run: Command) -> None:
    """``zerospeed NAME ARGS...`` runs ``run(ARGS)`` and exits with what it returns."""
    _COMMANDS[name] = run


def register_launch_hook(flag: str, run: LaunchHook) -> None:
    """A launch with the launcher flag ``--FLAG`` set runs ``run(args, argv, torchrun_argv)`` instead of torchrun."""
    _LAUNCH_HOOKS[flag] = run


def command(name: str) -> Command | None:
    return _COMMANDS.get(name)


def launch_hook(flag: str) -> LaunchHook | None:
    return _LAUNCH_HOOKS.get(flag)


def command_names() -> list[str]:
    return sorted(_COMMANDS)


__all__ = ["command", "command_names", "launch_hook", "register_command", "register_launch_hook"]
