"""The launcher's last words when workers fail: one short block, and the full tracebacks in a log file.

torchrun's agent reports a failed worker group as a ``ChildFailedError`` holding one ``ProcessFailure`` per failed
rank, each with the error file the worker wrote (:mod:`zerospeed.launcher.script_wrapper` writes it in torch's
``@record`` format). From these :func:`summarize` makes the block printed last (at most ``MAX_GROUPS`` distinct
errors, so a config error raised on 64 ranks is still three lines)::

    zerospeed: train.py failed on ranks 0-1 of the 2 that ran
      ConfigError: zerospeed config: zero_optimization.stage: 7 is not one of 0, 1, 2, 3
        at /home/me/train.py:12 in main
      full tracebacks: /tmp/torchelastic_ab12/4f..._x/attempt_0/failures.log

Ranks that raised the same exception (type, message and place in the user's script) are one entry. A rank that
died from a signal or exited with a status but no exception says so. :func:`write_log` writes every failed rank's
traceback (``extraInfo.py_callstack``) to ``failures.log`` next to the ranks' own ``<local_rank>/error.json``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from typing import Any

MAX_GROUPS = 3
MAX_MESSAGE_CHARS = 400
LOG_NAME = "failures.log"


def format_ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    ranks = sorted(set(ranks))
    start = prev = None
    for r in ranks + [None]:  # type: ignore[list-item]
        if start is not None and (r is None or r != prev + 1):
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if r is not None and start is None:
            start = r
        prev = r
    return ", ".join(out)


def _info(failure: Any) -> dict[str, Any] | None:
    """zerospeed's part of the error file (``extraInfo.zerospeed``), else torch's ``message`` as type+message."""
    message = failure.message
    if not isinstance(message, Mapping):
        return None
    extra = message.get("extraInfo", {}) or {}
    ours = extra.get("zerospeed")
    if isinstance(ours, Mapping):
        return dict(ours)
    text = str(message.get("message", ""))  # written by torch's own @record in the user's script
    kind, _, rest = text.partition(": ")
    return {"type": kind, "message": rest, "where": None}


def _describe(failure: Any) -> tuple[str, ...]:
    """The lines that describe one rank's failure; equal tuples group ranks together."""
    info = _info(failure)
    if info is None:
        if failure.exitcode < 0:
            try:
                name = signal.Signals(-failure.exitcode).name
            except ValueError:
                name = f"signal {-failure.exitcode}"
            hint = " (out of memory?)" if name == "SIGKILL" else ""
            return (f"killed by {name}{hint}",)
        return (f"exited with status {failure.exitcode} without an exception (its own output is above)",)
    message = " ".join(str(info.get("message", "")).split())  # one line, however the exception wrote it
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    lines = [f"{info.get('type') or 'Exception'}: {message}" if message else str(info.get("type"))]
    where = info.get("where")
    if isinstance(where, Mapping) and where.get("file"):
        fn = f" in {where['function']}" if where.get("function") else ""
        lines.append(f"  at {where['file']}:{where.get('line')}{fn}")
    return tuple(lines)


def log_path(failures: Mapping[int, Any]) -> str | None:
    """``<run>/attempt_<n>/failures.log`` beside the ranks' error files, or ``None`` when no rank wrote one."""
    for failure in failures.values():
        if failure.error_file and os.path.isfile(failure.error_file):
            return os.path.join(os.path.dirname(os.path.dirname(failure.error_file)), LOG_NAME)
    return None


def write_log(failures: Mapping[int, Any], path: str) -> None:
    """Every failed rank's traceback (or what is known of its end), in rank order."""
    parts = []
    for rank in sorted(failures):
        f = failures[rank]
        message = f.message
        if isinstance(message, Mapping):
            body = (message.get("extraInfo", {}) or {}).get("py_callstack") or str(message.get("message", ""))
        else:
            body = str(message) or "\n".join(_describe(f))
        parts.append(f"===== rank {rank} (local rank {f.local_rank}, pid {f.pid}, exit code {f.exitcode}) =====\n"
                     f"{body.rstrip()}\n")
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fp:
        fp.write("\n".join(parts))
    os.replace(tmp, path)


def summarize(program: str, failures: Mapping[int, Any], num_ranks: int | None = None,
              log: str | None = None) -> list[str]:
    """The block the launcher prints last (see the module docstring)."""
    groups: dict[tuple[str, ...], list[int]] = {}
    order = sorted(failures, key=lambda r: (failures[r].timestamp, r))  # first observed failure first
    for rank in order:
        groups.setdefault(_describe(failures[rank]), []).append(rank)
    of = f" of the {num_ranks} that ran" if num_ranks else ""
    noun = "rank" if len(failures) == 1 else "ranks"
    lines = [f"zerospeed: {program} failed on {noun} {format_ranks(list(failures))}{of}"]
    items = list(groups.items())
    for description, ranks in items[:MAX_GROUPS]:
        who = "" if len(groups) == 1 else f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}: "
        lines.append(f"  {who}{description[0]}")
        lines.extend(f"  {line}" for line in description[1:])
    if len(items) > MAX_GROUPS:
        rest = sorted(r for _, ranks in items[MAX_GROUPS:] for r in ranks)
        lines.append(f"  ... and other errors on ranks {format_ranks(rest)} (see the log)")
    if log is not None:
        lines.append(f"  full tracebacks: {log}")
    return lines


__all__ = ["LOG_NAME", "MAX_GROUPS", "format_ranks", "log_path", "summarize", "write_log"]
