"""Shared helpers of the multi-host / fault-tolerance tests: subprocesses with hard limits, no leftovers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


def child_env(**extra: str) -> dict[str, str]:
    """This interpreter's environment with the worktree's sources first and one thread per process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def run_group(cmd: list[str], timeout: float, env: dict[str, str] | None = None,
              cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; on time-out kill the whole session (no orphaned ranks) and raise."""
    proc = subprocess.Popen(cmd, env=env or child_env(), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish within {timeout:g}s\nstdout:\n{out}\nstderr:\n{err}")
    finally:
        kill_session(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``, its session and every descendant (torchrun starts workers in sessions of their own)."""
    import psutil

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        family = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for child in family:
        try:
            child.kill()
        except psutil.Error:
            pass


def python() -> str:
    return sys.executable
