"""Pipeline schedules as data: generators for GPipe, 1F1B, interleaved 1F1B and zero-bubble H1.

Each generator decides only the *compute order* of every rank; :func:`insert_communication` then
adds the sends and receives so that the lists are safe under blocking (rendezvous) point-to-point
and FIFO message matching (see ``schedule_comm``). Every result passes :func:`validate_schedule`.
Step times below are what ``simulate`` measures (and the tests assert) with per-stage costs
F, B (= I + W when split), no communication cost, ``p`` ranks, ``m`` microbatches.

* ``gpipe``: all forwards, then all backwards (in microbatch order, as torch's ScheduleGPipe).
  Stash depth ``m`` on every stage; step ``(m + p - 1)(F + B)``.
* ``one_f_one_b``: PipeDream-Flush as in DeepSpeed's ``TrainSchedule``: stage ``s`` runs
  ``min(p - s - 1, m)`` warm-up forwards, then alternates forward/backward, then drains. Stash
  depth ``min(p - s, m)`` (DeepSpeed's ``num_pipe_buffers``); step ``(m + p - 1)(F + B)``, so
  the bubble fraction is ``(p - 1) / (m + p - 1)`` on every rank.
* ``interleaved_1f1b``: Megatron-LM's interleaved schedule. ``p = num_ranks`` ranks, ``v`` virtual
  stages per rank, stage ``s`` on rank ``s % p``. Microbatches go through a rank's chunks in groups
  of ``p``; rank ``r`` warms up with ``(p - r - 1) * 2 + (v - 1) * p`` forwards. Like Megatron we
  require ``num_microbatches % num_ranks == 0``. Step ``(v m + p - 1)(F + B)`` with F, B the
  cost of one virtual stage and asynchronous sends: the bubble shrinks ``v``-fold.
* ``zero_bubble_h1``: ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024). The
  backward is split into ``BACKWARD_INPUT`` (on the critical path) and ``BACKWARD_WEIGHT`` (free to
  move). Warm-up as 1F1B; stage ``s`` then delays its weight gradients by ``s`` steady steps, so
  every stage keeps at most ``p`` microbatches stashed, the same peak as 1F1B's stage 0, while
  the delayed ``W`` fill the drain bubbles. Step ``m (F + I + W) + (p - 1)(F + I - W)`` for
  ``m >= p``: the paper's ZB-H1 bubble, a third of 1F1B's when F = I = W.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from zerospeed.pipe.schedule_action import Action, ActionKind, Schedule
from zerospeed.pipe.schedule_comm import insert_communication
from zerospeed.pipe.simulate import CostModel

__all__ = [
    "SCHEDULE_NAMES",
    "build_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "zero_bubble_h1",
]

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
I, W = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be a positive int, got {value!r}")
    return value


def gpipe(num_stages: int, num_microbatches: int, *, costs: CostModel | None = None) -> Schedule:
    """GPipe: every stage forwards all microbatches, then runs all backwards."""
    p = _positive_int("num_stages", num_stages)
    m = _positive_int("num_microbatches", num_microbatches)
    orders = {
        s: [Action(F, s, mb) for mb in range(m)] + [Action(B, s, mb) for mb in range(m)]
        for s in range(p)
    }
    return insert_communication(orders, costs)


def _one_f_one_b_order(stage: int, p: int, m: int, split: bool) -> list[Action]:
    """1F1B compute order of one stage; with ``split``, ZB-H1's I/W variant."""
    warmup = min(p - stage - 1, m)
    order = [Action(F, stage, mb) for mb in range(warmup)]
    pending_w: deque[int] = deque()

    def backward(mb: int) -> None:
        if split:
            order.append(Action(I, stage, mb))
            pending_w.append(mb)
        else:
            order.append(Action(B, stage, mb))

    for step in range(m - warmup):
        order.append(Action(F, stage, warmup + step))
        backward(step)
        if split and step >= stage:  # delay W by `stage` steps: stash peaks at p on every stage
            order.append(Action(W, stage, pending_w.popleft()))
    for mb in range(m - warmup, m):
        backward(mb)
        if split:
            order.append(Action(W, stage, pending_w.popleft()))
    while pending_w:
        order.append(Action(W, stage, pending_w.popleft()))
    return order


def one_f_one_b(num_stages: int, num_microbatches: int, *, costs: CostModel | None = None) -> Schedule:
    """1F1B (PipeDream-Flush), DeepSpeed's training schedule."""
    p = _positive_int("num_stages", num_stages)
    m = _positive_int("num_microbatches", num_microbatches)
    return insert_communication({s: _one_f_one_b_order(s, p, m, False) for s in range(p)}, costs)


