"""Topology-aware collectives (issue #28): two-level reduce-scatter / all-gather / all-reduce when a group spans
hosts, and the comms counter's bytes per link.

A world of 4 is seen as 2 hosts x 2 processes through the launcher's numbering (tests/comm_cases.py); the same
code runs across real network namespaces in tests/test_multihost_netns.py. What is checked:

* hierarchical == flat to the bit when every partial sum is exact (integer-valued fp32), and for general inputs
  hierarchical == a single-process simulation of its reduction order to the bit (the pairwise reduce-scatter sums
  in rank order, see zerospeed.comm.hierarchical), with flat within the analytic bound 2 (N-1) u sum|x_i|;
* per host link, the bytes the counter attributes to inter-host traffic equal the ZeRO formula: 2Ψ x 4 B (rx +
  tx) per step at ZeRO-2, 3Ψ x 4 B at ZeRO-3, Ψ the padded bucket elements; flat collectives exceed it;
* the comms logger's line per op says the MB sent inside the host and across hosts, the counter's figures.
"""

from __future__ import annotations

import pytest
import torch

from comm_cases import collectives, comms_logger_lines, rank_input, zero_step_bytes
from zerospeed.testing import run_distributed

WORLD, PER_HOST = 4, 2
N = 6000  # elements per rank: above hierarchical.MIN_NUMEL (4096)


def _host_link_bytes(results: list[dict], ops: tuple[str, ...], host: int = 0) -> int:
    """rx + tx of ``host``'s link: what its ranks sent across, twice (the traffic is symmetric between 2 hosts)."""
    sent = sum(r["comms"][op]["inter_host_bytes"] for rank, r in enumerate(results) if rank // PER_HOST == host
               for op in ops if op in r["comms"])
    return 2 * sent


