"""ZeRO graph passes: data in, data out. Each pass is ``(graph_module, profile) -> graph_module`` over a
forward or backward graph that ``aot_autograd`` produced with the ops of :mod:`zerospeed.compile.ops`.

* :func:`gather_release` (ZeRO-3) - each ``gather`` (one flat buffer per bucket, the parameters
  are views of it) moves to right before the first node that reads one of its parameters, and a
  ``release`` of the bucket goes right after the last node that reads any of them. A bucket some
  view of which leaves the graph (saved for the backward: a bucket kept by selective unsharding) is
  not released. Under Inductor no release node
  is inserted: Inductor's generated code frees every buffer after its last use itself (and a
  storage-resizing node in an Inductor graph crashed its generated code when tried).
* :func:`prefetch` (ZeRO-3) - a ``gather_start`` for each gather, at least as early as the profile
  says it must start to hide its all-gather behind the compute before it, and earlier while no more
  than ``profile.prefetch_window_bytes`` of other buckets' gathers lie between it and its use; never
  before an earlier bucket's start (all-gathers start in the order of use) and never where the bytes
  of the buckets gathered or in flight would exceed ``profile.memory_limit_bytes``. Starts that end
  up next to each other then share collectives in :func:`coalesce` groups.
* :func:`coalesce` - consecutive buckets in groups that double in bytes (the first group is the
  first bucket; each later one at most all the bytes before it, at most ``profile.coalesce_bytes``):
  the first is ready soonest and each later one has the work on the earlier ones to hide behind.
* :func:`reduce_early` (all stages) - each reduction (``reduce_bucket``, ``reduce_grads``), with the
  nodes that only feed it (the views and the concatenation of a bucket's gradients, which
  ``aot_autograd`` places at the end of the backward graph), moves to right after the last node it
  needs from the rest of the graph: as soon as its last gradient is produced.
* :func:`async_reduce` (ZeRO-3) - the ``reduce_bucket`` nodes become ``reduce_start`` nodes, one per
  :func:`coalesce` group counted from the end of the graph (so the last, exposed one is the
  smallest), each where its group's last member was, and one ``reduce_wait`` per bucket as late as
  possible: right before the graph's output, or, when the bytes of reduce-scatters in flight would
  exceed ``profile.reduce_limit_bytes``, before the start that would exceed it (oldest first). The
  reductions then run while the rest of the backward computes.
* :func:`insert_reduce_grads` (ZeRO-0/1/2) - the backward graph's gradient outputs of the engine's
  parameters go to one ``reduce_grads`` per bucket, and the outputs become ``None`` (autograd never
  accumulates them: the strategy's reducer owns them, so its Python hooks do not fire for them).
* :func:`choose_unsharded` and :func:`tag_recompute` (ZeRO-3, at partition time) - selective
  unsharding: the buckets whose re-gather costs most per byte stay gathered from the forward to the
  backward while they fit a byte budget; every other bucket is re-gathered in the backward (its
  gather is tagged "must recompute" for the partitioner, so the backward graph gets its own gather).

The profile (:class:`Profile`) carries what the passes read: per-node seconds from the profiling
step, bytes and all-gather seconds per bucket, and the limits. Missing figures (before any
profiling step) fall back to byte counts, which is the order a profile would give on a uniform link.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch.fx import GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

from .ops import GATHER, GATHER_START, GATHER_WAIT, REDUCE_BUCKET, REDUCE_GRADS, REDUCE_START, REDUCE_WAIT, RELEASE

GATHERS = (GATHER, GATHER_WAIT)


@dataclass
class Profile:
    """What a pass may read. ``phase``: "forward" or "backward"."""

    phase: str = "forward"
    node_seconds: dict[str, float] = field(default_factory=dict)  # per node name, from the profiling step
    bucket_bytes: dict[int, int] = field(default_factory=dict)  # full (gathered) bytes of each bucket
    gather_seconds: dict[int, float] = field(default_factory=dict)  # measured all-gather time per bucket
    memory_limit_bytes: int | None = None  # gathered + in-flight bucket bytes the prefetch may reach
    prefetch_window_bytes: int | None = 0  # bytes of other buckets' gathers a start may move ahead of
    coalesce_bytes: int | None = None  # most bytes of buckets one all-gather / reduce-scatter may carry
    reduce_limit_bytes: int | None = None  # bytes of reduce-scatters in flight at once (async_reduce)
    owner_key: int = 0
    data: dict[str, Any] = field(default_factory=dict)  # free-form (e.g. "param_of_output" for ZeRO-1/2)


def _bucket(n: Node) -> int:
    return int(n.args[2])


def _order(gm: GraphModule) -> dict[Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def _aliases(n: Node) -> list[Node]:
    """``n`` and every node that is a getitem or a view of it, transitively."""
    out, stack = [], [n]
    while stack:
        x = stack.pop()
        out.append(x)
        for u in x.users:
            if u.op == "call_function" and (u.target is operator.getitem or getattr(u.target, "is_view", False)):
                stack.append(u)
    return out


def _real_users(n: Node) -> list[Node]:
    """Nodes that read one of the bucket's tensors (other than to alias it or release it)."""
    aliases = set(_aliases(n))
    return [u for a in aliases for u in a.users if u not in aliases and u.target is not RELEASE]


