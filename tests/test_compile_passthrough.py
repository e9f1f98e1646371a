"""Compression wrappers and tensor-parallel layers pass through engine.compile() as one graph.

* Tensor parallelism (autotp 2, world 2, a tiny Llama): the tp collectives are custom ops
  (``zerospeed.comm.traceable``) inside the graph; losses match the eager run to 1e-6 relative, the
  same collectives run per step, and the model is one graph (no break, no skipped frame).
* Compression (weight and activation fake-quantization, sparse / row / head pruning on a tiny GPT):
  no break; one recompile after the first forward, which computes the pruning masks (a Python flag
  the graph guards on), then none while the schedule holds the bit widths (a bit-width change is a
  new constant: one recompile each, counted); losses match eager to 1e-6 relative.
"""

import pytest
import torch

from zerospeed.testing import run_distributed


def _one_graph(rep, recompiles=0):
    """No break and no skipped frame: one graph per compilation of the one frame."""
    assert rep["graph_breaks"] == 0 and rep["recompiles"] == recompiles, str(rep)
    assert rep["graphs"] == rep["frames_compiled"] == 1 + recompiles, str(rep)


def tp_eager_vs_compiled() -> dict:
    import torch._dynamo

    import tp_cases
    from zerospeed import comm

    out = {}
    for backend in (None, "eager"):
        torch._dynamo.reset()
        engine = tp_cases._engine(2, 0, 0, 2)
        if backend:
            engine.compile(backend=backend)
        g = torch.Generator().manual_seed(1)
        losses, calls = [], []
        for _ in range(3):
            comm.COUNTER.reset()
            losses.append(tp_cases._step(engine, torch.randint(0, 64, (4, 8), generator=g)))
            calls.append({op: s["count"] for op, s in comm.COUNTER.snapshot().items()})
        out[backend or "none"] = {"losses": losses, "calls": calls, "report": engine.compile_report()}
    return out


@pytest.mark.timeout(300)
def test_tensor_parallel_layers_compile_as_one_graph_with_their_collectives_inside():
    for r in run_distributed(tp_eager_vs_compiled, 2, timeout=280):
        eager, compiled = r["none"], r["eager"]
        assert max(abs(a - b) / abs(b) for a, b in zip(compiled["losses"], eager["losses"])) < 1e-6
        assert compiled["calls"] == eager["calls"] and compiled["calls"][0]["all_reduce"] > 0
        _one_graph(compiled["report"])


def test_compression_wrappers_compile_as_one_graph():
    import torch._dynamo
    from compression_cases import TINY_GPT, aq, batch, ds, prune, tiny_gpt, wq

    import zerospeed
    from gpt_model import GPTConfig
    from zerospeed.compression import init_compression

    cfg = ds({"weight_quantization": wq(4, ["blocks"], groups=4), "activation_quantization": aq(8, ["blocks"]),
              "sparse_pruning": prune(0.5, ["attn.qkv"]),
              "row_pruning": prune(0.5, ["mlp.fc"], method="topk", related=[["mlp.proj"]]),
              "head_pruning": prune(0.5, ["attn.proj"], num_heads=4, related=[["attn.qkv"]])})
    small = GPTConfig(**{**TINY_GPT.__dict__, "n_layer": 1})
    runs = {}
    for backend in (None, "eager"):
        torch._dynamo.reset()
        model = init_compression(tiny_gpt(cfg=small), cfg)
        engine, *_ = zerospeed.initialize(model=model, config=cfg)
        if backend:
            engine.compile(backend=backend)
        losses = []
        for step in range(3):
            x = batch(step, cfg=small)
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        runs[backend] = (losses, engine.compile_report())
    (eager, _), (compiled, rep) = runs[None], runs["eager"]
    assert max(abs(a - b) / abs(b) for a, b in zip(compiled, eager)) < 1e-6
    # the pruning masks are computed in the first forward (refresh flag), then read: one recompile
    _one_graph(rep, recompiles=1)
    assert "refresh" in rep["recompile_reasons"][0]
