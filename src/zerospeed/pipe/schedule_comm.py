"""Turn per-rank compute orders into complete schedules with explicit, deadlock-free communication.

The rule the runtime relies on: **every rank's list is the projection of one global order in which
each send/receive pair is a single event.** Then blocking (rendezvous) point-to-point cannot
deadlock: take the earliest event in the global order that is still pending; both of its ranks have
finished everything before it in their lists (computes never block, earlier events are done), so
both are standing at it and it completes. It also follows that, on every directed pair of ranks,
messages are received in the order they are sent, so FIFO matching without tags (NCCL) is correct.

How the global order is chosen (only the performance depends on it, never correctness):

1. Run the compute orders on paper with ``costs`` (compute-only, communication free and instant) to
   get each action's start and end.
2. A message from producer X (rank a) to consumer Y (rank b) may be placed at any time T with
   ``end(X) <= T <= start(Y)``. We take the earliest T at which neither rank is in the middle of a
   compute, so that the rendezvous costs no one any time; if no such T exists we take the T where
   the two ranks' next free moments are closest (the shortest forced wait).
3. Sort every rank's computes (by start) and events (by T, events before computes starting at the
   same T; ties between events broken by a key shared by both ranks) into its list.
"""
from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

from zerospeed.pipe.schedule_action import Action, ActionKind, Schedule, ScheduleError, stage_to_rank
from zerospeed.pipe.simulate import ActionCosts, CostModel

__all__ = ["insert_communication"]


class _Busy:
    """Sorted compute intervals of one rank, for 'is this rank mid-compute at time t' queries."""

    def __init__(self, intervals: list[tuple[float, float]]) -> None:
        self.starts = [start for start, _ in intervals]
        self.ends = [end for _, end in intervals]

    def free_at(self, t: float) -> float:
        """``t`` if the rank is at a compute boundary or idle at ``t``, else the end of that compute."""
        i = bisect.bisect_left(self.starts, t) - 1  # last compute starting strictly before t
        if i >= 0 and self.ends[i] > t:
            return self.ends[i]
        return t

    def boundaries(self, low: float, high: float) -> list[float]:
        points = [s for s in self.starts if low <= s <= high]
        points += [e for e in self.ends if low <= e <= high]
        return points


def _dependencies(action: Action, num_stages: int) -> list[tuple[str, int, int]]:
    """Producers an action needs, as (table, stage, microbatch): 'F' forward ends, 'B' input-grad ends."""
    s, m = action.stage, action.microbatch
    if action.kind is ActionKind.FORWARD:
        return [("F", s - 1, m)] if s > 0 else []
    if action.kind.is_backward:
        deps = [("F", s, m)]
        if s + 1 < num_stages:
            deps.append(("B", s + 1, m))
        return deps
    return [("B", s, m)]  # BACKWARD_WEIGHT needs its BACKWARD_INPUT


def _time_compute(
    orders: Mapping[int, Sequence[Action]], owner: Mapping[int, int], costs: CostModel
) -> tuple[dict[int, list[tuple[float, float]]], list[tuple[int, int, Action, float, float]]]:
    """Compute-only list scheduling. Returns per-rank intervals and the cross-rank edges
    ``(producer_rank, consumer_rank, consumer, producer_end, consumer_start)``."""
    num_stages = max(owner) + 1 if owner else 0
    done: dict[tuple[str, int, int], float] = {}
    intervals: dict[int, list[tuple[float, float]]] = {rank: [] for rank in orders}
    edges: list[tuple[int, int, Action, float, float]] = []
    pcs = {rank: 0 for rank in orders}
    clocks = {rank: 0.0 for rank in orders}
    progress = True
    while progress:
        progress = False
        for rank in sorted(orders):
            actions = orders[rank]
            while pcs[rank] < len(actions):
                action = actions[pcs[rank]]
                deps = _dependencies(action, num_stages)
                if any(dep not in done for dep in deps):
                    break
                start = max([clocks[rank]] + [done[dep] for dep in deps])
                end = start + float(costs(action))
                for table, stage, mb in deps:
                    producer_rank = owner[stage]
                    if producer_rank != rank:
                        edges.append((producer_rank, rank, action, done[(table, stage, mb)], start))
                if action.kind is ActionKind.FORWARD:
                    done[("F", action.stage, action.microbatch)] = end
                elif action.kind.is_backward:
                    done[("B", action.stage, action.microbatch)] = end
                intervals[rank].append((start, end))
                clocks[rank] = end
                pcs[rank] += 1
                progress = True
    for rank in sorted(orders):
        if pcs[rank] < len(orders[rank]):
            action = orders[rank][pcs[rank]]
            missing = [d for d in _dependencies(action, num_stages) if d not in done]
            raise ScheduleError(
                f"compute order cannot run: waits for {missing} which never runs before it "
                "(dependency cycle between ranks, or a missing action)",
                rank=rank, index=pcs[rank], action=action,
            )
    return intervals, edges