def _finish(gm: GraphModule) -> GraphModule:
    gm.graph.lint()
    gm.recompile()
    return gm


def gather_release(gm: GraphModule, profile: Profile) -> GraphModule:
    """Gather right before the first use, release right after the last (see the module docstring)."""
    graph = gm.graph
    for g in [n for n in graph.nodes if n.target in GATHERS]:
        order = _order(gm)
        users = sorted(_real_users(g), key=order.__getitem__)
        if users and order[users[0]] > order[g]:
            first = users[0]
            # the gather and the chain of aliases between it and its first reader move together
            chain = [a for a in sorted(_aliases(g), key=order.__getitem__) if order[a] < order[first]]
            for a in chain:
                first.prepend(a)
        if any(u.op == "output" for u in users):
            continue  # a view of it leaves the graph (saved for backward): released by whoever holds it
        if profile.data.get("compiler") == "inductor":
            continue  # Inductor frees each buffer after its last use itself (an explicit release crashes it)
        order = _order(gm)
        last = max(users, key=order.__getitem__) if users else max(_aliases(g), key=order.__getitem__)
        with graph.inserting_after(last):
            graph.call_function(RELEASE, ([g],)).meta["val"] = None
    return _finish(gm)


def prefetch(gm: GraphModule, profile: Profile) -> GraphModule:
    """Start each bucket's all-gather early enough to hide it, and earlier while the prefetch window
    allows, never beyond the memory limit (see the module docstring)."""
    graph = gm.graph
    limit = profile.memory_limit_bytes
    window = profile.prefetch_window_bytes
    gathers = [n for n in graph.nodes if n.target is GATHER]
    for g in gathers:
        b = _bucket(g)
        nbytes = profile.bucket_bytes.get(b, 0)
        need_s = profile.gather_seconds.get(b, float("inf"))
        live = live_bytes(gm, profile)
        nodes = list(graph.nodes)
        pos = nodes.index(g)
        start, hidden, ahead = pos, 0.0, 0
        while start > 0:
            prev = nodes[start - 1]
            if prev.op == "placeholder" or prev is g.args[0] or prev.target is GATHER_START:
                break  # (all-gathers start in the order the graph uses them)
            if prev.target in GATHERS:  # starting before it: its bucket is also gathered ahead of this use
                ahead += profile.bucket_bytes.get(_bucket(prev), 0)
            if hidden >= need_s and window is not None and ahead + nbytes > window:
                break  # hidden, and the window allows nothing further ahead
            # starting before ``prev`` puts the bucket in flight from the state after the node before it
            if limit is not None and start >= 2 and live[start - 2] + nbytes > limit:
                break
            hidden += profile.node_seconds.get(prev.name, 0.0)
            start -= 1
        if start == pos:
            continue
        with graph.inserting_before(nodes[start]):
            token = graph.call_function(GATHER_START, ([g.args[0]], g.args[1], [g.args[2]]))
        shard_val = g.args[0].meta.get("val") if isinstance(g.args[0], Node) else None
        if shard_val is not None:  # compilers (Inductor) read each node's fake value
            token.meta["val"] = shard_val.new_empty(0)
        g.target = GATHER_WAIT
        g.args = (g.args[0], g.args[1], g.args[2], token)
        g.meta.pop("eager_input_vals", None)  # recorded for the gather's 3 arguments (Inductor reads it)
    _coalesce_starts(gm, profile)
    return _finish(gm)


