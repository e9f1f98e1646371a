"""Bytes on a real network link (issue #28): ZeRO-2, ZeRO-3 and ZeRO++ on 2 network namespaces x 2 processes.

* The veth's rx + tx over 3 steps, per step, against the ZeRO formula per host link (2Ψ x 4 B at ZeRO-2, 3Ψ x 4 B
  at ZeRO-3, Ψ the padded bucket elements): at most 1.1x (TCP/IP headers and the small control all-reduces ride on
  top), and the comms counter's inter-host bytes for host A equal the formula's collective bytes.
* ZeRO++ (qwZ + qgZ + hpZ) against plain ZeRO-3 over 20 steps on the same hosts: the loss within 3% at every step.
  Why 3% and not an ulp bound: int8 weights move each element by up to absmax(block)/254 and int4 gradients by up
  to absmax(block)/14 per level, which no longer sums to a bitwise-comparable run; 3% is the issue's accuracy
  target for ZeRO++ (DeepSpeed's paper reports the same order on its models), and the test checks it is not met
  trivially (the runs differ, the model trains). On the link: at most 0.25x plain ZeRO-3's bytes.
* hpZ alone on the same hosts: bit for bit plain ZeRO-3's losses (the secondary partition holds the primary
  gather's exact values), with backward's gather kept off the link (2Ψ instead of 3Ψ).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from multihost_util import TESTS, child_env
from netns_hosts import TwoHosts, unavailable_reason

pytestmark = pytest.mark.multihost


def _launch(hosts: TwoHosts, tmp_path: Path, port: int, args: list[str], timeout: float = 200) -> None:
    """Run comm_link_worker.py with ``args`` under zerospeed's launcher on both hosts (2 processes each); on a
    time-out or a failure the hosts' processes are killed (``hosts.close``) and the test fails naming the host."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{hosts.names[0]} slots=2\n{hosts.names[1]} slots=2\n")
    env = child_env(PYTHONPATH=f"{child_env()['PYTHONPATH']}:{TESTS}")
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "ZEROSPEED_HIERARCHICAL", "ZEROSPEED_FAST_PATHS"):
        env.pop(var, None)
    argv = [sys.executable, "-m", "zerospeed.launcher.runner", "--hostfile", str(hostfile), "--master_port",
            str(port), "--rdzv_timeout", "60", str(TESTS / "comm_link_worker.py"), str(tmp_path), *args]
    procs = [hosts.start(h, argv, env) for h in (0, 1)]
    for h, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=timeout)
        except Exception:
            hosts.close()
            raise AssertionError(f"host {h} did not finish within {timeout:g}s")
        if proc.returncode != 0:
            hosts.close()
            raise AssertionError(f"host {h}: {err[-3000:]}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,passes", [(2, 2), (3, 3)])
def test_link_bytes_at_most_1_1x_the_zero_formula(tmp_path: Path, stage: int, passes: int) -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with TwoHosts(names=("hostA", "hostB"), hostnames=("box", "box")) as hosts:
        _launch(hosts, tmp_path, 29531 + stage, [str(stage)])
    got = json.loads((tmp_path / f"links-{stage}.json").read_text())
    formula = passes * got["psi"] * 4
    assert formula <= got["counted"] <= 1.01 * formula, (got, formula)
    assert got["veth"] <= 1.1 * formula, (got, formula)
    assert got["veth"] >= 0.95 * formula, (got, formula)  # the bytes did cross the link


ZEROPP = {"plain": {}, "hpz": {"zero_hpz_partition_size": 2},
          "all": {"zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": 2}}


@pytest.mark.timeout(600)
def test_zeropp_on_two_hosts_within_3_percent_of_zero3_and_hpz_exact(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with TwoHosts(names=("hostA", "hostB"), hostnames=("box", "box")) as hosts:
        for i, (name, keys) in enumerate(ZEROPP.items()):
            _launch(hosts, tmp_path, 29541 + i, ["3", name, json.dumps(keys)], timeout=170)
    got = {name: json.loads((tmp_path / f"zeropp-{name}.json").read_text()) for name in ZEROPP}
    plain, every, hpz = got["plain"]["losses"], got["all"]["losses"], got["hpz"]["losses"]
    assert len(plain) == len(every) == 20
    assert plain[-1] < 0.9 * plain[0], plain  # it trains
    for step, (a, b) in enumerate(zip(every, plain)):
        assert abs(a - b) <= 0.03 * b, (step, a, b)
    assert every != plain  # the quantized path ran
    assert got["all"]["kernel"] in ("torch", "c")
    assert got["all"]["veth"] <= 0.25 * got["plain"]["veth"], (got["all"]["veth"], got["plain"]["veth"])
    assert hpz == plain  # hpZ alone: exact
    # backward's gather stays on the host: 2 of plain ZeRO-3's 3 passes cross the link (+ headers, control)
    assert 0.62 * got["plain"]["veth"] <= got["hpz"]["veth"] <= 0.70 * got["plain"]["veth"], got
