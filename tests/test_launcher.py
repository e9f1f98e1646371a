"""The ``zerospeed`` launcher: hostfile parsing, flag -> torchrun translation, real 2-process runs.

Pure tests build :class:`LaunchPlan` objects without starting anything; the subprocess tests run
the actual command (``python -m zerospeed.launcher.runner`` and the installed console script) and
check that both ranks ran and that a failing worker's exit code comes back.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zerospeed.launcher.hostfile import (
    LaunchError,
    filter_hosts,
    find_node_rank,
    parse_hostfile,
    parse_hostfile_text,
    uniform_slots,
)
from zerospeed.launcher.runner import build_plan, main, parse_args

HOSTFILE = """\
# two nodes, four slots each
worker-0 slots=4

worker-1 slots=4   # trailing comment
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return path


@pytest.fixture
def hostfile(tmp_path: Path) -> Path:
    path = tmp_path / "hostfile"
    path.write_text(HOSTFILE)
    return path


def plan_for(*argv: str, local_names=("worker-1",)):
    return build_plan(parse_args(list(argv)), local_names=local_names)


# --------------------------------------------------------------------------- hostfile parsing


def test_hostfile_parses_hosts_in_order_skipping_comments_and_blanks() -> None:
    hosts = parse_hostfile_text(HOSTFILE, "hf")
    assert [(h.hostname, h.num_slots, h.line_no) for h in hosts] == [
        ("worker-0", 4, 2), ("worker-1", 4, 4)
    ]
    assert hosts[0].slots == (0, 1, 2, 3)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a slots=2\nb\n", "hf:2: expected 'hostname slots=N'"),
        ("a slots=2\nb slots=two\n", "hf:2: slots must be a positive integer, got 'two'"),
        ("a slots=0\n", "hf:1: slots must be a positive integer, got 0"),
        ("a slots=2\nb gpus=2\n", "hf:2: expected 'hostname slots=N'"),
        ("a slots=2\nb slots=2 extra\n", "hf:2: expected 'hostname slots=N'"),
        ("a slots=2\na slots=2\n", "hf:2: host 'a' is already listed on line 1"),
        ("# only a comment\n\n", "hf: no hosts found"),
    ],
)
def test_hostfile_errors_name_the_line(text: str, message: str) -> None:
    with pytest.raises(LaunchError) as info:
        parse_hostfile_text(text, "hf")
    assert message in str(info.value)


def test_missing_hostfile_names_the_flag_and_path(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match=r"--hostfile: no such file: .*nope"):
        parse_hostfile(tmp_path / "nope")


def test_unequal_slots_error_names_the_line() -> None:
    hosts = parse_hostfile_text("a slots=2\nb slots=2\nc slots=3\n", "hf")
    with pytest.raises(LaunchError, match=r"hf:3: host 'c' has 3 slots but 'a' \(line 1\) has 2"):
        uniform_slots(hosts, "hf")


def test_include_and_exclude_select_hosts_and_slots() -> None:
    hosts = parse_hostfile_text("a slots=4\nb slots=4\nc slots=4\n")
    included = filter_hosts(hosts, include="a@c:1,3")
    assert [(h.hostname, h.slots) for h in included] == [("a", (0, 1, 2, 3)), ("c", (1, 3))]
    excluded = filter_hosts(hosts, exclude="b@c:0")
    assert [(h.hostname, h.slots) for h in excluded] == [("a", (0, 1, 2, 3)), ("c", (1, 2, 3))]


@pytest.mark.parametrize(
    ("include", "exclude", "message"),
    [
        ("a", "b", "--include and --exclude cannot be used together"),
        ("z", None, "--include: host 'z' is not in the hostfile"),
        (None, "a:7", "--exclude: host 'a' has slots 0..3, not 7"),
        ("a:x", None, "--include: slots of 'a' must be comma-separated integers"),
        (None, "a@b", "--exclude: no hosts left"),
    ],
)
def test_filter_errors(include, exclude, message: str) -> None:
    hosts = parse_hostfile_text("a slots=4\nb slots=4\n")
    with pytest.raises(LaunchError) as info:
        filter_hosts(hosts, include, exclude)
    assert message in str(info.value)


def test_node_rank_is_found_by_hostname_or_reported() -> None:
    hosts = parse_hostfile_text("a slots=1\nb slots=1\n")
    assert find_node_rank(hosts, {"b", "b.example.com"}) == 1
    with pytest.raises(LaunchError, match="not among the hosts.*pass --node_rank"):
        find_node_rank(hosts, {"c"})


