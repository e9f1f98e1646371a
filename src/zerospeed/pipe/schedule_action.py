"""The vocabulary of pipeline schedules: actions, their communication partners, stage ownership.

A schedule is plain data (design principle 6): ``dict[rank, list[Action]]``, one ordered list per
pipeline rank, that a single runtime executes front to back. Decisions recorded here:

* ``Action.stage`` is the *global virtual stage* index the action belongs to. With interleaving a
  rank owns several stages; without it, stage ``s`` is on rank ``s``. Which rank owns a stage is not
  stored in the actions: it is inferred from where the stage's compute actions appear
  (:func:`stage_to_rank`), and must be unique.
* A communication action carries the stage that runs on *this* rank, as in
  ``torch.distributed.pipelining``: ``SEND_ACT(s, m)`` sends the output of stage ``s`` to the rank
  of stage ``s + 1``, whose ``RECV_ACT(s + 1, m)`` receives it as its input; ``SEND_GRAD(s, m)``
  sends the gradient of stage ``s``'s input to the rank of stage ``s - 1``, whose
  ``RECV_GRAD(s - 1, m)`` receives it as the gradient of its output.
* Communication actions appear only between stages on *different* ranks. When stages ``s`` and
  ``s + 1`` share a rank (interleaving on one rank), the runtime hands the tensor over locally.
* A backward is either one ``BACKWARD`` (input and weight gradients together) or a
  ``BACKWARD_INPUT`` followed later by a ``BACKWARD_WEIGHT`` (zero-bubble split); a schedule may
  not mix both for the same (stage, microbatch).
* Gradient reduction, tied-weight reduction and the optimizer step are not actions: they happen
  once after the whole list has run (as at the end of DeepSpeed's ``TrainSchedule``), so every
  schedule is only the forward/backward work of one step.
"""
from __future__ import annotations

import enum
import functools
from typing import Any
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "matching_action",
    "peer_stage",
    "stage_to_rank",
    "stages_of_rank",
]


class ActionKind(enum.Enum):
    """What one schedule entry does; the value is a short tag used in printouts."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients
    BACKWARD_INPUT = "I"  # zero-bubble "B": gradient w.r.t. the stage input only
    BACKWARD_WEIGHT = "W"  # zero-bubble "W": gradient w.r.t. the stage parameters
    SEND_ACT = "SEND_F"
    RECV_ACT = "RECV_F"
    SEND_GRAD = "SEND_B"
    RECV_GRAD = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_comm(self) -> bool:
        return not self.is_compute

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)

    @property
    def is_backward(self) -> bool:
        """True for the actions that produce the input gradient (``BACKWARD``, ``BACKWARD_INPUT``)."""
        return self in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)


_COMPUTE = frozenset(
    {ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT}
)


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: ``kind`` applied to ``microbatch`` on global virtual ``stage``."""

    kind: ActionKind
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):
            raise ValueError(f"kind: expected an ActionKind, got {self.kind!r}")
        for name in ("stage", "microbatch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected a non-negative int, got {value!r}")

    def __str__(self) -> str:
        return f"{self.kind.name}(stage={self.stage}, mb={self.microbatch})"


Schedule = dict[int, list[Action]]
"""Per-rank ordered action lists, keyed by pipeline rank (0 .. num_ranks - 1)."""


class ScheduleError(ValueError):
    """A schedule is malformed, would compute wrong results, or would deadlock.

    ``rank``, ``index`` and ``action`` point at the offending entry when there is one.
    """

    def __init__(
        self, message: str, *, rank: int | None = None, index: int | None = None,
        action: Action | None = None,
    ) -> None:
        where = ""
        if rank is not None:
            where = f"rank {rank}"
            if index is not None:
                where += f", action {index}"
            if action is not None:
                where += f" ({action})"
            where += ": "
        super().__init__(where + message)
        self.message = message
        self.rank = rank
        self.index = index
        self.action = action

    def __reduce__(self) -> tuple[Any, tuple[str]]:  # picklable with the keyword-only fields (issue #27)
        return functools.partial(type(self), rank=self.rank, index=self.index, action=self.action), (self.message,)


def peer_stage(action: Action) -> int:
    """The stage on the other end of a communication action (may be out of range if malformed)."""
    kind = action.kind
    if kind in (ActionKind.SEND_ACT, ActionKind.RECV_GRAD):
        return action.stage + 1
    if kind in (ActionKind.RECV_ACT, ActionKind.SEND_GRAD):
        return action.stage - 1
    raise ValueError(f"action: {action} is not a communication action")


_MATCH = {
    ActionKind.SEND_ACT: ActionKind.RECV_ACT,
    ActionKind.RECV_ACT: ActionKind.SEND_ACT,
    ActionKind.SEND_GRAD: ActionKind.RECV_GRAD,
    ActionKind.RECV_GRAD: ActionKind.SEND_GRAD,
}


def matching_action(action: Action) -> Action:
    """The action the peer rank must execute to complete this send or receive."""
    return Action(_MATCH[action.kind], peer_stage(action), action.microbatch)


def stage_to_rank(schedule: Mapping[int, Sequence[Action]]) -> dict[int, int]:
    """Infer which rank owns each stage from where the stage's compute actions are.

    Raises ScheduleError if one stage's compute actions appear on two ranks.
    """
    owner: dict[int, int] = {}
    for rank in sorted(schedule):
        for index, action in enumerate(schedule[rank]):
            if not action.kind.is_compute:
                continue
            first = owner.setdefault(action.stage, rank)
            if first != rank:
                raise ScheduleError(
                    f"stage {action.stage} already has compute actions on rank {first}; "
                    "a stage must live on exactly one rank",
                    rank=rank, index=index, action=action,
                )
    return owner


def stages_of_rank(schedule: Mapping[int, Sequence[Action]]) -> dict[int, list[int]]:
    """Sorted list of the stages each rank runs (several with interleaving)."""
    owner = stage_to_rank(schedule)
    result: dict[int, list[int]] = {rank: [] for rank in schedule}
    for stage, rank in sorted(owner.items()):
        result[rank].append(stage)
    return result
