"""``backend_fn``: a torch.compile backend that runs graph passes over the forward and backward FX
graphs (built on ``aot_autograd``), then hands them to Inductor or runs them eagerly.

Decisions:

* A pass is ``(graph_module, profile) -> graph_module``; passes run in list order on the forward
  graph, then the same list on the backward graph (``profile.phase`` says which), after which the
  graph is linted and recompiled, so a pass that leaves a broken graph fails at compile time, not
  mid-step. A pass that does not return a GraphModule is named.
* Partitioning uses torch's min-cut partitioner; before it runs, the joint graph goes through
  ``joint_passes`` (DeepCompile tags ZeRO-3 gathers "must recompute" there, so the backward graph
  re-gathers instead of keeping every parameter from the forward); after it, the forward and
  backward graphs go together through ``partition_passes`` (activation offload rewrites what the
  forward saves for the backward there).
* ``compiler="inductor"`` compiles each rewritten graph with ``compile_fx_inner`` (Inductor's
  per-graph entry, the one ``torch.compile`` itself uses after partitioning), with Inductor's
  decompositions; ``"eager"`` runs ``GraphModule.forward``; ``"profile"`` runs the graph under an
  FX interpreter that times each node into ``profile.node_seconds`` (the profiling step).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from .zero_passes import Profile

Pass = Callable[[torch.fx.GraphModule, Profile], torch.fx.GraphModule]
COMPILERS = ("inductor", "eager", "profile")

__all__ = ["COMPILERS", "Pass", "Profile", "backend_fn", "run_passes"]


def run_passes(gm: torch.fx.GraphModule, passes: Sequence[Pass], profile: Profile) -> torch.fx.GraphModule:
    for p in passes:
        out = p(gm, profile)
        if not isinstance(out, torch.fx.GraphModule):
            name = getattr(p, "__name__", repr(p))
            raise TypeError(f"compile pass {name} returned {type(out).__name__}, expected a torch.fx.GraphModule")
        gm = out
    gm.graph.lint()
    gm.recompile()
    return gm


class _Timed(torch.fx.Interpreter):
    """Runs a graph node by node, adding each node's wall time to ``seconds`` (name -> s)."""

    def __init__(self, gm: torch.fx.GraphModule, seconds: dict[str, float]) -> None:
        super().__init__(gm)
        self.seconds = seconds

    def run_node(self, n: torch.fx.Node) -> Any:
        t0 = time.perf_counter()
        out = super().run_node(n)
        self.seconds[n.name] = time.perf_counter() - t0
        return out


def _boxed(fn: Callable[..., Any]) -> Callable[[list], Any]:
    def call(args: list) -> Any:
        return fn(*args)

    call._boxed_call = True  # type: ignore[attr-defined]
    return call


def _check_passes(passes: Sequence[Any]) -> None:
    for p in passes:
        if not callable(p):
            raise TypeError(f"backend_fn: a pass must be callable (graph_module, profile) -> graph_module, "
                            f"got {type(p).__name__}")


def backend_fn(passes: Sequence[Pass] = (), data: dict[str, Any] | None = None, compiler: str = "eager",
               profile_for: Callable[[str], Profile] | None = None,
               joint_passes: Sequence[Callable[[torch.fx.GraphModule], Any]] = (),
               bw_passes: Sequence[Pass] | None = None,
               on_profiled: Callable[[str], None] | None = None,
               partition_passes: Sequence[Callable[[torch.fx.GraphModule, torch.fx.GraphModule], Any]] = (),
               ) -> Callable[..., Any]:
    """A Dynamo backend running ``passes`` over the forward and backward graphs.

    ``profile_for(phase)`` gives each graph its :class:`Profile` (default: an empty one carrying
    ``data``); ``bw_passes`` (default: ``passes``) run over the backward graph; ``on_profiled(phase)``
    is called after each timed run of a graph (``compiler="profile"``); ``partition_passes`` see the
    forward and backward graphs together, right after partitioning (``fn(forward, backward)``: what
    the forward saves for the backward is what both agree on)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    _check_passes(passes)
    _check_passes(bw_passes or ())
    if compiler not in COMPILERS:
        raise ValueError(f"backend_fn: compiler must be one of {', '.join(COMPILERS)}, got {compiler!r}")

    def make_profile(phase: str) -> Profile:
        if profile_for is not None:
            return profile_for(phase)
        return Profile(phase=phase, data=dict(data or {}))

    def compile_graph(phase: str) -> Callable[..., Any]:
        graph_passes = passes if phase == "forward" or bw_passes is None else bw_passes

        def compile_(gm: torch.fx.GraphModule, example_inputs: Any, **_: Any) -> Any:
            profile = make_profile(phase)
            gm = run_passes(gm, graph_passes, profile)
            if compiler == "profile":
                def timed(*args: Any) -> Any:
                    out = _Timed(gm, profile.node_seconds).run(*args)
                    if on_profiled is not None:
                        on_profiled(phase)
                    return out

                return _boxed(timed)
            if compiler == "inductor":
                from torch._inductor.compile_fx import compile_fx_inner

                return compile_fx_inner(gm, example_inputs, is_backward=phase == "backward")
            return make_boxed_func(gm.forward)

        return compile_

    def partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        for jp in joint_passes:
            jp(joint)
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        for pp in partition_passes:
            pp(fw, bw)
        return fw, bw

    kwargs: dict[str, Any] = {}
    if compiler == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        kwargs["decompositions"] = select_decomp_table()
    return aot_autograd(fw_compiler=compile_graph("forward"), bw_compiler=compile_graph("backward"),
                        partition_fn=partition, **kwargs)
