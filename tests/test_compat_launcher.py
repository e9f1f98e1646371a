"""Launcher flags --bind_cores_to_rank / --bind_core_list (issue 20, point 9)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerospeed.launcher.binding import cores_for_rank, parse_core_list
from zerospeed.launcher.hostfile import LaunchError
from zerospeed.launcher.runner import build_plan, main, parse_args

WORKER = """\
import json, os, sys
import torch
rank = os.environ["LOCAL_RANK"]
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"cores": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
               "omp": os.environ.get("OMP_NUM_THREADS"), "argv": sys.argv[2:], "main": __name__}, f)
"""


def test_core_list_rules_are_deepspeeds():
    assert parse_core_list("0,2-4,6") == [0, 2, 3, 4, 6]
    assert parse_core_list("5") == [5]
    for bad, match in [("3,1", "ascending"), ("0-3,2-5", "overlaps"), ("4-2", "bad range"), ("a", "bad item"),
                       ("1-2-3", "bad item")]:
        with pytest.raises(LaunchError, match=match):
            parse_core_list(bad)
    cores = list(range(10))
    assert [cores_for_rank(cores, 3, r) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # 10 // 3 each
    with pytest.raises(LaunchError, match="3 cores for 4 processes"):
        cores_for_rank([0, 1, 2], 4, 0)


def test_plan_runs_the_pinning_worker_and_sets_threads(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    plan = build_plan(parse_args(["--num_procs", "2", "--bind_cores_to_rank", "--bind_core_list", "0-1",
                                  str(script), "--lr", "1"]))
    assert plan.env["OMP_NUM_THREADS"] == "1" and plan.env["ZEROSPEED_BIND_CORES"] == "0,1"
    tail = plan.torchrun_argv[-5:]
    assert tail == ["--module", "zerospeed.launcher.bind_worker", str(script), "--lr", "1"]
    plain = build_plan(parse_args(["--num_procs", "2", str(script)]))
    assert "zerospeed.launcher.bind_worker" not in plain.torchrun_argv and "OMP_NUM_THREADS" not in plain.env


@pytest.mark.parametrize("flags,message", [
    (["--bind_core_list", "0"], "--bind_core_list: needs --bind_cores_to_rank"),
    (["--bind_cores_to_rank", "--bind_core_list", "0-4095"], "are not available to this process"),
    (["--bind_cores_to_rank", "--bind_core_list", "0", "--num_procs", "2"], "1 cores for 2 processes"),
    (["--bind_cores_to_rank", "--bind_core_list", "1,0"], "ascending"),
])
def test_bad_binding_flags_give_one_line(tmp_path: Path, capsys, flags, message):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    assert main([*flags, str(script)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_default_core_list_is_what_the_launcher_may_use(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    plan = build_plan(parse_args(["--num_procs", "1", "--bind_cores_to_rank", str(script)]))
    cores = sorted(os.sched_getaffinity(0))
    assert plan.env["ZEROSPEED_BIND_CORES"] == ",".join(map(str, cores))
    assert plan.env["OMP_NUM_THREADS"] == str(len(cores))


@pytest.mark.timeout(120)
def test_two_ranks_run_on_their_own_core(tmp_path: Path):
    if not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs cores 0 and 1 available to this process (the test pins one rank to each)")
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    cmd = [sys.executable, "-m", "zerospeed.launcher.runner", "--num_procs", "2", "--bind_cores_to_rank",
           "--bind_core_list", "0-1", str(worker), str(tmp_path), "--x", "1"]
    result = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                            timeout=100)
    assert result.returncode == 0, result.stderr
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["cores"] for s in seen] == [[0], [1]]
    assert all(s["threads"] == 1 and s["omp"] == "1" for s in seen)
    assert all(s["argv"] == ["--x", "1"] and s["main"] == "__main__" for s in seen)