# --------------------------------------------------------------------------- flag translation


def test_local_run_uses_standalone_rendezvous(script: Path) -> None:
    plan = plan_for("--num_procs", "2", str(script), "--config", "x.json", "--lr", "1")
    assert plan.torchrun_argv == [
        "--standalone", "--nnodes", "1", "--nproc_per_node", "2",
        str(script), "--config", "x.json", "--lr", "1",
    ]
    assert plan.env == {}


def test_num_gpus_alias_and_master_port_select_static_local(script: Path) -> None:
    plan = plan_for("--num_gpus", "3", "--master_port", "29611", str(script))
    assert plan.torchrun_argv == [
        "--nnodes", "1", "--nproc_per_node", "3", "--node_rank", "0",
        "--master_addr", "127.0.0.1", "--master_port", "29611", str(script),
    ]


def test_module_and_no_python_skip_the_file_check() -> None:
    plan = plan_for("--num_procs", "1", "--module", "pkg.train", "--x")
    assert plan.torchrun_argv[-3:] == ["--module", "pkg.train", "--x"]
    plan = plan_for("--num_procs", "1", "--no_python", "my_binary")
    assert plan.torchrun_argv[-2:] == ["--no_python", "my_binary"]


def test_multi_node_static_flags(script: Path) -> None:
    plan = plan_for("--num_nodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1",
                    "--num_procs", "4", str(script))
    assert plan.torchrun_argv == [
        "--nnodes", "2", "--nproc_per_node", "4", "--node_rank", "1",
        "--master_addr", "10.0.0.1", "--master_port", "29500", str(script),
    ]


def test_multi_node_dynamic_rendezvous(script: Path) -> None:
    plan = plan_for("--nnodes", "1:4", "--rdzv_endpoint", "head:29400", "--rdzv_id", "job7",
                    "--num_procs", "8", str(script))
    assert plan.torchrun_argv == [
        "--nnodes", "1:4", "--nproc_per_node", "8", "--rdzv_backend", "c10d",
        "--rdzv_endpoint", "head:29400", "--rdzv_id", "job7", str(script),
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2", "--master_addr", "h"], "--node_rank: required with --nnodes 2"),
        (["--nnodes", "2", "--node_rank", "0"], "--master_addr: required with --nnodes 2"),
        (["--nnodes", "0"], "--nnodes: expected a positive integer or MIN:MAX"),
        (["--nnodes", "1:4"], "--nnodes: a MIN:MAX range needs --rdzv_endpoint"),
        (["--rdzv_backend", "c10d"], "--rdzv_backend c10d: needs --rdzv_endpoint"),
        (["--rdzv_endpoint", "h:1", "--master_addr", "h"], "belong to the static rendezvous"),
        (["--num_procs", "0"], "--num_procs: must be at least 1, got 0"),
        (["--include", "a"], "--include/--exclude need a --hostfile"),
    ],
)
def test_flag_errors(script: Path, argv: list[str], message: str) -> None:
    with pytest.raises(LaunchError) as info:
        plan_for(*argv, str(script))
    assert message in str(info.value)


def test_hostfile_translates_to_static_multi_node(script: Path, hostfile: Path) -> None:
    plan = plan_for("--hostfile", str(hostfile), str(script), "--a", local_names={"worker-1"})
    assert plan.torchrun_argv == [
        "--nnodes", "2", "--nproc_per_node", "4", "--node_rank", "1",
        "--master_addr", "worker-0", "--master_port", "29500", str(script), "--a",
    ]
    assert plan.env == {}


def test_hostfile_with_explicit_node_rank_and_master(script: Path, hostfile: Path) -> None:
    plan = plan_for("-H", str(hostfile), "--node_rank", "0", "--master_addr", "10.1.1.1",
                    "--master_port", "1234", str(script), local_names=set())
    assert plan.torchrun_argv[:10] == [
        "--nnodes", "2", "--nproc_per_node", "4", "--node_rank", "0",
        "--master_addr", "10.1.1.1", "--master_port", "1234",
    ]


def test_hostfile_num_nodes_and_num_procs_trim_like_deepspeed(script: Path, hostfile: Path) -> None:
    plan = plan_for("-H", str(hostfile), "--num_nodes", "1", "--num_gpus", "2", str(script),
                    local_names={"worker-0"})
    assert plan.torchrun_argv[:6] == ["--nnodes", "1", "--nproc_per_node", "2", "--node_rank", "0"]


