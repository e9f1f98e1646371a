"""Bytes on a real network link (issue #28): ZeRO-2 and ZeRO-3 on 2 network namespaces x 2 processes.

The veth's rx + tx over 3 steps, per step, against the ZeRO formula per host link (2Ψ x 4 B at ZeRO-2, 3Ψ x 4 B at
ZeRO-3, Ψ the padded bucket elements): at most 1.1x (TCP/IP headers and the small control all-reduces ride on
top), and the comms counter's inter-host bytes for host A equal the formula's collective bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from multihost_util import TESTS, child_env
from netns_hosts import TwoHosts, unavailable_reason

pytestmark = pytest.mark.multihost


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,passes", [(2, 2), (3, 3)])
def test_link_bytes_at_most_1_1x_the_zero_formula(tmp_path: Path, stage: int, passes: int) -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    hostfile = tmp_path / "hostfile"
    with TwoHosts(names=("hostA", "hostB"), hostnames=("box", "box")) as hosts:
        hostfile.write_text(f"{hosts.names[0]} slots=2\n{hosts.names[1]} slots=2\n")
        env = child_env(PYTHONPATH=f"{child_env()['PYTHONPATH']}:{TESTS}")
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "ZEROSPEED_HIERARCHICAL"):
            env.pop(var, None)
        argv = [sys.executable, "-m", "zerospeed.launcher.runner", "--hostfile", str(hostfile), "--master_port",
                str(29531 + stage), "--rdzv_timeout", "60", str(TESTS / "comm_link_worker.py"), str(tmp_path),
                str(stage)]
        procs = [hosts.start(h, argv, env) for h in (0, 1)]
        for h, proc in enumerate(procs):
            try:
                _, err = proc.communicate(timeout=200)
            except Exception:
                hosts.close()
                raise AssertionError(f"host {h} did not finish within 200s")
            assert proc.returncode == 0, f"host {h}: {err[-3000:]}"
    got = json.loads((tmp_path / f"links-{stage}.json").read_text())
    formula = passes * got["psi"] * 4
    assert formula <= got["counted"] <= 1.01 * formula, (got, formula)
    assert got["veth"] <= 1.1 * formula, (got, formula)
    assert got["veth"] >= 0.95 * formula, (got, formula)  # the bytes did cross the link
