"""Issue #33: a failed launch ends with one short block naming the rank, the exception and the user's line.

The worker side (:mod:`zerospeed.launcher.script_wrapper`) runs the script as ``python SCRIPT`` would and writes an
uncaught exception to torchrun's error file; the launcher side (:mod:`zerospeed.launcher.failures`) groups the
ranks' files into the summary and writes their tracebacks to one log. The end-to-end case is the issue's: a script
raising ``ConfigError`` on both of 2 ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from zerospeed.launcher import failures, script_wrapper
from zerospeed.launcher.runner import build_plan, parse_args

WRAPPER = script_wrapper.__file__

SCRIPT = """\
import os, sys
print("argv", sys.argv, "name", __name__, "path0", sys.path[0])


def build():
    raise ValueError("bad value for " + sys.argv[1])


def main():
    build()


if __name__ == "__main__":
    main()
"""


def _wrap(tmp_path: Path, *argv: str, error_file: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(script_wrapper.ERROR_FILE_ENV, None)
    if error_file:
        env[script_wrapper.ERROR_FILE_ENV] = str(tmp_path / "error.json")
    return subprocess.run([sys.executable, WRAPPER, *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)


def test_wrapper_runs_the_script_as_python_would_and_records_the_exception(tmp_path: Path) -> None:
    script = tmp_path / "sub" / "train.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    result = _wrap(tmp_path, str(script), "lr")
    assert result.returncode == 1
    assert f"argv [{str(script)!r}, 'lr'] name __main__ path0 {script.parent}" in result.stdout
    assert "Traceback" not in result.stderr  # the launcher prints the summary instead
    data = json.loads((tmp_path / "error.json").read_text())
    ours = data["message"]["extraInfo"]["zerospeed"]
    assert data["message"]["message"] == "ValueError: bad value for lr"  # torch's @record format
    assert ours["type"] == "ValueError" and ours["message"] == "bad value for lr"
    assert ours["where"] == {"file": str(script), "line": 6, "function": "build"}
    callstack = data["message"]["extraInfo"]["py_callstack"]
    assert callstack.splitlines()[1].startswith(f'  File "{script}", line 14')  # starts at the user's code
    assert "runpy" not in callstack and "script_wrapper" not in callstack


def test_wrapper_module_mode_and_exit_status(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(SCRIPT)
    result = _wrap(tmp_path, "--module", "pkg.train", "x")
    assert result.returncode == 1
    assert f"name __main__ path0 {tmp_path}" in result.stdout
    ours = json.loads((tmp_path / "error.json").read_text())["message"]["extraInfo"]["zerospeed"]
    assert ours["where"] == {"file": str(pkg / "train.py"), "line": 6, "function": "build"}

    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "error.json").unlink()
    result = _wrap(tmp_path, "exits.py")
    assert result.returncode == 3 and not (tmp_path / "error.json").exists()  # SystemExit keeps its meaning


def test_wrapper_without_an_error_file_lets_the_exception_through(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    result = _wrap(tmp_path, "train.py", "lr", error_file=False)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "ValueError: bad value for lr" in result.stderr


def _failure(tmp_path: Path, rank: int, exc: BaseException | None, exitcode: int = 1, where=None) -> ProcessFailure:
    error_file = tmp_path / "attempt_0" / str(rank) / "error.json"
    error_file.parent.mkdir(parents=True, exist_ok=True)
    if exc is not None:
        script_wrapper.record(exc, where, str(error_file))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(error_file))


def test_summary_groups_equal_errors_and_names_signals(tmp_path: Path) -> None:
    fs = {r: _failure(tmp_path, r, ValueError("stage: 7 is not one of 0, 1, 2, 3")) for r in (0, 1, 2, 5)}
    fs[3] = _failure(tmp_path, 3, None, exitcode=-9)
    fs[4] = _failure(tmp_path, 4, None, exitcode=2)
    log = failures.log_path(fs)
    assert log == str(tmp_path / "attempt_0" / "failures.log")
    lines = failures.summarize("train.py", fs, 8, log)
    assert lines == [
        "zerospeed: train.py failed on ranks 0-5 of the 8 that ran",
        "  ranks 0-2, 5: ValueError: stage: 7 is not one of 0, 1, 2, 3",
        "  rank 3: killed by SIGKILL (out of memory?)",
        "  rank 4: exited with status 2 without an exception (its own output is above)",
        f"  full tracebacks: {log}",
    ]
    failures.write_log(fs, log)
    text = Path(log).read_text()
    assert [line.split(" (")[0] for line in text.splitlines() if line.startswith("=====")] == [
        f"===== rank {r}" for r in range(6)]
    assert text.count("ValueError: stage: 7") == 4


def test_summary_caps_distinct_errors_and_long_messages(tmp_path: Path) -> None:
    fs = {r: _failure(tmp_path, r, RuntimeError(f"error {r} " + "x" * 1000)) for r in range(6)}
    lines = failures.summarize("train.py", fs)
    assert len(lines) == 1 + failures.MAX_GROUPS + 1
    assert lines[-1] == "  ... and other errors on ranks 3-5 (see the log)"
    assert all(len(line) < failures.MAX_MESSAGE_CHARS + 40 for line in lines)


def test_plan_wraps_the_program_after_the_binding_worker(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    plain = build_plan(parse_args(["--num_procs", "2", str(script), "--x"]))
    assert plain.worker_argv()[-3:] == [WRAPPER, str(script), "--x"]
    module = build_plan(parse_args(["--num_procs", "2", "--module", "pkg.t"]))
    assert module.worker_argv()[-3:] == [WRAPPER, "--module", "pkg.t"]
    bound = build_plan(parse_args(["--num_procs", "1", "--bind_cores_to_rank", "--module", "pkg.t"]))
    assert bound.worker_argv()[-5:] == ["--module", "zerospeed.launcher.bind_worker", WRAPPER, "--module", "pkg.t"]
    binary = build_plan(parse_args(["--num_procs", "1", "--no_python", "my_binary"]))
    assert binary.worker_argv() == binary.torchrun_argv  # a binary cannot be wrapped


CONFIG_ERROR_SCRIPT = """\
import zerospeed


def main():
    zerospeed.load_config({"train_batch_size": 2, "zero_optimization": {"stage": 7}})


main()
"""


@pytest.mark.timeout(200)
def test_config_error_on_two_ranks_is_one_short_block(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(CONFIG_ERROR_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "zerospeed.launcher.runner", "--num_procs", "2", str(script)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("zerospeed: "))
    block = lines[start:]
    assert len(block) <= 10, result.stderr
    assert block[0].startswith(f"zerospeed: {script} failed on rank")
    assert "ConfigError: zerospeed config: zero_optimization.stage: 7 is not one of 0, 1, 2, 3" in block[1]
    assert block[2].strip() == f"at {script}:5 in main"
    assert "Traceback" not in result.stderr and "FAILED" not in result.stderr
    log = Path(block[-1].split("full tracebacks: ", 1)[1])
    text = log.read_text()
    assert text.count("Traceback (most recent call last)") == text.count("===== rank ") >= 1
    assert f'File "{script}", line 5, in main' in text
