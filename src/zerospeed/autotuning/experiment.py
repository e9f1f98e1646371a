"""One experiment: a candidate config run as a subprocess through the launcher, with a time limit.

Files in the experiment's folder (``exps_dir/<name>/``): ``ds_config.json`` (what it ran),
``cmd.txt`` (the exact command), ``stdout.log``, ``stderr.log``, ``metrics.json`` (written by the
engine, see :mod:`zerospeed.runtime.autotuning_probe`) and ``result.json`` (status, metric,
elapsed, last stderr lines), written last: an experiment is finished exactly when its
``result.json`` exists, which is how a re-run after an interruption knows what to skip.

Decisions:

* The launcher runs in its own session (``start_new_session``); on timeout the whole process
  group (agent and workers) gets SIGTERM, then SIGKILL after a grace period, so a hung experiment
  never outlives its limit and never blocks the tuner.
* The script receives the experiment's config where the user's command named theirs:
  ``--deepspeed_config X`` / ``--deepspeed X`` / ``--config X`` (also ``--flag=X``); keys in
  ``arg_mappings`` are passed as the mapped flags (replacing the user's value when present).
* A run that exits 0 without ``metrics.json`` is ``ended_early``: the script ended before
  ``end_profile_step`` (its data or its own loop ran out, typically when a large micro-batch leaves fewer
  batches than profile steps). It is not runnable as a candidate but, unlike a failure, says nothing about
  memory (issue #33: a dataset running out was reported as the largest runnable micro-batch). A measured peak
  above the memory budget fails as ``over_budget``.
* A failed run's reason is the script's own exception, as the launcher's failure summary names it (type, message,
  file and line: :mod:`zerospeed.launcher.failures`), not torchrun's banner; the last stderr lines only when
  there is no summary (a crash, a timeout).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed", "--config")
STDERR_TAIL_LINES = 15


@dataclass
class Result:
    """The outcome of one experiment."""

    name: str
    status: str  # ok | failed | ended_early | timeout | over_budget | skipped
    metrics: dict[str, Any] = field(default_factory=dict)
    elapsed: float = 0.0
    reason: str = ""
    candidate: dict[str, Any] = field(default_factory=dict)

    def metric(self, name: str) -> float | None:
        value = self.metrics.get(name)
        return float(value) if self.status == "ok" and value is not None else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Result:
        return cls(**data)


def replace_config_arg(user_args: list[str], config_path: str) -> list[str]:
    """The user's script arguments with the config path replaced (or ``--deepspeed_config`` added)."""
    out = list(user_args)
    for i, arg in enumerate(out):
        for flag in CONFIG_FLAGS:
            if arg == flag and i + 1 < len(out):
                out[i + 1] = config_path
                return out
            if arg.startswith(flag + "="):
                out[i] = f"{flag}={config_path}"
                return out
    return out + ["--deepspeed_config", config_path]


def apply_arg_mappings(user_args: list[str], mappings: dict[str, str], values: dict[str, Any]) -> list[str]:
    """Pass mapped config values as script flags (replacing a value the user gave)."""
    out = list(user_args)
    for key, flag in mappings.items():
        if key not in values:
            continue
        value = str(values[key])
        for i, arg in enumerate(out):
            if arg == flag and i + 1 < len(out):
                out[i + 1] = value
                break
            if arg.startswith(flag + "="):
                out[i] = f"{flag}={value}"
                break
        else:
            out += [flag, value]
    return out


