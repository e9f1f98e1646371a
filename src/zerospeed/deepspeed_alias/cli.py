"""``zerospeed-as-deepspeed [--force] COMMAND ARGS...``: run a command with zerospeed as its ``deepspeed``.

Examples: ``zerospeed-as-deepspeed accelerate launch --use_deepspeed train.py``,
``zerospeed-as-deepspeed torchrun --nproc-per-node 2 train.py --deepspeed ds.json``.

The command runs as a child process with the generated directory (:mod:`~zerospeed.deepspeed_alias.layout`)
first on ``PYTHONPATH``; its exit status is this command's (128 + N when signal N ended it), SIGINT and
SIGTERM are passed on to it, and the directory is removed when it ends. Refuses with one line (exit 2) when
a real DeepSpeed is importable, unless ``--force``; 127 when the command is not found.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any, Sequence

from zerospeed.deepspeed_alias import guard, layout
from zerospeed.deepspeed_alias.names import DIR_ENV, FORCE_ENV, alias_version

USAGE = ("usage: zerospeed-as-deepspeed [--force] COMMAND [ARGS...]\n"
         "Runs COMMAND with zerospeed importable as `deepspeed` (Transformers, Accelerate, PEFT, TRL use it).\n"
         "  --force    shadow a real DeepSpeed that is importable (refused otherwise)\n"
         "  --version  print the version the alias reports and exit")


def _fail(message: str, code: int) -> int:
    print(f"zerospeed-as-deepspeed: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    force = False
    while args and args[0].startswith("-"):
        flag = args.pop(0)
        if flag == "--force":
            force = True
        elif flag in ("-h", "--help"):
            print(USAGE)
            return 0
        elif flag == "--version":
            print(f"deepspeed {alias_version()} (zerospeed-as-deepspeed)")
            return 0
        elif flag == "--":
            break
        else:
            return _fail(f"unknown option {flag!r} (options: --force, --version, --help; then the command)", 2)
    if not args:
        return _fail("no command given; usage: zerospeed-as-deepspeed [--force] COMMAND [ARGS...]", 2)
    env = dict(os.environ)
    if not force and env.get(FORCE_ENV) != "1":
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        where = guard.real_deepspeed(search_path=extra + sys.path)
        if where is not None:
            return _fail(f"a real DeepSpeed is importable ({where}); uninstall it, or pass --force to shadow it "
                         "with zerospeed", 2)
    root = layout.write()
    try:
        env["PYTHONPATH"] = root if not env.get("PYTHONPATH") else root + os.pathsep + env["PYTHONPATH"]
        env[DIR_ENV] = root
        if force:
            env[FORCE_ENV] = "1"
        try:
            proc = subprocess.Popen(args, env=env)
        except FileNotFoundError:
            return _fail(f"command not found: {args[0]!r}", 127)
        except PermissionError:
            return _fail(f"command not executable: {args[0]!r}", 126)
        previous: dict[int, Any] = {}

        def forward(signum: int, frame: Any) -> None:
            if proc.poll() is None:
                proc.send_signal(signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, forward)
        try:
            code = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return 128 - code if code < 0 else code
    finally:
        layout.remove(root)


if __name__ == "__main__":
    sys.exit(main())