def zero_bubble_h1(num_stages: int, num_microbatches: int, *, costs: CostModel | None = None) -> Schedule:
    """ZB-H1: 1F1B with the backward split into BACKWARD_INPUT and delayed BACKWARD_WEIGHT."""
    p = _positive_int("num_stages", num_stages)
    m = _positive_int("num_microbatches", num_microbatches)
    return insert_communication({s: _one_f_one_b_order(s, p, m, True) for s in range(p)}, costs)


def interleaved_1f1b(
    num_ranks: int, num_microbatches: int, virtual_stages_per_rank: int, *,
    costs: CostModel | None = None,
) -> Schedule:
    """Megatron's interleaved 1F1B over ``num_ranks * virtual_stages_per_rank`` stages."""
    p = _positive_int("num_ranks", num_ranks)
    m = _positive_int("num_microbatches", num_microbatches)
    v = _positive_int("virtual_stages_per_rank", virtual_stages_per_rank)
    if m % p != 0:
        raise ValueError(
            f"num_microbatches: interleaved_1f1b needs a multiple of num_ranks ({p}), got {m} "
            "(Megatron-LM's constraint: microbatches enter each rank's chunks in groups of num_ranks)"
        )
    total = m * v

    def unit(k: int, backward: bool) -> tuple[int, int]:
        """(chunk, microbatch) of a rank's k-th forward (or backward) unit of work."""
        chunk = (k // p) % v
        if backward:
            chunk = v - 1 - chunk
        return chunk, (k // (p * v)) * p + k % p

    orders: dict[int, list[Action]] = {}
    for rank in range(p):
        warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
        order: list[Action] = []

        def emit(kind: ActionKind, k: int) -> None:
            chunk, mb = unit(k, kind is B)
            order.append(Action(kind, chunk * p + rank, mb))

        for k in range(warmup):
            emit(F, k)
        for k in range(total - warmup):
            emit(F, warmup + k)
            emit(B, k)
        for k in range(total - warmup, total):
            emit(B, k)
        orders[rank] = order
    return insert_communication(orders, costs)


_GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zero_bubble": zero_bubble_h1,
}
_ALIASES = {
    "one_f_one_b": "1f1b", "pipedream_flush": "1f1b", "interleaved": "interleaved_1f1b",
    "zero_bubble_h1": "zero_bubble", "zb_h1": "zero_bubble", "zbh1": "zero_bubble",
}
SCHEDULE_NAMES: tuple[str, ...] = tuple(_GENERATORS)


def build_schedule(
    name: str,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    *,
    num_ranks: int | None = None,
    virtual_stages_per_rank: int = 1,
    costs: CostModel | None = None,
) -> Schedule:
    """Build a schedule by name: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zero_bubble"``.

    ``num_stages`` counts global (virtual) stages. For ``interleaved_1f1b`` give any two of
    ``num_stages``, ``num_ranks``, ``virtual_stages_per_rank`` that agree
    (``num_stages == num_ranks * virtual_stages_per_rank``); the others take ``num_stages`` (or
    ``num_ranks``, which must then equal it) and ``virtual_stages_per_rank == 1``.
    """
    if not isinstance(name, str):
        raise ValueError(f"name: expected a schedule name, got {name!r}")
    key = name.strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in _GENERATORS:
        raise ValueError(f"name: {name!r} is not one of {', '.join(SCHEDULE_NAMES)}")
    if num_microbatches is None:
        raise ValueError("num_microbatches: required")
    v = _positive_int("virtual_stages_per_rank", virtual_stages_per_rank)
    if num_ranks is not None:
        _positive_int("num_ranks", num_ranks)
    if num_stages is not None:
        _positive_int("num_stages", num_stages)
    if key == "interleaved_1f1b":
        if num_ranks is None:
            if num_stages is None:
                raise ValueError("num_ranks: required for interleaved_1f1b (or give num_stages)")
            if num_stages % v:
                raise ValueError(
                    f"num_stages: {num_stages} is not a multiple of virtual_stages_per_rank ({v})")
            num_ranks = num_stages // v
        elif num_stages is not None and num_stages != num_ranks * v:
            raise ValueError(
                f"num_stages: {num_stages} != num_ranks ({num_ranks}) * "
                f"virtual_stages_per_rank ({v})")
        return interleaved_1f1b(num_ranks, num_microbatches, v, costs=costs)
    if v != 1:
        raise ValueError(
            f"virtual_stages_per_rank: {key} runs one stage per rank, got {v} "
            "(use 'interleaved_1f1b')")
    if num_stages is None:
        if num_ranks is None:
            raise ValueError("num_stages: required")
        num_stages = num_ranks
    elif num_ranks is not None and num_ranks != num_stages:
        raise ValueError(f"num_ranks: {num_ranks} != num_stages ({num_stages}) for {key}")
    return _GENERATORS[key](num_stages, num_microbatches, costs=costs)