@dataclass
class ExperimentRunner:
    """Runs experiments under ``exps_dir`` with the user's launcher flags and script."""

    exps_dir: Path
    launcher_args: list[str]
    script: str
    user_args: list[str]
    arg_mappings: dict[str, str]
    timeout: float
    memory_budget: int = 0
    env: dict[str, str] = field(default_factory=dict)

    def finished(self, name: str) -> Result | None:
        path = self.exps_dir / name / "result.json"
        if not path.is_file():
            return None
        try:
            return Result.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None  # a damaged record: run it again

    def script_args(self, config_path: Path, values: dict[str, Any]) -> list[str]:
        """The script's arguments for a config file and candidate values."""
        args = replace_config_arg(self.user_args, str(config_path))
        return apply_arg_mappings(args, self.arg_mappings, values)

    def command(self, config_path: Path, values: dict[str, Any]) -> list[str]:
        return [sys.executable, "-m", "zerospeed.launcher.runner", *self.launcher_args, self.script,
                *self.script_args(config_path, values)]

    def run(self, name: str, config: dict[str, Any], values: dict[str, Any]) -> Result:
        """Run one experiment; a rank that died of a native crash signal (SIGABRT, SIGSEGV, ...) rather than a
        Python exception is run once more, and the record says so: torch 2.13's gloo ranks abort now and then
        while the process ends ("terminate called without an active exception"), which says nothing about
        the candidate. A second crash, or any other failure, is recorded as it is."""
        result = self._run_once(name, config, values)
        crash = None
        if result.status == "failed":
            try:
                crash = _NATIVE_CRASH.search((self.exps_dir / name / "stderr.log").read_text(errors="replace"))
            except OSError:
                crash = None
        if crash is None:
            return result
        again = self._run_once(name, config, values)
        again.reason = (f"{again.reason}; " if again.reason else "") + f"run twice (first run: {crash.group(0)})"
        _write_json(self.exps_dir / name / "result.json", again.to_json())
        return again

    def _run_once(self, name: str, config: dict[str, Any], values: dict[str, Any]) -> Result:
        folder = self.exps_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        for stale in ("metrics.json", "model_info.json", "result.json"):
            (folder / stale).unlink(missing_ok=True)
        config_path = folder / "ds_config.json"
        config_path.write_text(json.dumps(config, indent=2))
        cmd = self.command(config_path, values)
        (folder / "cmd.txt").write_text(shlex.join(cmd) + "\n")
        # a native crash (e.g. at interpreter exit) leaves a Python traceback of every thread in
        # stderr.log, which the failure record quotes
        env = {"PYTHONFAULTHANDLER": "1", **os.environ, **self.env}
        start = time.perf_counter()
        status, reason, summary = "ok", "", ""
        with open(folder / "stdout.log", "wb") as out, open(folder / "stderr.log", "wb") as err:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                code = None
                status, reason = "timeout", f"killed after {self.timeout:g} s (exp_timeout)"
        elapsed = time.perf_counter() - start
        metrics: dict[str, Any] = {}
        metrics_path = folder / "metrics.json"
        if metrics_path.is_file():
            metrics = json.loads(metrics_path.read_text())
        if status == "ok" and code != 0:
            status, reason = "failed", f"exit status {code}"
            summary = launcher_summary(folder / "stderr.log")
            if summary:
                reason = f"{reason}: {summary}"
        elif status == "ok" and not metrics:
            status, reason = "ended_early", ("the script ended before end_profile_step (no metrics.json): its data "
                                             "or its loop ran out")
        elif status == "ok" and self.memory_budget and metrics.get("peak_memory_bytes", 0) > self.memory_budget:
            status, reason = "over_budget", (f"peak memory {metrics['peak_memory_bytes'] / 2**20:.0f} MiB > "
                                             f"memory_budget {self.memory_budget / 2**20:.0f} MiB")
        if status in ("timeout", "over_budget") or (status == "failed" and not summary):
            tail = _tail(folder / "stderr.log")
            reason = f"{reason}; stderr: {tail}" if tail else reason
        result = Result(name=name, status=status, metrics=metrics, elapsed=elapsed, reason=reason,
                        candidate=values)
        _write_json(folder / "result.json", result.to_json())
        return result


_NATIVE_CRASH = re.compile(r"(rank \d+: )?killed by SIG(ABRT|SEGV|BUS|ILL|FPE)")


def _kill_group(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            if sig == signal.SIGTERM:
                # the agent is gone; make sure no worker of its group survives it
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return
        except subprocess.TimeoutExpired:
            continue


_SUMMARY_HEAD = re.compile(r"^zerospeed: .+ failed on ranks? [\d, -]+")


def launcher_summary(path: Path) -> str:
    """The launcher's failure summary in ``path`` as one line (``"ConfigError: ... at train.py:5 in main"``), or
    ``""`` when there is none; the log's path is left out (the experiment's folder has stderr.log)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    heads = [i for i, line in enumerate(lines) if _SUMMARY_HEAD.match(line)]
    if not heads:
        return ""
    body = []
    for line in lines[heads[-1] + 1:]:
        if not line.startswith("  "):
            break
        if not line.strip().startswith("full tracebacks:"):
            body.append(line.strip())
    return " ".join(body)


_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\b.*)$")


def _tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    """What went wrong, from stderr: the last Python exception line if there is one (the agent's
    own report comes after it and says little), then the last lines."""
    try:
        text = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    exceptions = [m.group(1) for m in map(_EXCEPTION_LINE.match, text) if m]
    tail = " | ".join(text[-lines:])
    return f"{exceptions[-1]} || {tail}" if exceptions else tail


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)
