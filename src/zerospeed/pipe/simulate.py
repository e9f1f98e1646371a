"""Execute a schedule on paper: per-rank timelines, step time, bubbles, activation stash depth.

The simulator runs each rank's list in order under one of two point-to-point semantics:

* ``"eager"`` (default; the runtime contract): a send is posted and the rank moves on (``isend``;
  the runtime keeps the tensor and the handle alive and waits for all sends before the optimizer
  step); a receive blocks until the matching send has been posted (``recv``, or an ``irecv``
  posted earlier and waited on at the RECV action). Receives are matched in FIFO order per pair
  of ranks, which every generated schedule guarantees, so no tags are needed.
* ``"rendezvous"``: a send and its receive complete together when *both* ranks have reached them
  (blocking ``dist.send``/``dist.recv``; also what NCCL's in-order per-pair stream amounts to).
  It is the strictest semantics: a schedule that completes here completes under ``"eager"`` too,
  so :func:`validate_schedule` checks deadlock freedom under it. Every generated schedule passes;
  GPipe, 1F1B and ZB-H1 even lose no time to it, interleaved 1F1B does (both ranks are busy when
  some hand-overs are due), which is why the runtime posts sends asynchronously.

``comm`` time is charged once per send/receive pair (latency of the transfer). Compute actions
take their cost from :class:`ActionCosts` (or any ``Callable[[Action], float]``); all time on a
rank that is not compute counts as bubble: bubble fraction of a rank is
``(step_time - compute_time) / step_time``, ``step_time`` being the end of the last action anywhere.

Activation stash depth (:func:`peak_activations`) counts, per stage, microbatches whose FORWARD has
run and whose backward has not finished: ``BACKWARD``, or ``BACKWARD_WEIGHT`` when the backward is
split (W still reads the stage's saved inputs). It depends only on each rank's order, not on time.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from zerospeed.pipe.schedule_action import (
    Action,
    ActionKind,
    ScheduleError,
    matching_action,
    peer_stage,
    stage_to_rank,
)

__all__ = [
    "ActionCosts",
    "SimulationResult",
    "TimedAction",
    "execute",
    "format_timeline",
    "peak_activations",
    "simulate",
]

P2PSemantics = Literal["rendezvous", "eager"]


@dataclass(frozen=True)
class ActionCosts:
    """Time units per action kind; ``comm`` is charged once per send/receive pair."""

    forward: float = 1.0
    backward: float = 2.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    comm: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "backward_input", "backward_weight", "comm"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}: cost must be a non-negative number, got {value!r}")

    def __call__(self, action: Action) -> float:
        kind = action.kind
        if kind is ActionKind.FORWARD:
            return float(self.forward)
        if kind is ActionKind.BACKWARD:
            return float(self.backward)
        if kind is ActionKind.BACKWARD_INPUT:
            return float(self.backward_input)
        if kind is ActionKind.BACKWARD_WEIGHT:
            return float(self.backward_weight)
        return float(self.comm)


CostModel = Callable[[Action], float]


@dataclass(frozen=True)
class TimedAction:
    """One executed action. For communication, ``start`` is when this rank reached it (so any
    waiting for the peer is inside ``[start, end)``)."""

    rank: int
    index: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimulationResult:
    timeline: dict[int, list[TimedAction]]
    step_time: float
    compute_time: dict[int, float]
    bubble_fraction: dict[int, float]
    peak_activations: dict[int, int]  # per stage
    peak_rank_activations: dict[int, int]  # per rank, summed over its stages at the same moment
    p2p: str = field(default="eager")

    @property
    def max_bubble_fraction(self) -> float:
        return max(self.bubble_fraction.values(), default=0.0)

    @property
    def mean_bubble_fraction(self) -> float:
        values = list(self.bubble_fraction.values())
        return sum(values) / len(values) if values else 0.0


def _check_p2p(p2p: str) -> None:
    if p2p not in ("rendezvous", "eager"):
        raise ValueError(f"p2p: {p2p!r} is not one of 'rendezvous', 'eager'")


def execute(
    schedule: Mapping[int, Sequence[Action]],
    costs: CostModel | None = None,
    *,
    p2p: P2PSemantics = "eager",
) -> dict[int, list[TimedAction]]:
    """Run every rank's list in order; return the timed actions per rank.

    Raises ScheduleError naming the blocked ranks if execution gets stuck (a deadlock cycle, or a
    rank waiting for a peer that finished without the matching action). Data dependencies between
    compute actions are *not* checked here; :func:`validate_schedule` does that.
    """
    _check_p2p(p2p)
    cost = costs if costs is not None else ActionCosts()
    comm_cost = float(cost(Action(ActionKind.SEND_ACT, 0, 0)))
    owner = stage_to_rank(schedule)
    ranks = sorted(schedule)
    pcs = {rank: 0 for rank in ranks}
    clocks = {rank: 0.0 for rank in ranks}
    timeline: dict[int, list[TimedAction]] = {rank: [] for rank in ranks}
    posted: dict[Action, float] = {}  # eager: send action -> time its data is available

    def peer_of(rank: int, index: int, action: Action) -> int:
        peer = owner.get(peer_stage(action))
        if peer is None or peer not in schedule:
            raise ScheduleError(
                f"peer stage {peer_stage(action)} has no compute actions on any rank",
                rank=rank, index=index, action=action,
            )
        return peer

    def record(rank: int, start: float, end: float) -> None:
        index = pcs[rank]
        timeline[rank].append(TimedAction(rank, index, schedule[rank][index], start, end))
        pcs[rank] = index + 1
        clocks[rank] = end

    progress = True
    while progress:
        progress = False
        for rank in ranks:
            actions = schedule[rank]
            while pcs[rank] < len(actions):
                index = pcs[rank]
                action = actions[index]
                now = clocks[rank]
                if action.kind.is_compute:
                    record(rank, now, now + float(cost(action)))
                elif p2p == "eager":
                    if action.kind.is_send:
                        peer_of(rank, index, action)
                        posted[action] = now + comm_cost
                        record(rank, now, now)
                    else:
                        sent = posted.get(matching_action(action))
                        if sent is None:
                            break
                        record(rank, now, max(now, sent))
                else:
                    peer = peer_of(rank, index, action)
                    peer_pc = pcs[peer]
                    peer_actions = schedule[peer]
                    if peer == rank or peer_pc >= len(peer_actions):
                        break
                    if peer_actions[peer_pc] != matching_action(action):
                        break
                    done = max(now, clocks[peer]) + comm_cost
                    record(peer, clocks[peer], done)
                    record(rank, now, done)
                progress = True
    if any(pcs[rank] < len(schedule[rank]) for rank in ranks):
        raise _deadlock_error(schedule, owner, pcs, p2p)
    return timeline


def _deadlock_error(
    schedule: Mapping[int, Sequence[Action]], owner: Mapping[int, int], pcs: Mapping[int, int],
    p2p: str,
) -> ScheduleError:
    """Follow 'rank waits for peer' edges from the lowest blocked rank to a cycle or a dead end."""
    blocked = [rank for rank in sorted(schedule) if pcs[rank] < len(schedule[rank])]
    chain: list[int] = []
    rank = blocked[0]
    while rank not in chain:
        chain.append(rank)
        action = schedule[rank][pcs[rank]]
        peer = owner[peer_stage(action)]
        if pcs[peer] >= len(schedule[peer]) or peer == rank:
            want = matching_action(action)
            return ScheduleError(
                f"blocked forever under {p2p} point-to-point semantics: rank {peer} "
                f"{'finished' if peer != rank else 'is this rank'} without reaching {want}",
                rank=rank, index=pcs[rank], action=action,
            )
        rank = peer
    cycle = chain[chain.index(rank):]
    steps = []
    for member in cycle:
        action = schedule[member][pcs[member]]
        steps.append(
            f"rank {member} at action {pcs[member]} ({action}) waits for rank "
            f"{owner[peer_stage(action)]}"
        )
    first = cycle[0]
    return ScheduleError(
        f"deadlock under {p2p} point-to-point semantics: " + "; ".join(steps),
        rank=first, index=pcs[first], action=schedule[first][pcs[first]],
    )


def peak_activations(schedule: Mapping[int, Sequence[Action]]) -> tuple[dict[int, int], dict[int, int]]:
    """(peak stash depth per stage, peak summed stash per rank), from each rank's order alone."""
    per_stage: dict[int, int] = {}
    per_rank: dict[int, int] = {}
    for rank in sorted(schedule):
        live: dict[int, int] = {}
        total = peak_total = 0
        for action in schedule[rank]:
            kind = action.kind
            if kind is ActionKind.FORWARD:
                delta = 1
            elif kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                delta = -1
            else:  # communication, or BACKWARD_INPUT (the stash stays until W)
                continue
            live[action.stage] = live.get(action.stage, 0) + delta
            total += delta
            peak_total = max(peak_total, total)
            per_stage[action.stage] = max(per_stage.get(action.stage, 0), live[action.stage])
        per_rank[rank] = peak_total
    return dict(sorted(per_stage.items())), per_rank