def _place(busy_a: _Busy, busy_b: _Busy, ready: float, deadline: float) -> float:
    t = ready
    while True:
        free = max(busy_a.free_at(t), busy_b.free_at(t))
        if free == t:
            break
        t = free
    if t <= deadline:
        return t
    candidates = sorted({ready, deadline, *busy_a.boundaries(ready, deadline),
                         *busy_b.boundaries(ready, deadline)})
    return min(candidates, key=lambda c: (abs(busy_a.free_at(c) - busy_b.free_at(c)), c))


def insert_communication(
    compute_orders: Mapping[int, Sequence[Action]], costs: CostModel | None = None
) -> Schedule:
    """Add SEND/RECV actions to per-rank compute orders (see module docstring for the rule).

    ``compute_orders`` must contain only compute actions, each stage on one rank, stages numbered
    0 .. S-1. ``costs`` (positive for every compute kind) only steers where messages go.
    """
    cost = costs if costs is not None else ActionCosts()
    for rank, actions in compute_orders.items():
        for index, action in enumerate(actions):
            if not action.kind.is_compute:
                raise ScheduleError("compute orders must not contain communication",
                                    rank=rank, index=index, action=action)
            if not float(cost(action)) > 0:
                raise ValueError(f"costs: must be positive for {action.kind.name} to order messages")
    owner = stage_to_rank(compute_orders)
    missing = sorted(set(range(max(owner) + 1 if owner else 0)) - set(owner))
    if missing:
        raise ScheduleError(f"stages {missing} have no compute actions on any rank")
    intervals, edges = _time_compute(compute_orders, owner, cost)
    busy = {rank: _Busy(items) for rank, items in intervals.items()}

    keyed: dict[int, list[tuple[tuple, Action]]] = {rank: [] for rank in compute_orders}
    for rank, actions in compute_orders.items():
        for index, (action, (start, _)) in enumerate(zip(actions, intervals[rank])):
            keyed[rank].append(((start, 1, index, 0, 0), action))
    for producer_rank, consumer_rank, consumer, ready, deadline in edges:
        s, m = consumer.stage, consumer.microbatch
        if consumer.kind is ActionKind.FORWARD:
            send, recv, tag = Action(ActionKind.SEND_ACT, s - 1, m), Action(ActionKind.RECV_ACT, s, m), 0
        else:
            send, recv, tag = Action(ActionKind.SEND_GRAD, s + 1, m), Action(ActionKind.RECV_GRAD, s, m), 1
        when = _place(busy[producer_rank], busy[consumer_rank], ready, deadline)
        key = (when, 0, tag, s, m)  # identical on both ranks: one global event
        keyed[producer_rank].append((key, send))
        keyed[consumer_rank].append((key, recv))
    return {rank: [action for _, action in sorted(items, key=lambda kv: kv[0])]
            for rank, items in sorted(keyed.items())}
