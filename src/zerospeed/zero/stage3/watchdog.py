"""Turn a ZeRO-3 hang (ranks taking different paths through the model, a dead peer) into an error.

Every rank runs the same sequence of module calls, so every rank issues the same sequence of
gathers and reduce-scatters. When they do not (data-dependent control flow, a rank that skipped a
module, a crashed peer) a collective waits forever, or gloo aborts on mismatched sizes. The
watchdog makes this an error that names the module and the ranks:

* Positions are published. Each *pass* (one forward, and its backward) is numbered the same on
  every rank. Before each collective a rank writes ``pass|#k|op|what`` under its own key in the
  process group's store, and at each module event (a module about to be gathered for forward or
  backward) ``pass|#e|phase|module``. Both are also kept in a short in-memory history.
* Every wait has a limit (``zero_optimization.stage3_collective_timeout_s``, 0 = no limit). On
  time-out (or a communication error) the rank writes its history to the store, waits up to the
  same limit for its peers' histories, and raises :class:`ZeroCollectiveDivergence` naming the
  first module event or collective where ranks differ, or the ranks that never answered with
  their last published position.
* While the trace is being recorded (the first step, or the step after the model's control flow
  changed) nothing is known about the order, so each collective is first *verified*: every rank
  publishes it under ``(pass, #k)`` and waits until all peers published theirs; a difference raises
  at once, before a mismatched collective is issued. This costs a store round trip per collective
  on that step only. At the end of the recorded step the ranks also compare their module orders.
* Deviation from the recorded trace is confirmed before any collective is issued: a rank whose
  module order departs from the order recorded on the first step (see
  :mod:`zerospeed.zero.stage3.prefetch`) publishes the deviation and waits until every peer has
  reached the same event. If all deviated the same way the model's control flow changed on every
  rank (legal: the trace is re-recorded); otherwise it raises at once, before issuing a mismatched
  collective (gloo aborts the process on a size mismatch, which no timeout can report).

The store is the default process group's (one small ``set`` per event and collective, about
10 us over loopback TCP). ``torch.distributed`` does not expose it publicly, so it is looked up
with a guarded call; without it the watchdog still times out, reporting only this rank's view.
"""

from __future__ import annotations

import collections
import datetime
import json
import time
from typing import Any

import torch.distributed as dist

from zerospeed import comm

HISTORY_LEN = 512


class ZeroCollectiveDivergence(RuntimeError):
    """Ranks stopped issuing the same ZeRO-3 collectives (divergent control flow or a dead peer)."""


def _default_store(group: dist.ProcessGroup | None) -> Any:
    if not comm.is_initialized() or comm.get_world_size(group) == 1:
        return None
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:
        return None
    try:
        base = get()
    except Exception:
        return None
    tag = "world" if group is None else "-".join(map(str, dist.get_process_group_ranks(group)))
    return dist.PrefixStore(f"zerospeed/zero3/{tag}/", base)


