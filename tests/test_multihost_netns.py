"""Two hosts on one machine over real TCP: the launcher started in two network namespaces.

The hostfile says ``hostA slots=2`` / ``hostB slots=2``; both namespaces share one hostname that
resolves to 127.0.0.1 (as in many containers), and only their ``/etc/hosts`` maps hostA/hostB to
the veth addresses. With no ``GLOO_SOCKET_IFNAME`` set the launcher must find its node rank by
address and pick the veth interface itself; then ZeRO-2 and ZeRO-3 at world 4 across the two hosts
match a single-host world of 4, and the 2-host checkpoint loads on one host.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from multihost_cases import load_weights, train
from multihost_util import TESTS, child_env
from netns_hosts import TwoHosts, unavailable_reason
from zerospeed.testing import run_distributed

pytestmark = pytest.mark.multihost

RTOL, ATOL = 1e-5, 1e-7  # fp32; the same ring all-reduce runs on both, so in practice they are identical


def _needs_netns() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)


def _assert_close(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {k}: {m}")


def _launch_two_hosts(hosts: TwoHosts, tmp_path: Path, port: int = 29512) -> list[tuple[int, str, str]]:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{hosts.names[0]} slots=2\n{hosts.names[1]} slots=2\n")
    env = child_env(PYTHONPATH=f"{child_env()['PYTHONPATH']}:{TESTS}")
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(var, None)
    argv = [sys.executable, "-m", "zerospeed.launcher.runner", "--hostfile", str(hostfile), "--master_port",
            str(port), "--rdzv_timeout", "60", str(TESTS / "multihost_cases.py"), str(tmp_path)]
    procs = [hosts.start(h, argv, env) for h in (0, 1)]
    outs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=150)
        except Exception:
            hosts.close()
            out, err = proc.communicate()
            raise AssertionError(f"two-host run did not finish within 150s:\n{err[-4000:]}")
        outs.append((proc.returncode, out, err))
    return outs


@pytest.mark.timeout(300)
def test_zero2_and_zero3_across_two_namespaces_match_one_host(tmp_path: Path) -> None:
    _needs_netns()
    with TwoHosts(names=("hostA", "hostB"), hostnames=("box", "box")) as hosts:
        outs = _launch_two_hosts(hosts, tmp_path)
        wire_rx, wire_tx = hosts.rx_tx_bytes(0)
    for h, (code, _, err) in enumerate(outs):
        assert code == 0, f"host {h} exit {code}:\n{err[-4000:]}"
        # the launcher chose the veth interface (the route to hostA), and said so
        assert f"zerospeed: using network interface {hosts.veth[h]} ({hosts.addr[h]}), the route to the master " \
               f"hostA ({hosts.addr[0]})" in err, err[-2000:]
    assert wire_rx > 10_000 and wire_tx > 10_000  # the gradients really crossed the veth link
    result = torch.load(tmp_path / "result.pt")
    assert result["world_size"] == 4 and result["ifname"] == hosts.veth[0]
    single = run_distributed(_single_host, 4, str(tmp_path), timeout=120)[0]
    _assert_close(result["stage2"], single["stage2"], "ZeRO-2, 2 hosts vs 1 host")
    _assert_close(result["stage3"], single["stage3"], "ZeRO-3, 2 hosts vs 1 host")
    # the checkpoint saved by the 2-host ZeRO-3 run loads on one host (world 4, ZeRO-1)
    _assert_close(single["loaded"], result["stage3"], "2-host checkpoint loaded on 1 host")


def _single_host(two_host_dir: str) -> dict:
    out = {"stage2": train(2), "stage3": train(3)}
    out["loaded"] = load_weights(str(Path(two_host_dir) / "ckpt"), 1)  # the 2-host checkpoint, here at ZeRO-1
    return out


@pytest.mark.timeout(60)
def test_wrong_master_address_between_namespaces_is_an_error_within_the_timeout(tmp_path: Path) -> None:
    _needs_netns()
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('must not start')\n")
    with TwoHosts() as hosts:
        wrong = hosts.addr[0].rsplit(".", 1)[0] + ".99"  # in the test subnet, but no host has it
        argv = [sys.executable, "-m", "zerospeed.launcher.runner", "--num_procs", "1", "--nnodes", "2",
                "--node_rank", "1", "--master_addr", wrong, "--master_port", "29513", "--rdzv_timeout", "3",
                str(script)]
        t0 = time.monotonic()
        proc = hosts.start(1, argv, child_env())
        _, err = proc.communicate(timeout=40)
        took = time.monotonic() - t0
    assert proc.returncode == 2, err
    assert f"zerospeed: error: --master_addr/--master_port: cannot reach the master at {wrong}:29513 within 3s" in err
    assert took < 15, took
