"""Runs one worker's user script and records an uncaught exception in torchrun's error file.

The launcher starts every worker as ``python -u <this file> [--module] SCRIPT ARGS...`` (run by path, so nothing
is imported before the script: not zerospeed, not torch; only the standard library). The script runs as
``python SCRIPT ARGS`` would run it: ``sys.argv``, ``__main__``, ``sys.path[0]`` (the script's folder, or the current
folder with ``--module``) are the same.

When the script raises, the exception is written, as torch's ``@record`` decorator writes it
(:class:`torch.distributed.elastic.multiprocessing.errors.ErrorHandler`'s JSON: ``message`` and
``extraInfo.py_callstack`` / ``timestamp``), to the file torchrun's agent names in ``TORCHELASTIC_ERROR_FILE``,
plus one key of zerospeed's, ``extraInfo.zerospeed``: the exception's type and message and the innermost frame in
the user's own script (file, line, function). The traceback is not printed: the launcher reads every failed rank's
file and prints one short summary last, with the path of a log holding the full tracebacks
(:mod:`zerospeed.launcher.failures`). Without ``TORCHELASTIC_ERROR_FILE`` (the file run by hand) the exception
propagates as usual.

``SystemExit`` and ``KeyboardInterrupt`` are not recorded: they keep their meaning (the exit status, the signal).
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import sys
import time
import traceback

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
_SITE_DIRS = ("site-packages", "dist-packages")


def _user_frame(exc: BaseException, script: str | None) -> dict | None:
    """The innermost frame in ``script`` (by path), else the innermost outside the standard library, installed
    packages and zerospeed; for a syntax error, where the parser stopped; ``None`` when none of these exists."""
    frames = traceback.extract_tb(exc.__traceback__)
    if script is not None:
        inside = [f for f in frames if os.path.abspath(f.filename) == script]
        if inside:
            f = inside[-1]
            return {"file": f.filename, "line": f.lineno, "function": f.name}
    if isinstance(exc, SyntaxError) and exc.filename and os.path.abspath(exc.filename) == script:
        return {"file": exc.filename, "line": exc.lineno, "function": None}
    stdlib = os.path.dirname(os.__file__)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # zerospeed's own code is not the user's
    for f in reversed(frames):
        path = os.path.abspath(f.filename)
        if path.startswith(package + os.sep) or path.startswith(stdlib) or any(d in path.split(os.sep) for d in _SITE_DIRS):
            continue
        if f.filename.startswith("<"):
            continue
        return {"file": f.filename, "line": f.lineno, "function": f.name}
    if isinstance(exc, SyntaxError) and exc.filename:
        return {"file": exc.filename, "line": exc.lineno, "function": None}
    return None


def _drop_own_frames(exc: BaseException) -> None:
    """The traceback starts at the user's code: this file's and runpy's frames are dropped."""
    tb = exc.__traceback__
    here = os.path.abspath(__file__)
    while tb is not None and tb.tb_next is not None:
        name = tb.tb_frame.f_code.co_filename
        if os.path.abspath(name) != here and "runpy" not in name:
            break
        tb = tb.tb_next
    exc.__traceback__ = tb


def record(exc: BaseException, script: str | None, error_file: str) -> None:
    """Write ``exc`` to ``error_file`` in torch's error-file format (plus ``extraInfo.zerospeed``)."""
    _drop_own_frames(exc)
    message = str(exc)
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {message}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc)),
                "timestamp": str(int(time.time())),
                "zerospeed": {
                    "type": type(exc).__name__,
                    "message": message,
                    "where": _user_frame(exc, script),
                    "rank": os.environ.get("RANK"),
                },
            },
        }
    }
    tmp = f"{error_file}.tmp"
    with open(tmp, "w", encoding="utf-8") as fp:
        json.dump(data, fp)
    os.replace(tmp, error_file)  # the agent never reads half a file


def main(argv: list[str]) -> None:
    module = bool(argv) and argv[0] == "--module"
    rest = argv[1:] if module else argv
    if not rest:
        raise SystemExit("zerospeed script_wrapper: no script to run")
    target, args = rest[0], rest[1:]
    error_file = os.environ.get(ERROR_FILE_ENV)
    faulthandler.enable(all_threads=True)  # a crash (SIGSEGV, SIGABRT) still dumps the Python stacks
    sys.argv = [target, *args]  # runpy sets sys.argv[0] to the module's file for --module
    script = None if module else os.path.abspath(target)
    sys.path[0] = os.getcwd() if module else os.path.dirname(script)  # as `python -m` / `python SCRIPT`
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        if not error_file:
            raise
        record(exc, _module_file(target) if module else script, error_file)
        sys.stdout.flush()
        sys.exit(1)


def _module_file(name: str) -> str | None:
    """The file ``python -m name`` runs (a package's ``__main__``), or ``None``."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{name}.__main__")
    except (ImportError, ValueError):
        return None
    return os.path.abspath(spec.origin) if spec is not None and spec.origin else None


if __name__ == "__main__":
    main(sys.argv[1:])
