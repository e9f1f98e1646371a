"""The gather trace recorded on the first step, and the prefetch / keep-resident decisions it drives.

A *pass* is one forward of the root module and the backward that follows it (one micro-step).
Each time a module with ZeRO-3 parameters is about to run forward, or its backward is about to
run, the runtime reports an *event* ``(module, phase, buckets)``. The first complete pass (a
forward followed by a backward) is recorded; later passes are checked against it event by event.

* Prefetch (``stage3_prefetch_bucket_size``): after each event, the buckets of the next events
  are gathered ahead, in trace order, until the elements being fetched ahead would exceed the
  prefetch bucket size. Backward events are not prefetched while gradients are disabled (an
  evaluation forward has no backward).
* Keep resident (``stage3_max_reuse_distance``): when a module finishes, a bucket whose next use
  in the trace is closer than the reuse distance (elements gathered by the events in between;
  0 never keeps) is not released, as long as at most ``stage3_max_live_parameters`` elements
  are gathered.
* Bound (``stage3_max_live_parameters``): prefetching stops, and buckets kept for reuse are
  evicted (farthest next use first), before gathered elements exceed this bound. Buckets a module
  is using right now are never evicted, so the bound can be exceeded by one module's needs.

A pass that departs from the trace (the model's control flow changed) stops prefetching for the
rest of the pass, and the trace is recorded again on the next pass (DeepSpeed does the same). The
runtime first confirms with the watchdog that every rank departed identically.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Iterable, Sequence


@dataclass(frozen=True)
class TraceEvent:
    plan_id: int  # id of the module's plan: identifies the module
    phase: str  # "forward" or "backward"
    module: str  # dotted module name (for messages)
    buckets: tuple[int, ...]  # indices of the buckets the module needs

    def same_as(self, other: "TraceEvent") -> bool:
        return self.plan_id == other.plan_id and self.phase == other.phase and self.buckets == other.buckets


class GatherTrace:
    def __init__(self) -> None:
        self.events: list[TraceEvent] = []
        self.complete = False
        self.cursor = 0  # next event expected in the current pass
        self.following = False  # the current pass matches the complete trace so far
        self._recording = True  # the current pass is being recorded
        self._uses: dict[int, list[int]] = {}  # bucket -> sorted event positions
        self._prefix: list[int] = [0]  # elements gathered by events before position i

    # -- passes -----------------------------------------------------------------------------------
    def begin_pass(self) -> None:
        self.cursor = 0
        if self.complete:
            self.following = True
            self._recording = False
        else:  # a recording that did not reach a backward (an evaluation forward) starts over
            self.events.clear()
            self.following = False
            self._recording = True

    def observe(self, event: TraceEvent) -> str:
        """``"recorded"``, ``"match"``, ``"off"`` (not following), or ``"mismatch"``."""
        if self._recording:
            self.events.append(event)
            return "recorded"
        if not self.following:
            return "off"
        if self.cursor < len(self.events) and self.events[self.cursor].same_as(event):
            self.cursor += 1
            return "match"
        return "mismatch"

    def expected(self) -> TraceEvent | None:
        return self.events[self.cursor] if self.following and self.cursor < len(self.events) else None

    def invalidate(self) -> None:
        """The model's control flow changed: stop following; record again from the next pass."""
        self.complete = False
        self.following = False
        self._recording = False
        self.events = []
        self._uses = {}

    def finish_backward(self, bucket_numel: Sequence[int]) -> bool:
        """End of a pass with a backward; returns True when this pass completed the recording."""
        if not self._recording or not self.events:
            return False
        self.complete = True
        self._recording = False
        self.following = False
        self._uses = {}
        self._prefix = [0]
        for pos, ev in enumerate(self.events):
            for b in ev.buckets:
                self._uses.setdefault(b, []).append(pos)
            self._prefix.append(self._prefix[-1] + sum(bucket_numel[b] for b in ev.buckets))
        return True

    # -- queries for prefetch and reuse -------------------------------------------------------------
    def upcoming(self) -> list[TraceEvent]:
        return self.events[self.cursor:] if self.following else []

    def reuse_distance(self, bucket: int) -> int | None:
        """Elements gathered by the events before ``bucket``'s next use in this pass (None: not used again)."""
        if not self.following:
            return None
        uses = self._uses.get(bucket, [])
        i = bisect.bisect_left(uses, self.cursor)
        if i == len(uses):
            return None
        return self._prefix[uses[i]] - self._prefix[self.cursor]

    def digest(self) -> list[tuple[str, str]]:
        return [(ev.phase, ev.module) for ev in self.events]


def plan_prefetch(upcoming: Iterable[TraceEvent], buckets: Sequence[Any], prefetch_numel: int, live_numel: int,
                  max_live_numel: int, allow_backward: bool) -> list[Any]:
    """Released buckets to gather ahead, in trace order, within the prefetch and live budgets."""
    chosen: list[Any] = []
    ahead = 0
    if prefetch_numel <= 0:
        return chosen
    for ev in upcoming:
        if ev.phase == "backward" and not allow_backward:
            break
        for index in ev.buckets:
            b = buckets[index]
            if b.state.value != "released" or b in chosen:
                continue
            if ahead + b.padded_numel > prefetch_numel or live_numel + ahead + b.padded_numel > max_live_numel:
                return chosen
            chosen.append(b)
            ahead += b.padded_numel
    return chosen