def coalesce(items: list[tuple[Any, int]], cap: int | None) -> list[list[Any]]:
    """Consecutive ``(item, bytes)`` in groups that double: a group holds at most as many bytes as all
    the groups before it (the first: its first item), and at most ``cap``. The first group is then
    ready soonest, and each later one has the work on the earlier ones to hide behind."""
    groups: list[list[Any]] = []
    current: list[Any] = []
    done = current_bytes = 0
    for item, nbytes in items:
        limit = max(done, items[0][1])
        if cap is not None:
            limit = min(limit, cap)
        if current and current_bytes + nbytes > limit:
            groups.append(current)
            done += current_bytes
            current, current_bytes = [], 0
        current.append(item)
        current_bytes += nbytes
    if current:
        groups.append(current)
    return groups


def _coalesce_starts(gm: GraphModule, profile: Profile) -> None:
    """Adjacent ``gather_start`` nodes (placed at the same point) become one per :func:`coalesce` group."""
    graph = gm.graph
    runs: list[list[Node]] = []
    for n in graph.nodes:
        if n.target is GATHER_START:
            if runs and runs[-1][-1].next is n:
                runs[-1].append(n)
            else:
                runs.append([n])
    for run in runs:
        items = [(n, sum(profile.bucket_bytes.get(b, 0) for b in n.args[2])) for n in run]
        for group in coalesce(items, profile.coalesce_bytes):
            if len(group) == 1:
                continue
            head = group[0]
            head.args = ([s for n in group for s in n.args[0]], head.args[1], [b for n in group for b in n.args[2]])
            for n in group[1:]:
                n.replace_all_uses_with(head)
                graph.erase_node(n)


def live_bytes(gm: GraphModule, profile: Profile) -> list[int]:
    """Bytes of buckets gathered or in flight *after* each node (in graph order)."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    delta = [0] * (len(nodes) + 1)
    for g in (n for n in nodes if n.target in GATHERS):
        nbytes = profile.bucket_bytes.get(_bucket(g), 0)
        token = g.args[3] if len(g.args) > 3 else None
        begin = order[token] if isinstance(token, Node) else order[g]
        releases = [u for a in _aliases(g) for u in a.users if u.target is RELEASE]
        end = order[releases[0]] if releases else len(nodes) - 1
        delta[begin] += nbytes
        delta[end] -= nbytes
    out, run = [], 0
    for i in range(len(nodes)):
        run += delta[i]
        out.append(run)
    return out


def _feeders(r: Node, nodes: list[Node]) -> list[Node]:
    """The nodes before ``r`` that only feed ``r`` (directly or through each other), in graph order:
    the gradient's glue (views, the concatenation of a bucket's gradients) and the computations
    nothing else reads."""
    group = {r}
    pos = nodes.index(r)
    for n in reversed(nodes[:pos]):
        if n.op == "call_function" and n.users and all(u in group for u in n.users) and not n.is_impure():
            group.add(n)
    return [n for n in nodes[:pos] if n in group]


def reduce_early(gm: GraphModule, profile: Profile) -> GraphModule:
    """Each reduction (with what only feeds it) right after the last node it needs from the rest."""
    for r in [n for n in gm.graph.nodes if n.target in (REDUCE_BUCKET, REDUCE_GRADS)]:
        nodes = list(gm.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        moving = _feeders(r, nodes) + [r]
        inside = set(moving)
        external = [a for n in moving for a in n.all_input_nodes if a not in inside]
        if not external:
            continue
        anchor = max(external, key=order.__getitem__)
        cursor = anchor
        for n in moving:
            if order[n] > order[anchor]:
                if n is not cursor.next:
                    cursor.append(n)
                cursor = n
    return _finish(gm)


def async_reduce(gm: GraphModule, profile: Profile) -> GraphModule:
    """Split the ``reduce_bucket`` nodes into starts (shared by :func:`coalesce` groups, counted from
    the end of the graph) and waits (as late as the limit allows)."""
    graph = gm.graph
    out = next(n for n in graph.nodes if n.op == "output")
    limit = profile.reduce_limit_bytes
    reds = [n for n in graph.nodes if n.target is REDUCE_BUCKET]
    sized = [(r, profile.bucket_bytes.get(_bucket(r), 0)) for r in reversed(reds)]
    groups: list[list[Node]] = []
    for group in reversed(coalesce(sized, profile.coalesce_bytes)):  # the last reduction alone: least exposed
        group.reverse()
        if len(group) > 1 and any(len(r.args[0]) != 1 for r in group):
            groups.extend([r] for r in group)  # (one gradient per slot: not shared)
        else:
            groups.append(group)
    in_flight: list[tuple[Node, list[Node], int]] = []  # (start, reductions, bytes), oldest first

    def wait_all(anchor: Node, start: Node, members: list[Node]) -> None:
        for orig in members:
            with graph.inserting_before(anchor):
                wait = graph.call_function(REDUCE_WAIT, (start, orig.args[1], orig.args[2]))
            wait.meta["val"] = orig.meta.get("val")
            orig.replace_all_uses_with(wait)
            graph.erase_node(orig)

    for group in groups:
        last = group[-1]
        nbytes = sum(profile.bucket_bytes.get(_bucket(r), 0) for r in group)
        while limit is not None and in_flight and sum(b for _, _, b in in_flight) + nbytes > limit:
            start, members, _ = in_flight.pop(0)
            wait_all(last, start, members)
        grads = list(last.args[0]) if len(group) == 1 else [r.args[0][0] for r in group]
        with graph.inserting_before(last):
            start = graph.call_function(REDUCE_START, (grads, last.args[1], [_bucket(r) for r in group]))
        val = last.meta.get("val")
        if val is not None:  # compilers (Inductor) read each node's fake value
            start.meta["val"] = val.new_empty(0)
        in_flight.append((start, group, nbytes))
    for start, members, _ in in_flight:
        wait_all(out, start, members)
    return _finish(gm)


def insert_reduce_grads(gm: GraphModule, profile: Profile) -> GraphModule:
    """ZeRO-0/1/2: route the parameters' gradient outputs to one ``reduce_grads`` per bucket.

    ``profile.data["param_of_output"]``: output position -> (bucket index, parameter index); the
    parameter index is what the owner's ``reduce_grads`` resolves."""
    mapping: dict[int, tuple[int, int]] = profile.data.get("param_of_output", {})
    if not mapping:
        return gm
    graph = gm.graph
    out = next(n for n in graph.nodes if n.op == "output")
    values = list(out.args[0])
    expected = profile.data.get("num_inputs")
    if expected is not None and expected != len(values):
        raise RuntimeError(f"insert_reduce_grads: the backward graph has {len(values)} outputs for {expected} "
                           "forward inputs; cannot tell which gradient is which parameter's")
    for i in mapping:
        if i >= len(values):
            raise ValueError(f"insert_reduce_grads: output {i} does not exist (the graph has {len(values)})")
    by_bucket: dict[int, list[tuple[int, int]]] = {}
    for i, (b, p) in sorted(mapping.items()):
        if isinstance(values[i], Node):
            by_bucket.setdefault(b, []).append((i, p))
    order = _order(gm)
    for b, entries in sorted(by_bucket.items()):
        grads = [values[i] for i, _ in entries]
        last = max(grads, key=order.__getitem__)
        with graph.inserting_after(last):
            graph.call_function(REDUCE_GRADS, (grads, profile.owner_key, [p for _, p in entries])).meta["val"] = None
        for i, _ in entries:
            values[i] = None
    out.args = (type(out.args[0])(values),) if isinstance(out.args[0], (list, tuple)) else (values,)
    return _finish(gm)


