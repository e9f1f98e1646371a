"""init_distributed on its own (plain python, idempotent, bad backend) and what the engine logs."""

import logging
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from engine_cases import config, engine_run
from zerospeed.testing import run_distributed

PLAIN = """
import torch.distributed as dist, zerospeed
zerospeed.init_distributed()
first = (dist.get_world_size(), dist.get_rank(), dist.get_backend())
zerospeed.init_distributed()  # idempotent: the same group stays
print(first, dist.get_world_size())
"""


@pytest.mark.timeout(60)
def test_plain_python_gets_a_world_of_one():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", PLAIN], env=env, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(1, 0, 'gloo') 1"


def test_unknown_backend_is_named():
    import zerospeed

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with pytest.raises(ValueError, match="dist_backend='tcp'"):
        zerospeed.init_distributed(dist_backend="tcp")


def test_nccl_without_cuda_is_refused():
    import torch

    import zerospeed

    if torch.cuda.is_available() or dist.is_initialized():
        pytest.skip("this machine has CUDA (or a group exists): NCCL is allowed here")
    with pytest.raises(ValueError, match="needs CUDA"):
        zerospeed.init_distributed(dist_backend="nccl")


def _run_and_capture_logs(cfg):
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("zerospeed")
    logger.setLevel(logging.INFO)
    logger.addHandler(Keep())
    engine_run(cfg, 2)
    return records


@pytest.mark.timeout(60)
def test_comms_logger_and_wall_clock_report_every_steps_per_print():
    cfg = config(2, 2, steps_per_print=1, comms_logger={"enabled": True}, wall_clock_breakdown=True)
    logs0, logs1 = run_distributed(_run_and_capture_logs, 2, cfg)
    assert logs1 == []  # only rank 0 reports
    steps = [m for m in logs0 if m.startswith("step=")]
    assert [m.split()[0] for m in steps] == ["step=1", "step=2"]
    # stage 2, 4 buckets, 2 micro-batches: 8 reduce-scatters, 4 all-gathers and the norm all-reduce per step
    assert sum("comms reduce_scatter: 8 calls" in m for m in logs0) == 2
    assert sum("comms all_gather: 4 calls" in m for m in logs0) == 2
    assert sum("comms all_reduce: 1 calls, 1 elements" in m for m in logs0) == 2
    assert sum(m.startswith("time (s, cumulative): forward=") for m in logs0) == 2
