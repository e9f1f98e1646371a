"""DeepCompile (``compile.deepcompile: true``): the ZeRO gathers, releases and reductions inside the graphs.

Parity: at ZeRO stages 0-3, world 2, a tiny GPT trained with ``engine.compile(backend="eager")`` under
DeepCompile matches the same run without compile. fp32: 1e-6 relative on every per-step loss and
final weight (the graphs run the same kernels; the bound allows reassociation only); bf16 (stage
3): 1e-2 relative (bf16 rounds at 8 bits; both runs round the same kernels, the reduce-scatter sums
in a different place). Inductor (stage 3): losses 1e-5 relative (fused C++ kernels sum in another
order); weights 2e-3 relative: AdamW's first steps move every element by about lr whatever the size of
its gradient, so an element whose gradient is ~0 can move differently after a reassociation.
Each compiled run has 0 graph breaks, no more collective calls per step than eager, and its report
shows the collectives ran inside the graphs (gathers and reduce-scatters at stage 3, the gradients
of every parameter handed to the reducer at stages 0-2).
"""

import pytest
import torch

from compile_cases import deep_vs_eager, deepcompile_after_a_failed_backward, deepcompile_refusal
from zerospeed.testing import run_distributed


def _rel(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


def _check(pair, tol, stage, weight_tol=None):
    eager, compiled = pair["eager"], pair["compiled"]
    assert max(abs(a - b) / abs(b) for a, b in zip(compiled["losses"], eager["losses"])) < tol, stage
    worst = max((_rel(compiled["weights"][k], eager["weights"][k]) for k in eager["weights"]), default=0)
    assert worst < (weight_tol or tol), (stage, worst)
    assert all(c <= e for c, e in zip(compiled["calls"], eager["calls"])), (stage, compiled["calls"], eager["calls"])
    rep = compiled["report"]
    assert rep["deepcompile"] and rep["graph_breaks"] == 0, (stage, rep["graph_break_reasons"])
    assert rep["graphs"] == 1 + rep["recompiles"], rep  # one graph per compilation: nothing split
    ops = rep["graph_ops"]
    if stage == 3:
        # per step: one gather per bucket in forward, one in backward for every bucket not kept
        assert ops["gather"] > 0 and ops["reduce_bucket"] > 0, ops
        assert ops["prefetched"] > 0, ops  # the schedules' prefetch started some all-gathers early
        # buckets started together shared one collective (prefetch's and async_reduce's coalescing)
        assert ops["gather_collectives"] < ops["gather"] and ops["reduce_collectives"] < ops["reduce_bucket"], ops
    else:
        assert ops["grads_in_graph"] == pair["num_params"] * len(compiled["losses"]), ops
    return rep


@pytest.mark.timeout(400)
def test_deepcompile_matches_eager_at_stages_0_to_3_without_graph_breaks():
    # stage 3 then sees two new sequence lengths and the first again (16, 16 -> 8 -> 12 -> 16)
    results = run_distributed(deep_vs_eager, 2, [0, 1, 2, 3], "eager", "fp32", 2, None, (8, 12, 16), (3,),
                              timeout=380)
    assert results[0][0]["eager"]["weights"]  # consolidated on rank 0
    for r in results:
        for stage, pair in r.items():
            rep = _check(pair, 1e-6, stage)
            if stage == 3:
                # profiling step, then the optimized graph: one recompile, named; the first new sequence
                # length: one recompile, after which the graph is dynamic (12 and 16 again: none)
                assert len(pair["compiled"]["losses"]) == 5
                assert rep["recompiles"] == 2 and "BACKEND_MATCH" in rep["recompile_reasons"][0], rep
                assert "size mismatch" in rep["recompile_reasons"][1], rep
                assert rep["schedule"][0] == [0, ["gather_release", "reduce_early"]]
                assert rep["schedule"][1][1][-1] == "async_reduce"


@pytest.mark.numeric  # Inductor's C++ kernels are generated for the ISA in effect (make test-isa)
@pytest.mark.timeout(400)
def test_deepcompile_zero3_inductor_with_activation_offload_and_bf16():
    # one phase (no profiling step): Inductor compiles the forward and backward graphs once, with
    # the all-gathers prefetched (no profile: as early as the limits allow) and async reduce-scatters;
    # saved activations of at least 1 KiB wait in host memory between the forward and the backward;
    # 2 micro-steps per optimizer step: the unsharded buckets stay gathered from the first micro-step's
    # forward to the second's (no all-gather there), until the optimizer step changes their shards
    schedule = [(0, ["gather_release", "prefetch", "selective_unshard", "reduce_early", "async_reduce"])]
    extra = {"offload_activation": True, "free_activation_threshold": 1024}
    results = run_distributed(deep_vs_eager, 2, [3], "inductor", "fp32", 4, schedule, (), (), extra, 2, timeout=380)
    assert results[0][3]["eager"]["weights"]
    ops = _check(results[0][3], 1e-5, 3, weight_tol=2e-3)["graph_ops"]
    assert ops["offloaded"] > 0 and ops["reloaded"] == ops["offloaded"] and ops["offloaded_bytes"] >= 1024, ops
    calls = results[0][3]["compiled"]["calls"]
    assert ops["resident"] > 0 and calls[1] < calls[0] and calls[3] < calls[2], (ops, calls)
    results = run_distributed(deep_vs_eager, 2, [3], "eager", "bf16", 2, timeout=380)
    _check(results[0][3], 1e-2, 3)


@pytest.mark.timeout(400)
def test_deepcompile_matches_eager_in_bf16_at_stages_0_to_2():
    # stage 3 in bf16 is in the Inductor test above
    for r in run_distributed(deep_vs_eager, 2, [0, 1, 2], "eager", "bf16", 2, timeout=380):
        for stage, pair in r.items():
            assert pair["eager"]["param_dtype"] == pair["compiled"]["param_dtype"] == "torch.bfloat16"
            _check(pair, 1e-2, stage)


def test_deepcompile_with_parameter_offload_is_refused_in_one_line(tmp_path):
    message = run_distributed(deepcompile_refusal, 1, str(tmp_path), timeout=120)[0]
    assert message == ("engine.compile: compile.deepcompile does not support zero_optimization.offload_param "
                       "(a graph reads the shards directly); disable one of them")


def test_a_collective_left_started_by_a_failed_step_is_completed_and_dropped():
    # the next forward waits for it and drops it; the training goes on with the same losses as without it
    for left, clean in run_distributed(deepcompile_after_a_failed_backward, 2, timeout=200):
        assert left == clean and len(left) == 3
