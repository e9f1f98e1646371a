"""Backward passes of one pipeline stage: full, and split into input and weight parts (ZB-H1).

A stage's backward takes the stage outputs (or the scaled loss on the last stage) and the gradient
of each output, and must produce (a) the gradient of each stage input, sent to the previous stage,
and (b) the parameter gradients, accumulated into ``param.grad``. :func:`full_backward` does both
in one ``torch.autograd.backward`` call. Zero-bubble schedules split it: ``BACKWARD_INPUT`` must
deliver (a) as early as possible, ``BACKWARD_WEIGHT`` delivers (b) later.

How the split works (:class:`SplitBackward`), exactly, for any autograd graph:

1. Walk the graph from the outputs' ``grad_fn``. The *input closure* ``C`` is every node from which
   a stage input's gradient accumulator is reachable: the nodes that ``BACKWARD_INPUT`` must run.
2. The *weight frontier* is every edge ``u -> (w, slot)`` with ``u`` in ``C`` and ``w`` not in
   ``C``: all gradient that reaches the parameters from the input path crosses one of these edges.
   ``BACKWARD_INPUT`` is one ``torch.autograd.grad`` call from the outputs that depend on the
   inputs, asking for the inputs *and* the frontier edges (``GradientEdge``), with
   ``retain_graph=True``: autograd stops at the frontier, so no weight-only work runs, and we keep
   the gradient arriving at each frontier edge.
3. ``BACKWARD_WEIGHT`` is one ``torch.autograd.grad`` from the frontier edges (seeded with the kept
   gradients) and from the outputs that do not depend on the inputs (left out of step 2, so
   nothing they contribute is counted twice), to the parameters; the results are added to
   ``param.grad``. Every path from an input-dependent output to a parameter crosses the frontier
   exactly once, so the sum equals the full backward's.

The one graph shape where step 2 would run weight-only work early and count it twice is a frontier
node reachable from another frontier node (a parameter used both raw and through a transform, on
two separate paths). We detect it and fall back to *recompute*: ``BACKWARD_INPUT`` computes only
the input gradients, ``BACKWARD_WEIGHT`` runs the backward again to the parameters. Exact, but
the weight part costs a whole backward. The same fallback serves a stage whose inputs need no
gradient (the first stage): there the input part is empty and the weight part is the whole
backward, which is where ZB-H1 wants it.

Non-reentrant activation checkpointing works with both: each backward call recomputes what it
unpacks. Parameter gradients written here do not go through post-accumulate-grad hooks (the runtime
reduces gradients after the schedule, not from hooks).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["SplitBackward", "full_backward", "grad_node"]


def grad_node(tensor: torch.Tensor) -> Node | None:
    """The autograd node a gradient for ``tensor`` flows into (its grad accumulator for a leaf)."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    if not tensor.requires_grad:
        return None
    # A leaf's AccumulateGrad node is created lazily; a view exposes it as its only next function.
    return tensor.view_as(tensor).grad_fn.next_functions[0][0]


