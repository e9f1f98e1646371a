"""Check that a schedule computes the right thing and cannot deadlock, without processes.

:func:`validate_schedule` raises :class:`ScheduleError` naming the rank, the action index and the
action at fault. Checks, in order (the first failure is reported):

1. shape: ranks are ints, entries are :class:`Action`, stages and microbatches in range;
2. ownership: each stage's compute actions are on one rank (``stage_to_rank`` if given is obeyed);
   communication actions sit on the rank of their stage and cross to a *different* rank;
3. local order: FORWARD(s, m) after its input is available (RECV_ACT(s, m), or FORWARD(s-1, m)
   when stage s-1 is on the same rank), BACKWARD/BACKWARD_INPUT(s, m) after FORWARD(s, m) and after
   its output gradient is available (RECV_GRAD(s, m) or the backward of s+1 on the same rank),
   BACKWARD_WEIGHT after BACKWARD_INPUT, sends after the compute that produces what they send;
   no entry twice;
4. completeness: every (stage, microbatch) forwarded once and backwarded once (one BACKWARD, or
   one BACKWARD_INPUT plus one BACKWARD_WEIGHT);
5. matching: every send has exactly one matching receive on the peer rank and vice versa, and on
   each directed pair of ranks receives come in the order of the sends (FIFO matching, no tags);
6. deadlock: the lists run to completion under blocking rendezvous point-to-point
   (``simulate.execute``); a stuck run reports the cycle of waiting ranks.

Together, 3 + 5 + 6 give the cross-rank orders: FORWARD(s, m) runs after FORWARD(s-1, m) and
BACKWARD(s, m) after BACKWARD(s+1, m), through the matched send/receive.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from zerospeed.pipe.schedule_action import (
    Action,
    ActionKind,
    ScheduleError,
    matching_action,
    peer_stage,
)
from zerospeed.pipe.simulate import P2PSemantics, execute

__all__ = ["validate_schedule"]

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
I, W = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


def _check_shape(schedule: Mapping[int, Sequence[Action]], num_stages: int, num_microbatches: int) -> None:
    if not isinstance(schedule, Mapping) or not schedule:
        raise ScheduleError(f"schedule: expected a non-empty dict rank -> list of actions, got {schedule!r}")
    for rank, actions in schedule.items():
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ScheduleError(f"schedule: rank keys must be non-negative ints, got {rank!r}")
        for index, action in enumerate(actions):
            if not isinstance(action, Action):
                raise ScheduleError(f"expected an Action, got {action!r}", rank=rank, index=index)
            if action.stage >= num_stages:
                raise ScheduleError(f"stage out of range (num_stages={num_stages})",
                                    rank=rank, index=index, action=action)
            if action.microbatch >= num_microbatches:
                raise ScheduleError(f"microbatch out of range (num_microbatches={num_microbatches})",
                                    rank=rank, index=index, action=action)


def _owners(schedule: Mapping[int, Sequence[Action]], num_stages: int,
            given: Mapping[int, int] | None) -> dict[int, int]:
    owner: dict[int, int] = dict(given) if given is not None else {}
    for stage, rank in owner.items():
        if rank not in schedule:
            raise ScheduleError(f"stage_to_rank: stage {stage} maps to rank {rank}, "
                                f"which is not in the schedule (ranks {sorted(schedule)})")
    for rank in sorted(schedule):
        for index, action in enumerate(schedule[rank]):
            if not action.kind.is_compute:
                continue
            first = owner.setdefault(action.stage, rank)
            if first != rank:
                reason = "stage_to_rank puts it" if given is not None else "its compute actions are"
                raise ScheduleError(f"stage {action.stage} runs on rank {first} ({reason} there)",
                                    rank=rank, index=index, action=action)
    for stage in range(num_stages):
        if stage not in owner:
            raise ScheduleError(f"stage {stage} has no compute actions on any rank")
    return owner


def _positions(schedule: Mapping[int, Sequence[Action]]) -> dict[int, dict[Action, int]]:
    positions: dict[int, dict[Action, int]] = {}
    for rank in sorted(schedule):
        seen: dict[Action, int] = {}
        for index, action in enumerate(schedule[rank]):
            if action in seen:
                raise ScheduleError(f"appears twice (first at action {seen[action]})",
                                    rank=rank, index=index, action=action)
            seen[action] = index
        positions[rank] = seen
    return positions


def _check_local_order(schedule, owner, positions, num_stages) -> None:  # noqa: C901 - one table of rules
    for rank in sorted(schedule):
        pos = positions[rank]

        def before(needed: Action, index: int, action: Action, why: str) -> None:
            at = pos.get(needed)
            if at is None or at > index:
                where = "is missing on this rank" if at is None else f"comes later (action {at})"
                raise ScheduleError(f"needs {needed} before it ({why}), which {where}",
                                    rank=rank, index=index, action=action)

        for index, action in enumerate(schedule[rank]):
            s, m, kind = action.stage, action.microbatch, action.kind
            if kind.is_comm:
                if owner[s] != rank:
                    raise ScheduleError(f"stage {s} runs on rank {owner[s]}, not here",
                                        rank=rank, index=index, action=action)
                peer = peer_stage(action)
                if not 0 <= peer < num_stages:
                    raise ScheduleError(f"stage {peer} does not exist", rank=rank, index=index, action=action)
                if owner[peer] == rank:
                    raise ScheduleError(
                        f"stages {min(s, peer)} and {max(s, peer)} are both on this rank; "
                        "their hand-over is local and must not be scheduled as communication",
                        rank=rank, index=index, action=action)
            if kind is F and s > 0:
                dep = (Action(F, s - 1, m) if owner[s - 1] == rank else Action(ActionKind.RECV_ACT, s, m))
                before(dep, index, action, "its input activation")
            elif kind.is_backward:
                before(Action(F, s, m), index, action, "its own forward")
                if s + 1 < num_stages:
                    if owner[s + 1] == rank:
                        kind_next = I if Action(I, s + 1, m) in pos else B
                        before(Action(kind_next, s + 1, m), index, action, "its output gradient")
                    else:
                        before(Action(ActionKind.RECV_GRAD, s, m), index, action, "its output gradient")
            elif kind is W:
                before(Action(I, s, m), index, action, "the input-gradient half of the backward")
            elif kind is ActionKind.SEND_ACT:
                before(Action(F, s, m), index, action, "the forward that produces the activation")
            elif kind is ActionKind.SEND_GRAD:
                produced = Action(I, s, m) if Action(I, s, m) in pos else Action(B, s, m)
                before(produced, index, action, "the backward that produces the gradient")


def _check_complete(owner, positions, num_stages, num_microbatches) -> None:
    for s in range(num_stages):
        rank = owner[s]
        pos = positions[rank]
        for m in range(num_microbatches):
            if Action(F, s, m) not in pos:
                raise ScheduleError(f"{Action(F, s, m)} is missing", rank=rank)
            full, split_i, split_w = (Action(k, s, m) in pos for k in (B, I, W))
            if full and (split_i or split_w):
                which = Action(I, s, m) if split_i else Action(W, s, m)
                raise ScheduleError(f"has both a full BACKWARD and the split {which.kind.name}",
                                    rank=rank, index=pos[Action(B, s, m)], action=Action(B, s, m))
            if not full and not split_i:
                raise ScheduleError(f"no backward for stage {s}, microbatch {m} "
                                    "(BACKWARD or BACKWARD_INPUT is missing)", rank=rank)
            if split_i and not split_w:
                raise ScheduleError(f"{Action(W, s, m)} is missing (BACKWARD_INPUT without its "
                                    "BACKWARD_WEIGHT)", rank=rank, index=pos[Action(I, s, m)],
                                    action=Action(I, s, m))


def _check_matching(schedule, owner, positions) -> None:
    channels: dict[tuple[int, int], tuple[list[Action], list[Action]]] = {}
    for rank in sorted(schedule):
        for index, action in enumerate(schedule[rank]):
            if action.kind.is_compute:
                continue
            peer = owner[peer_stage(action)]
            want = matching_action(action)
            if want not in positions[peer]:
                raise ScheduleError(f"has no matching {want} on rank {peer}",
                                    rank=rank, index=index, action=action)
            src, dst = (rank, peer) if action.kind.is_send else (peer, rank)
            sends, recvs = channels.setdefault((src, dst), ([], []))
            (sends if action.kind.is_send else recvs).append(action)
    for (src, dst), (sends, recvs) in sorted(channels.items()):
        for k, (sent, received) in enumerate(zip(sends, recvs)):
            if matching_action(sent) != received:
                index = positions[dst][received]
                raise ScheduleError(
                    f"receives from rank {src} out of order: message #{k} that rank {src} sends is "
                    f"{sent}, but this rank's receive #{k} expects {matching_action(received)}",
                    rank=dst, index=index, action=received)


def validate_schedule(
    schedule: Mapping[int, Sequence[Action]],
    num_stages: int,
    num_microbatches: int,
    *,
    stage_to_rank: Mapping[int, int] | None = None,
    p2p: P2PSemantics = "rendezvous",
) -> None:
    """Raise ScheduleError if ``schedule`` is not a correct, deadlock-free training step.

    ``p2p`` selects the point-to-point semantics of the deadlock check; the default, rendezvous
    (blocking send and receive), is the strictest, and passing it implies passing ``"eager"``.
    """
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive int, got {value!r}")
    _check_shape(schedule, num_stages, num_microbatches)
    owner = _owners(schedule, num_stages, stage_to_rank)
    positions = _positions(schedule)
    _check_local_order(schedule, owner, positions, num_stages)
    _check_complete(owner, positions, num_stages, num_microbatches)
    _check_matching(schedule, owner, positions)
    execute(schedule, lambda action: 1.0, p2p=p2p)