class Watchdog:
    """One per data-parallel group; shared by the runtime, the gradient reducer and GatheredParameters."""

    _instances: dict[int, "Watchdog"] = {}

    def __init__(self, group: dist.ProcessGroup | None, timeout_s: float) -> None:
        self.group = group
        self.timeout_s = float(timeout_s)
        self.rank = comm.get_rank(group)
        self.world_size = comm.get_world_size(group)
        self.store = _default_store(group)
        self.pass_id = 0
        self.num_collectives = 0  # in this pass
        self.num_events = 0  # in this pass
        self.history: collections.deque[str] = collections.deque(maxlen=HISTORY_LEN)
        self.verify = False  # check each collective with the peers before issuing it (first step)

    @classmethod
    def for_group(cls, group: dist.ProcessGroup | None, timeout_s: float | None = None) -> "Watchdog":
        # keyed by the group object (the default group's, for None): a re-initialised world gets a new one
        key = id(group if group is not None else (dist.group.WORLD if comm.is_initialized() else None))
        dog = cls._instances.get(key)
        if dog is None or (comm.is_initialized() and dog.store is None and comm.get_world_size(group) > 1):
            dog = cls._instances[key] = cls(group, 600.0 if timeout_s is None else timeout_s)
        elif timeout_s is not None:
            dog.timeout_s = float(timeout_s)
        return dog

    # -- publishing -------------------------------------------------------------------------------
    def _set(self, key: str, value: str) -> None:
        if self.store is not None:
            try:
                self.store.set(key, value)
            except Exception:
                self.store = None  # the store's host died; keep training until a wait says more

    def begin_pass(self) -> None:
        self.pass_id += 1
        self.num_collectives = 0
        self.num_events = 0

    def note_event(self, phase: str, module: str) -> int:
        """Publish that this rank is about to gather for ``module`` (``phase``: forward/backward)."""
        self.num_events += 1
        entry = f"{self.pass_id}|{self.num_events}|{phase}|{module}"
        self.history.append("E" + entry)
        self._set(f"ev/{self.rank}", entry)
        return self.num_events

    def note_collective(self, op: str, what: str) -> None:
        """Publish the next collective; while ``verify`` is on, first check every rank issues the same."""
        self.num_collectives += 1
        entry = f"{self.pass_id}|{self.num_collectives}|{op}|{what}"
        self.history.append("C" + entry)
        self._set(f"pos/{self.rank}", entry)
        if self.verify:
            peers = self.agree(f"c/{self.pass_id}/{self.num_collectives}", entry, f"{op} for {what}")
            for q, theirs in peers.items():
                if theirs != entry:
                    self._fail(f"ZeRO-3 ranks diverged at pass {self.pass_id}, collective #{self.num_collectives}: "
                               f"rank {self.rank} issues {_fmt_coll(entry)}; rank {q} issues {_fmt_coll(theirs)}. "
                               "Every rank must call the same modules in the same order (a rank skipped or added "
                               "a module: data-dependent control flow?)" + _LEAF_HINT)

    def agree(self, key: str, value: str, what: str) -> dict[int, str]:
        """Publish ``value`` under ``key`` and return every peer's (waiting at most the time limit)."""
        if self.store is None or self.world_size == 1:
            return {}
        self._set(f"a/{key}/{self.rank}", value)
        keys = {q: f"a/{key}/{q}" for q in range(self.world_size) if q != self.rank}
        limit = self.timeout_s if self.timeout_s > 0 else 365 * 24 * 3600.0
        try:
            self.store.wait(list(keys.values()), datetime.timedelta(seconds=limit))
            return {q: self.store.get(k).decode() for q, k in keys.items()}
        except ZeroCollectiveDivergence:
            raise
        except Exception as exc:
            raise self.diagnose(f"{what} (waiting for every rank to reach it)", exc) from None

    # -- waiting ----------------------------------------------------------------------------------
    def wait(self, work: Any, op: str, what: str) -> None:
        """Wait for ``work`` at most ``timeout_s``; on failure raise a report of where every rank is."""
        if self.timeout_s <= 0 or self.world_size == 1:
            work.wait()
            return
        try:
            if comm.is_initialized() and dist.get_backend(self.group) == "gloo":
                work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
            else:  # NCCL's wait() only orders streams; poll completion against the deadline
                deadline = time.monotonic() + self.timeout_s
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise TimeoutError("Operation timed out!")
                    time.sleep(0.0005)
                work.wait()
        except Exception as exc:  # time-out, or the peer's connection broke
            raise self.diagnose(f"{op} for {what}", exc) from None

    # -- deviation from the recorded trace ---------------------------------------------------------
    def confirm_deviation(self, event: int, phase: str, expected: str, got: str) -> None:
        """This rank's event ``event`` is ``got`` where the recorded trace says ``expected``.

        Returns when every peer deviated identically (the trace is then re-recorded); raises
        :class:`ZeroCollectiveDivergence` when a peer followed the trace or did something else.
        """
        mine = f"{self.pass_id}|{event}|{phase}|{got}"
        self.history.append("D" + mine + f"|expected {expected}")
        if self.store is None or self.world_size == 1:
            return
        self._set(f"dev/{self.rank}", mine)
        deadline = time.monotonic() + (self.timeout_s if self.timeout_s > 0 else float("inf"))
        pending = set(range(self.world_size)) - {self.rank}
        while pending:
            for q in sorted(pending):
                # read the peer's event before its deviation: a rank publishes a deviation before any
                # later event, so an event at or past ours with no deviation means it followed the trace
                ev = self._get(f"ev/{q}")
                dev = self._get(f"dev/{q}")
                if dev is not None and dev.split("|")[:2] == mine.split("|")[:2]:
                    if dev != mine:
                        self._fail(self._deviation_message(event, phase, expected, got, q,
                                                           f"ran {dev.split('|', 3)[3]!r}"))
                    pending.discard(q)
                    continue
                if ev is not None:
                    p_q, e_q, ph_q, m_q = ev.split("|", 3)
                    if (int(p_q), int(e_q)) >= (self.pass_id, event):
                        seen = f"ran {m_q!r} ({ph_q})" if (int(p_q), int(e_q)) == (self.pass_id, event) else \
                            f"followed the recorded order (it is at pass {p_q}, module event #{e_q}: {m_q!r})"
                        self._fail(self._deviation_message(event, phase, expected, got, q, seen))
            if time.monotonic() > deadline:
                raise self.diagnose(f"confirming that every rank skips {expected!r}",
                                    TimeoutError("peers did not reach the same module event"))
            time.sleep(0.005)

    def _fail(self, message: str) -> None:
        self._set(f"hist/{self.rank}", json.dumps(list(self.history)))  # for the peers' diagnosis
        raise ZeroCollectiveDivergence(message)

    def _deviation_message(self, event: int, phase: str, expected: str, got: str, peer: int, seen: str) -> str:
        return (f"ZeRO-3 ranks diverged at pass {self.pass_id}, {phase} module event #{event}: rank {self.rank} ran "
                f"module {got!r} where the order recorded on the first step expects {expected}, and rank {peer} "
                f"{seen}. Every rank must call the same modules in the same order (a rank skipped or added a "
                "module: data-dependent control flow?)" + _LEAF_HINT)

    def _get(self, key: str) -> str | None:
        if self.store is None:
            return None
        try:
            if not self.store.check([key]):
                return None
            return self.store.get(key).decode()
        except Exception:
            return None

    # -- diagnosis --------------------------------------------------------------------------------
    def diagnose(self, waiting_for: str, cause: BaseException) -> ZeroCollectiveDivergence:
        """Exchange histories through the store and describe where the ranks part ways."""
        mine = list(self.history)
        self._set(f"hist/{self.rank}", json.dumps(mine))
        histories: dict[int, list[str]] = {self.rank: mine}
        limit = min(self.timeout_s, 60.0) if self.timeout_s > 0 else 10.0
        deadline = time.monotonic() + limit
        while self.store is not None and len(histories) < self.world_size and time.monotonic() < deadline:
            for q in range(self.world_size):
                if q not in histories and (h := self._get(f"hist/{q}")) is not None:
                    histories[q] = json.loads(h)
            time.sleep(0.02)
        reason = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        lines = [f"ZeRO-3 collective did not complete: rank {self.rank}'s {waiting_for} at pass {self.pass_id} "
                 f"failed within the {self.timeout_s:g}s limit (zero_optimization.stage3_collective_timeout_s): "
                 f"{reason}"]
        lines += self._first_difference(histories)
        for q in range(self.world_size):
            if q in histories:
                continue
            ev, pos = self._get(f"ev/{q}"), self._get(f"pos/{q}")
            lines.append(f"rank {q} did not answer within {limit:g}s (dead, or stuck outside ZeRO-3); its last "
                         f"module event: {_fmt_event(ev)}; its last collective: {_fmt_coll(pos)}")
        lines.append("Every rank must call the same modules in the same order; a rank that skips a module, "
                     "or a peer that died, stops the others at the next gather.")
        return ZeroCollectiveDivergence("\n".join(lines))

    @staticmethod
    def _first_difference(histories: dict[int, list[str]]) -> list[str]:
        if len(histories) < 2:
            return []
        out = []
        for kind, label, fmt in (("D", "trace deviation", _fmt_event), ("E", "module event", _fmt_event),
                                 ("C", "collective", _fmt_coll)):
            seqs = {r: [e[1:] for e in h if e[0] == kind] for r, h in histories.items()}
            if kind == "D":
                for r, s in sorted(seqs.items()):
                    for entry in s:
                        out.append(f"rank {r} departed from the recorded module order: {_fmt_event(entry)}")
                continue
            # align on the common tail: histories are bounded, so compare by (pass, index) keys
            keyed = {r: {tuple(e.split("|", 2)[:2]): e for e in s} for r, s in seqs.items()}
            keys = sorted(set().union(*[set(k) for k in keyed.values()]), key=lambda k: (int(k[0]), int(k[1])))
            lo = max(min((int(k[0]), int(k[1])) for k in kv) for kv in keyed.values() if kv) if all(keyed.values()) \
                else (0, 0)
            for k in keys:
                if (int(k[0]), int(k[1])) < lo:
                    continue
                entries = {r: keyed[r].get(k) for r in sorted(keyed)}
                if len(set(entries.values())) > 1:
                    parts = "; ".join(f"rank {r}: {fmt(e) if e else 'nothing (it never got there)'}"
                                      for r, e in entries.items())
                    out.append(f"first {label} that differs between ranks: {parts}")
                    break
        return out


def _fmt_event(entry: str | None) -> str:
    if not entry:
        return "none published"
    parts = entry.split("|", 4)
    text = f"pass {parts[0]}, event #{parts[1]}, {parts[2]} of module {parts[3]!r}"
    return text + (f" ({parts[4]})" if len(parts) > 4 else "")


#: the fix for a block whose submodules run in a data-dependent order (mixture-of-experts experts)
_LEAF_HINT = ("; a block whose submodules run in a data-dependent order (a mixture-of-experts layer) must be gathered "
              "whole: flag it before the engine is built with deepspeed.utils.set_z3_leaf_modules(model, [BlockClass])")


def _fmt_coll(entry: str | None) -> str:
    if not entry:
        return "none published"
    p, k, op, what = entry.split("|", 3)
    return f"pass {p}, collective #{k}: {op} for {what}"
