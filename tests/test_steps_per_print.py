"""Issue #33: ``steps_per_print`` prints from a fresh process, whatever the script imported or set up first.

The script imports only ``torch`` and ``zerospeed`` (never ``zerospeed.utils``); with ``logging.basicConfig()``
first (root at WARNING, a stderr handler) the step lines still print, through the application's handler.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """\
{prelude}
import torch, zerospeed
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config={{
    "train_batch_size": 2, "steps_per_print": {every}, "optimizer": {{"type": "SGD", "params": {{"lr": 0.1}}}}}})
for _ in range(4):
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
"""


def _run(prelude: str, every: int) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(prelude=prelude, every=every)], env=env,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    return out.stdout + out.stderr


@pytest.mark.timeout(240)
@pytest.mark.parametrize("prelude", ["", "import logging; logging.basicConfig()"])
def test_step_lines_print_every_steps_per_print(prelude: str) -> None:
    text = _run(prelude, 2)
    steps = [line.split("step=", 1)[1].split()[0] for line in text.splitlines() if "step=" in line]
    assert steps == ["2", "4"], text


@pytest.mark.timeout(120)
def test_an_application_level_is_kept() -> None:
    text = _run("import logging; logging.getLogger('zerospeed').setLevel(logging.WARNING)", 1)
    assert "step=" not in text


def test_log_dist_names_its_caller(caplog: pytest.LogCaptureFixture) -> None:
    from zerospeed.utils import log_dist

    with caplog.at_level("INFO", logger="zerospeed"):
        log_dist("hello", ranks=[0])
    assert [(r.filename, r.getMessage()) for r in caplog.records] == [("test_steps_per_print.py", "[Rank -1] hello")]
