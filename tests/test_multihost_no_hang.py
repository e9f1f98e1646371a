"""No hangs: a rank that stops participating makes the others fail, within the timeout, naming it.

World of 4 (forked ranks, real processes); rank 2 stops before its third step, by ``SIGSTOP`` or by
looping forever, at ZeRO stages 0, 2 and 3 and in a 2-stage x 2-replica pipeline. The process
group's timeout is 3 s (``zerospeed.init_distributed(timeout=...)``; ZeRO-3's watchdog limit the
same). Every other rank must exit non-zero within a bound of a few timeouts, with an error that
names rank 2 as the one that stopped participating.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from multihost_util import TESTS, child_env, python, run_group

pytestmark = pytest.mark.multihost

SCRIPT = """\
import datetime, os, signal, sys, time
import torch
from torch import nn
import zerospeed

KIND, MODE, VICTIM = "{kind}", "{mode}", 2
zerospeed.init_distributed(timeout=datetime.timedelta(seconds=3))
rank = int(os.environ["RANK"])
torch.manual_seed(0)
if KIND == "pipe":
    from pipe_cases import config, make_pipeline, micro_batches
    engine, _, _, _ = zerospeed.initialize(model=make_pipeline(2), config=config("1f1b", 2))
else:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    cfg = {{"train_micro_batch_size_per_gpu": 2, "optimizer": {{"type": "Adam", "params": {{"lr": 1e-3}}}},
           "zero_optimization": {{"stage": int(KIND), "stage3_collective_timeout_s": 3,
                                  "stage3_param_persistence_threshold": 0}}}}
    engine, _, _, _ = zerospeed.initialize(model=model, config=cfg)
def report(exc_type, exc, tb, previous=sys.excepthook):
    with open(os.path.join(sys.argv[1], f"failed-{{rank}}"), "w") as f:
        f.write(str(time.time()))
    previous(exc_type, exc, tb)
sys.excepthook = report
for step in range(4):
    if step == 2 and rank == VICTIM:
        if MODE == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        while True:  # stuck before its next collective
            time.sleep(0.05)
    if step == 2:
        with open(os.path.join(sys.argv[1], f"blocked-{{rank}}"), "w") as f:
            f.write(str(time.time()))
    if KIND == "pipe":
        needs = engine.is_first_stage() or engine.is_last_stage()
        engine.train_batch(iter(micro_batches(step, rank % 2, 2, 2)) if needs else None)
    else:
        loss = engine(torch.randn(2, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("kind", "mode"), [("0", "stop"), ("2", "loop"), ("3", "stop"), ("pipe", "stop")])
def test_a_rank_that_stops_participating_is_named_within_the_timeout(tmp_path: Path, kind: str, mode: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(kind=kind, mode=mode))
    env = child_env(PYTHONPATH=f"{child_env()['PYTHONPATH']}:{TESTS}", FORKED_RANKS_GRACE_S="8")
    t0 = time.monotonic()
    result = run_group([python(), str(TESTS / "forked_ranks.py"), str(script), "1", "4", str(tmp_path)],
                       timeout=100, env=env)
    took = time.monotonic() - t0
    codes = json.loads(result.stdout.strip().splitlines()[-1])[0]
    err = result.stderr
    assert codes[2] == -9, (codes, err[-3000:])  # the stopped rank never finished: the driver killed it
    survivors = [r for r in range(4) if r != 2]
    assert all(codes[r] not in (0, -9) for r in survivors), (codes, err[-4000:])  # they failed by themselves
    named = re.findall(r"ranks? 2 (?:stopped participating|did not answer)", err)
    assert len(named) >= len(survivors), err[-4000:]
    # the survivors failed by themselves soon after the stop (a 3 s timeout, a 1.5 s report window, exit),
    # long before the driver's 20 s grace would have killed them
    blocked = min(float((tmp_path / "run0" / f"blocked-{r}").read_text()) for r in survivors)
    failed = [float((tmp_path / "run0" / f"failed-{r}").read_text()) for r in survivors]
    assert max(failed) - blocked < 15, (max(failed) - blocked, err[-3000:])
    assert took < 80, took