def _seeds(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None] | None
           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs that take part in autograd, with their gradients (ones for a scalar loss)."""
    kept, kept_grads = [], []
    for i, out in enumerate(outputs):
        if not out.requires_grad:
            continue
        grad = None if grads is None else grads[i]
        if grad is None:
            grad = torch.ones_like(out)
        kept.append(out)
        kept_grads.append(grad)
    return kept, kept_grads


def _accumulate(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    for p, g in zip(params, grads):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g.detach().clone() if g.requires_grad else g
        else:
            p.grad.add_(g)


def full_backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None] | None,
                  inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """One backward through the stage. Parameter gradients accumulate into ``.grad`` (hooks fire);
    returns the gradient of each input (``None`` where an input needs none or got none)."""
    kept, kept_grads = _seeds(outputs, grads)
    for x in inputs:
        if x.requires_grad:
            x.grad = None
    if kept:
        torch.autograd.backward(kept, kept_grads)
    result = []
    for x in inputs:
        result.append(x.grad if x.requires_grad else None)
        if x.requires_grad:
            x.grad = None
    return result


class SplitBackward:
    """One (stage, micro-batch)'s backward in two calls: :meth:`input_grads`, then :meth:`weight_grads`."""

    def __init__(self, outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None] | None,
                 inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
        self._outputs, self._grads = _seeds(outputs, grads)
        self._inputs = list(inputs)
        self._params = [p for p in params if p.requires_grad]
        self._frontier: list[GradientEdge] = []
        self._frontier_grads: list[torch.Tensor] = []
        self._free_outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._input_path: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.recompute = False  # True when the exact frontier split is not possible (see module doc)
        self._done_input = False

    # ------------------------------------------------------------------ graph analysis
    def _plan(self) -> None:
        input_nodes = {n for n in (grad_node(x) for x in self._inputs if x.requires_grad) if n is not None}
        roots = [o.grad_fn for o in self._outputs if o.grad_fn is not None]
        parents: dict[Node, list[Node]] = {}
        seen: set[Node] = set()
        stack = list(roots)
        seen.update(roots)
        while stack:
            node = stack.pop()
            for child, _ in node.next_functions:
                if child is None:
                    continue
                parents.setdefault(child, []).append(node)
                if child not in seen:
                    seen.add(child)
                    stack.append(child)
        closure = set(n for n in input_nodes if n in seen)
        stack = list(closure)
        while stack:
            node = stack.pop()
            for parent in parents.get(node, ()):
                if parent not in closure:
                    closure.add(parent)
                    stack.append(parent)
        if not closure:
            self.recompute = True  # inputs need no gradient (first stage): all work is weight work
            return
        frontier: dict[tuple[Node, int], None] = {}
        for node in closure:
            for child, slot in node.next_functions:
                if child is not None and child not in closure:
                    frontier[(child, slot)] = None
        targets = {node for node, _ in frontier}
        # Frontier nodes must not reach each other through weight-only nodes, else step 2 of the
        # module doc would run (and count) part of the weight work during the input pass.
        stack = [c for node in targets for c, _ in node.next_functions if c is not None]
        below: set[Node] = set()
        while stack:
            node = stack.pop()
            if node in below:
                continue
            below.add(node)
            stack.extend(c for c, _ in node.next_functions if c is not None)
        if below & targets:
            self.recompute = True
            return
        self._frontier = [GradientEdge(node, slot) for node, slot in frontier]
        for out, grad in zip(self._outputs, self._grads):
            if grad_node(out) in closure:
                self._input_path.append((out, grad))
            else:  # does not depend on the inputs: all its work is weight work, seeded in the W pass
                self._free_outputs.append((out, grad))

    # ------------------------------------------------------------------ the two halves
    def input_grads(self) -> list[torch.Tensor | None]:
        """Gradients of the stage inputs (``None`` where not needed); no parameter gradient yet."""
        if self._done_input:
            raise RuntimeError("SplitBackward.input_grads: called twice")
        self._done_input = True
        wanted = [x for x in self._inputs if x.requires_grad]
        if not self._outputs:
            return [None] * len(self._inputs)
        self._plan()
        edges: list[torch.Tensor | GradientEdge] = list(wanted)
        if not self.recompute:
            edges += self._frontier
        if not edges:
            return [None] * len(self._inputs)
        if self.recompute:
            outputs, seeds = self._outputs, self._grads
        else:  # outputs independent of the inputs stay out of this pass (they would reach the frontier)
            outputs = [o for o, _ in self._input_path]
            seeds = [g for _, g in self._input_path]
        grads = torch.autograd.grad(outputs, edges, seeds, retain_graph=True, allow_unused=True)
        if not self.recompute:
            kept = []
            for edge, g in zip(self._frontier, grads[len(wanted):]):
                if g is not None:
                    kept.append((edge, g))
            self._frontier = [e for e, _ in kept]
            self._frontier_grads = [g for _, g in kept]
        by_input = iter(grads[:len(wanted)])
        return [next(by_input) if x.requires_grad else None for x in self._inputs]

    def weight_grads(self) -> None:
        """Accumulate the parameter gradients into ``param.grad``; frees the graph."""
        if not self._done_input:
            raise RuntimeError("SplitBackward.weight_grads: input_grads must run first")
        if not self._params or not self._outputs:
            self._release()
            return
        if self.recompute:
            sources: list[torch.Tensor | GradientEdge] = list(self._outputs)
            seeds = list(self._grads)
        else:
            sources = list(self._frontier) + [o for o, _ in self._free_outputs]
            seeds = list(self._frontier_grads) + [g for _, g in self._free_outputs]
        if sources:
            grads = torch.autograd.grad(sources, self._params, seeds, allow_unused=True)
            with torch.no_grad():
                _accumulate(self._params, grads)
        self._release()

    def _release(self) -> None:
        self._outputs, self._grads, self._inputs = [], [], []
        self._frontier, self._frontier_grads, self._free_outputs, self._input_path = [], [], [], []