def simulate(
    schedule: Mapping[int, Sequence[Action]],
    costs: CostModel | None = None,
    *,
    p2p: P2PSemantics = "eager",
) -> SimulationResult:
    """Timeline, step time, bubble fraction per rank and activation stash depth of a schedule."""
    timeline = execute(schedule, costs, p2p=p2p)
    step_time = max((t.end for items in timeline.values() for t in items), default=0.0)
    compute = {
        rank: sum(t.end - t.start for t in items if t.action.kind.is_compute)
        for rank, items in timeline.items()
    }
    bubble = {
        rank: ((step_time - busy) / step_time if step_time > 0 else 0.0)
        for rank, busy in compute.items()
    }
    per_stage, per_rank = peak_activations(schedule)
    return SimulationResult(
        timeline=timeline, step_time=step_time, compute_time=compute, bubble_fraction=bubble,
        peak_activations=per_stage, peak_rank_activations=per_rank, p2p=p2p,
    )


def format_timeline(result: SimulationResult, unit: float = 1.0) -> str:
    """ASCII chart, one row per rank, one cell per ``unit`` of time (for integral costs).

    Cells show the kind tag and microbatch (``F3``, ``I0``, ``W2``); ``.`` is idle or waiting.
    """
    num_cells = int(round(result.step_time / unit))
    lines = []
    for rank, items in sorted(result.timeline.items()):
        cells = ["."] * num_cells
        for item in items:
            if not item.action.kind.is_compute:
                continue
            tag = f"{item.action.kind.value}{item.action.microbatch}"
            for cell in range(int(round(item.start / unit)), int(round(item.end / unit))):
                cells[cell] = tag
        width = max((len(c) for c in cells), default=1)
        lines.append(f"rank {rank}: " + " ".join(c.ljust(width) for c in cells))
    return "\n".join(lines)