def _simulated(inputs: list[torch.Tensor], hierarchical: bool) -> torch.Tensor:
    """The reduce-scatter's sum, in the order the algorithm adds (one IEEE add per element per step)."""
    if not hierarchical:
        acc = inputs[0].clone()
        for x in inputs[1:]:
            acc.add_(x)
        return acc
    hosts = []
    for h in range(WORLD // PER_HOST):
        s = inputs[h * PER_HOST].clone()
        for x in inputs[h * PER_HOST + 1:(h + 1) * PER_HOST]:
            s.add_(x)
        hosts.append(s)
    acc = hosts[0]
    for s in hosts[1:]:
        acc.add_(s)
    return acc


@pytest.mark.timeout(120)
def test_hierarchical_equals_flat_bit_exactly_on_exact_sums_and_link_bytes():
    hier = run_distributed(collectives, WORLD, PER_HOST, N, True, True, timeout=100)
    flat = run_distributed(collectives, WORLD, PER_HOST, N, True, False, timeout=100)
    for rank in range(WORLD):
        for key in ("shard", "gathered", "summed"):
            assert torch.equal(hier[rank][key], flat[rank][key]), (rank, key)
    inputs = [rank_input(WORLD * N, True, rank=r) for r in range(WORLD)]
    total = _simulated(inputs, False)
    for rank in range(WORLD):
        assert torch.equal(hier[rank]["shard"], total[rank * N:(rank + 1) * N])
        assert torch.equal(hier[rank]["summed"], total[: WORLD * N - 3])
        assert torch.equal(hier[rank]["gathered"], torch.cat([rank_input(N, True, rank=r) for r in range(WORLD)]))
    _check_link_bytes(hier, flat)


@pytest.mark.timeout(120)
def test_hierarchical_matches_its_simulation_and_flat_within_the_bound():
    hier = run_distributed(collectives, WORLD, PER_HOST, N, False, True, timeout=100)
    flat = run_distributed(collectives, WORLD, PER_HOST, N, False, False, timeout=100)
    inputs = [rank_input(WORLD * N, False, rank=r) for r in range(WORLD)]
    want_hier, want_flat = _simulated(inputs, True), _simulated(inputs, False)
    bound = 2 * (WORLD - 1) * torch.finfo(torch.float32).eps / 2 * sum(x.abs() for x in inputs)
    for rank in range(WORLD):
        mine = slice(rank * N, (rank + 1) * N)
        assert torch.equal(hier[rank]["shard"], want_hier[mine])
        assert torch.equal(flat[rank]["shard"], want_flat[mine])
        assert torch.equal(hier[rank]["summed"], want_hier[: WORLD * N - 3])  # reduce-scatter, then all-gather
        assert bool(((hier[rank]["shard"] - flat[rank]["shard"]).abs() <= bound[mine]).all())
        assert torch.equal(hier[rank]["summed"], hier[0]["summed"])  # every rank holds the same bits


def _check_link_bytes(hier: list[dict], flat: list[dict]) -> None:
    message = WORLD * N * 4
    # two-level: a host's link carries (H-1)/H = half of the message per direction, per pass
    assert _host_link_bytes(hier, ("reduce_scatter",)) == message
    assert _host_link_bytes(hier, ("all_gather",)) == message
    padded = -(-(WORLD * N - 3) // WORLD) * WORLD
    assert _host_link_bytes(hier, ("all_reduce",)) == 2 * padded * 4
    # flat over 4 ranks on 2 hosts: the pairwise reduce-scatter sends 2 of its 3 chunks across (twice the two-level
    # figure), the ring all-gather crosses at ranks 1 and 3 (3/4 of the message each)
    assert _host_link_bytes(flat, ("reduce_scatter",)) == 2 * message
    assert _host_link_bytes(flat, ("all_gather",)) == 2 * 3 * message // 4
    for r in hier:  # every leg's bytes are somewhere: the intra-host legs move the rest
        assert r["comms"]["reduce_scatter"]["intra_host_bytes"] == message // 2


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage,passes", [(2, 2), (3, 3)])
def test_zero_link_bytes_equal_the_formula(stage, passes):
    hier = run_distributed(zero_step_bytes, WORLD, stage, True, timeout=200)
    psi = hier[0]["padded_numel"]
    assert psi >= hier[0]["num_params"] and psi - hier[0]["num_params"] < WORLD * hier[0]["num_buckets"]
    ops = ("reduce_scatter", "all_gather")
    assert _host_link_bytes(hier, ops) == passes * psi * 4  # 2Ψ x 4 B (ZeRO-2), 3Ψ x 4 B (ZeRO-3), rx + tx
    everything = _host_link_bytes(hier, tuple(hier[0]["comms"]))  # + the scalar all-reduces (norm, overflow)
    assert everything <= 1.01 * passes * psi * 4
    flat = run_distributed(zero_step_bytes, WORLD, stage, False, timeout=200)
    assert _host_link_bytes(flat, ops) > 1.4 * passes * psi * 4
    for k, v in flat[0]["weights"].items():  # the same training, to the reduction-order bound of fp32 Adam
        torch.testing.assert_close(hier[0]["weights"][k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(200)
def test_comms_logger_reports_intra_and_inter_host_bytes() -> None:
    import re

    got = run_distributed(comms_logger_lines, WORLD, timeout=150)[0]
    pattern = re.compile(r"comms (\w+): (\d+) calls, \d+ elements, [\d.]+ MB this step; sent ([\d.]+) MB inside "
                         r"the host, ([\d.]+) MB across hosts")
    seen = {}
    for line in got["lines"]:
        m = pattern.fullmatch(line)
        assert m, line
        seen[m.group(1)] = (int(m.group(2)), float(m.group(3)), float(m.group(4)))
    for op in ("reduce_scatter", "all_gather"):
        counts = got["counted"][op]
        calls, intra_mb, inter_mb = seen[op]
        assert calls == counts["count"]
        assert intra_mb == round(counts["intra_host_bytes"] / 1e6, 3) and intra_mb > 0
        assert inter_mb == round(counts["inter_host_bytes"] / 1e6, 3) and inter_mb > 0
