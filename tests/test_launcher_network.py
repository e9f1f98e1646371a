"""Launcher pre-flight for multi-node jobs: rendezvous errors that name the address, interface choice.

Run in-process through ``main()``: the checks happen before torchrun (and torch) start, so a wrong
master address, an unreachable port or a port in use is one ``zerospeed: error:`` line within the
``--rdzv_timeout``, not a stack trace after torchrun's own 15-minute wait.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from zerospeed.launcher import network
from zerospeed.launcher.hostfile import LaunchError, parse_hostfile_text
from zerospeed.launcher.runner import build_plan, main, parse_args


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('never run')\n")
    return path


def _one_error_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("zerospeed: error: ")
    return err[0]


def test_port_in_use_on_the_master_is_an_error_naming_the_address(script: Path, capsys) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        code = main(["--num_procs", "1", "--nnodes", "2", "--node_rank", "0", "--master_addr", "127.0.0.1", "--master_port", str(port),
                     str(script)])
    assert code == 2 and time.monotonic() - t0 < 5
    assert f"--master_port: 127.0.0.1:{port} is already in use on this node" in _one_error_line(capsys)


def test_unreachable_master_fails_within_the_rendezvous_timeout(script: Path, capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    t0 = time.monotonic()
    code = main(["--num_procs", "1", "--nnodes", "2", "--node_rank", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                 "--rdzv_timeout", "2", str(script)])
    took = time.monotonic() - t0
    assert code == 2 and 1.9 <= took < 8, took
    line = _one_error_line(capsys)
    assert f"cannot reach the master at 127.0.0.1:{port} within 2s (--rdzv_timeout): Connection refused" in line


def test_unresolvable_master_is_an_error_naming_it(script: Path, capsys) -> None:
    code = main(["--num_procs", "1", "--nnodes", "2", "--node_rank", "1", "--master_addr", "no-such-host.invalid", str(script)])
    assert code == 2
    assert "--master_addr: cannot resolve 'no-such-host.invalid'" in _one_error_line(capsys)


def test_master_that_is_not_this_node(script: Path, capsys) -> None:
    code = main(["--num_procs", "1", "--nnodes", "2", "--node_rank", "0", "--master_addr", "192.0.2.1", "--rdzv_timeout", "1",
                 str(script)])
    assert code == 2
    assert "this is node 0 (the master) but 192.0.2.1:29500 is not an address of this node" in \
        _one_error_line(capsys)


def test_max_restarts_and_monitor_interval_reach_torchrun(script: Path) -> None:
    plan = build_plan(parse_args(["--num_procs", "2", "--max_restarts", "3", "--monitor_interval", "0.5",
                                  str(script)]))
    assert plan.torchrun_argv == ["--standalone", "--nnodes", "1", "--nproc_per_node", "2", "--max_restarts", "3",
                                  "--monitor_interval", "0.5", str(script)]
    with pytest.raises(LaunchError, match="--max_restarts: must be at least 0, got -1"):
        build_plan(parse_args(["--max_restarts", "-1", str(script)]))


def test_interface_is_the_route_to_the_master_unless_the_user_chose() -> None:
    names = network.interface_addresses()
    loopback = next(n for n, addrs in names.items() if "127.0.0.1" in addrs)
    assert network.socket_ifname_env("127.0.0.1", {}, log=False) == {
        "GLOO_SOCKET_IFNAME": loopback, "NCCL_SOCKET_IFNAME": loopback}
    assert network.socket_ifname_env("127.0.0.1", {"NCCL_SOCKET_IFNAME": "eth9"}) == {}
    with pytest.raises(LaunchError, match="--master_addr: cannot resolve 'no-such-host.invalid'"):
        network.interface_for("no-such-host.invalid")


def test_hostfile_names_match_this_node_by_address_but_never_by_loopback() -> None:
    hosts = parse_hostfile_text("localhost slots=1\n127.0.0.1 slots=1\n")
    local = network.local_addresses()
    assert network.names_by_address([h.hostname for h in hosts], local) == set()
    own = next((a for a in local if not network.is_loopback(a)), None)
    if own is not None:
        assert network.names_by_address([own, "192.0.2.77"], local) == {own}
