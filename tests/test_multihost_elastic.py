"""Elastic restart with automatic resume: ``zerospeed --max_restarts 1`` and ``engine.load_checkpoint`` at start-up.

A rank is SIGKILLed at a random step between two checkpoints (or in the middle of a save); torchrun's
agent restarts the group, the script resumes from ``latest`` (the data loader position included) and
finishes. The final fp32 weights must be bit-identical to an uninterrupted run with the same
checkpoint cadence, and the steps trained after the resume must see exactly the samples the
uninterrupted run saw at those steps.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from elastic_cases import run
from multihost_util import TESTS, child_env, kill_session
from zerospeed.testing import run_distributed

pytestmark = pytest.mark.multihost

STEPS, EVERY = 12, 3


def _launch(out: Path, kill_step: int, mode: str, stage: int) -> subprocess.Popen:
    env = child_env(PYTHONPATH=f"{child_env()['PYTHONPATH']}:{TESTS}")
    cmd = [sys.executable, "-m", "zerospeed.launcher.runner", "--num_procs", "2", "--max_restarts", "1",
           "--monitor_interval", "0.2", str(TESTS / "elastic_cases.py"), str(out), str(STEPS), str(EVERY),
           str(kill_step), mode, str(stage)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        _, err = proc.communicate()
        raise AssertionError(f"the elastic job did not finish within {timeout:g}s:\n{err[-4000:]}")
    finally:
        kill_session(proc)
    assert proc.returncode == 0, err[-4000:]
    return err


def _steps_seen(out: Path, rank: int) -> dict[int, str]:
    """Step -> sample ids of the run's effective history: attempt 0 up to the resume point, then attempt 1."""
    attempts = {int(a): int(g) for a, _, g in (line.split() for line in (out / "attempts").read_text().splitlines())}
    history: dict[int, str] = {}
    for attempt in sorted(attempts):
        resume_step = attempts[attempt]
        history = {s: ids for s, ids in history.items() if s <= resume_step}
        path = out / f"seen-{attempt}-{rank}"
        for line in path.read_text().splitlines():
            step, ids = line.split(" ", 1)
            history[int(step)] = ids
    return history


def _reference(tmp_path: Path, stage: int) -> tuple[dict, list[dict[int, str]]]:
    ref = tmp_path / "reference"
    ref.mkdir()
    weights = run_distributed(run, 2, str(ref), STEPS, EVERY, -1, "none", stage, timeout=120)[0]
    seen = []
    for rank in range(2):
        seen.append({int(s): ids for s, ids in (line.split(" ", 1)
                                                for line in (ref / f"seen-0-{rank}").read_text().splitlines())})
    return weights, seen


def _assert_identical(out: Path, tmp_path: Path, stage: int) -> None:
    final = torch.load(out / "final.pt")
    weights, seen = _reference(tmp_path, stage)
    assert sorted(final) == sorted(weights)
    for name in weights:
        assert torch.equal(final[name], weights[name]), f"{name} differs from the uninterrupted run"
    for rank in range(2):
        assert _steps_seen(out, rank) == seen[rank], f"rank {rank} trained on other samples than the reference"


@pytest.mark.timeout(240)
def test_sigkill_between_checkpoints_restarts_and_finishes_bit_identical(tmp_path: Path) -> None:
    kill_step = random.choice([s for s in range(EVERY + 1, STEPS) if s % EVERY])  # after a checkpoint, before the next
    out = tmp_path / "job"
    out.mkdir()
    err = _finish(_launch(out, kill_step, "step", stage=2), timeout=180)
    attempts = (out / "attempts").read_text().splitlines()
    last_ckpt = kill_step // EVERY * EVERY
    assert attempts == ["0 - 0", f"1 global_step{last_ckpt} {last_ckpt}"], (kill_step, attempts, err[-3000:])
    _assert_identical(out, tmp_path, stage=2)


@pytest.mark.timeout(240)
def test_sigkill_during_a_save_resumes_from_the_previous_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "job"
    out.mkdir()
    proc = _launch(out, 2 * EVERY, "save", stage=3)
    deadline = time.monotonic() + 150
    while not (out / "paused").exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the save never reached its pause point"
        time.sleep(0.05)
    assert (out / "paused").read_text() == "index"  # shards written, the checkpoint not yet published
    os.kill(int((out / "pid-0-0").read_text()), signal.SIGKILL)
    _finish(proc, timeout=150)
    attempts = (out / "attempts").read_text().splitlines()
    assert attempts == ["0 - 0", f"1 global_step{EVERY} {EVERY}"], attempts
    _assert_identical(out, tmp_path, stage=3)