def test_hostfile_slot_selection_sets_visible_devices(
    script: Path, hostfile: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    plan = plan_for("-H", str(hostfile), "--include", "worker-0:0,1@worker-1:2,3", str(script),
                    local_names={"worker-1"})
    assert plan.torchrun_argv[:6] == ["--nnodes", "2", "--nproc_per_node", "2", "--node_rank", "1"]
    assert plan.env == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert plan.command_line().startswith("CUDA_VISIBLE_DEVICES=2,3 torchrun --nnodes 2")


def test_hostfile_errors(script: Path, tmp_path: Path, hostfile: Path) -> None:
    with pytest.raises(LaunchError, match="this machine .* is not among the hosts"):
        plan_for("-H", str(hostfile), str(script), local_names={"elsewhere"})
    with pytest.raises(LaunchError, match=r"--nnodes: 3 nodes requested but .* has 2"):
        plan_for("-H", str(hostfile), "--nnodes", "3", str(script))
    with pytest.raises(LaunchError, match=r"--num_procs: 8 per node requested but host 'worker-0'"):
        plan_for("-H", str(hostfile), "--num_procs", "8", str(script))
    with pytest.raises(LaunchError, match=r"--node_rank: 2 is not in 0..1"):
        plan_for("-H", str(hostfile), "--node_rank", "2", str(script))
    uneven = tmp_path / "uneven"
    uneven.write_text("worker-0 slots=4\nworker-1 slots=2\n")
    with pytest.raises(LaunchError, match=r"uneven:2: host 'worker-1' has 2 slots"):
        plan_for("-H", str(uneven), str(script))


# --------------------------------------------------------------------------- main(): exit codes


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num_procs", "2", "missing_script.py"], "user_script: no such file: missing_script.py"),
        (["--hostfile", "/no/such/hostfile", "SCRIPT"], "--hostfile: no such file: /no/such/hostfile"),
        (["--hostfile", "BADHOSTFILE", "SCRIPT"], "slots must be a positive integer, got 'x'"),
        (["--num_procs", "0", "SCRIPT"], "--num_procs: must be at least 1, got 0"),
        (["--num_procs", "two", "SCRIPT"], "argument --num_procs"),
        ([], "user_script: missing"),
    ],
)
def test_bad_input_gives_one_error_line_and_exit_2(
    argv: list[str], message: str, script: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    bad = tmp_path / "bad_hostfile"
    bad.write_text("worker-0 slots=x\n")
    argv = [str(script) if a == "SCRIPT" else str(bad) if a == "BADHOSTFILE" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("zerospeed: error: ") and message in err[0]


def test_dry_run_prints_the_torchrun_command(script: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--num_procs", "2", "--dry_run", str(script), "--flag"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == f"torchrun --standalone --nnodes 1 --nproc_per_node 2 {script} --flag"


# --------------------------------------------------------------------------- real launches

WORKER = """\
import os, sys
out = sys.argv[1]
rank = os.environ["RANK"]
with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
    f.write(" ".join([rank, os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], *sys.argv[2:]]))
if len(sys.argv) > 2 and sys.argv[2] == "--fail" and rank == "1":
    sys.exit(3)
"""


def _launcher_cmd() -> list[str]:
    return [sys.executable, "-m", "zerospeed.launcher.runner"]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(150)
def test_real_two_process_run(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    result = _run([*_launcher_cmd(), "--num_procs", "2", str(worker), str(tmp_path), "--x", "1"])
    assert result.returncode == 0, result.stderr
    seen = sorted((tmp_path / f"rank{r}.txt").read_text() for r in range(2))
    assert seen == ["0 2 0 --x 1", "1 2 1 --x 1"]


@pytest.mark.timeout(150)
def test_failing_worker_exit_code_propagates(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    result = _run([*_launcher_cmd(), "--num_procs", "2", str(worker), str(tmp_path), "--fail"])
    assert result.returncode == 3, result.stderr
    assert (tmp_path / "rank1.txt").exists()


@pytest.mark.timeout(60)
def test_console_script_reports_bad_input(tmp_path: Path) -> None:
    exe = shutil.which("zerospeed", path=str(Path(sys.executable).parent)) or shutil.which(
        "zerospeed"
    )
    if exe is None:
        pytest.skip("the zerospeed console script is not installed")
    result = _run([exe, "--num_procs", "2", str(tmp_path / "absent.py")])
    assert result.returncode == 2
    assert result.stderr.strip() == f"zerospeed: error: user_script: no such file: {tmp_path / 'absent.py'}"