@dataclass(frozen=True)
class Candidate:
    name: Any
    nbytes: int
    regather_cost_s: float  # what re-gathering it in the backward costs per step


def choose_unsharded(candidates: Iterable[Candidate], budget_bytes: int) -> list[Any]:
    """Names to keep gathered: highest ``regather_cost_s / nbytes`` first, while they fit the budget."""
    if budget_bytes < 0:
        raise ValueError(f"choose_unsharded: budget_bytes must be >= 0, got {budget_bytes}")
    chosen, left = [], budget_bytes
    for c in sorted(candidates, key=lambda c: (-(c.regather_cost_s / max(c.nbytes, 1)), str(c.name))):
        if c.nbytes <= left:
            chosen.append(c.name)
            left -= c.nbytes
    return chosen


def tag_recompute(joint: GraphModule, keep: Iterable[int] = ()) -> GraphModule:
    """Joint graph: every gather (and its aliases) of a bucket not in ``keep`` must be recomputed in
    the backward, so the forward does not hold the gathered parameters until the backward."""
    kept = set(keep)
    for g in [n for n in joint.graph.nodes if n.target is GATHER]:
        if _bucket(g) in kept:
            continue
        for a in _aliases(g):
            a.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            a.meta["ac_graph_id"] = 0
    return joint


PASSES = {
    "gather_release": gather_release,
    "prefetch": prefetch,
    "reduce_early": reduce_early,
    "async_reduce": async_reduce,
    "insert_reduce_grads": insert_reduce_grads,
}
