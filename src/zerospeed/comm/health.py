"""Turn a collective that cannot complete into an error naming the rank that stopped participating.

A rank that is stopped (SIGSTOP, a debugger), stuck in a loop before a collective, or dead leaves
its peers blocked in their next collective. Every collective in zerospeed goes through
:mod:`zerospeed.comm.collectives`, so each one is *checked*: a synchronous call, or the ``wait()`` of
an asynchronous one, that fails (the process group's timeout expired, or a peer's connection broke)
raises :class:`CollectiveError` whose message says which ranks did not report.

How the missing ranks are found, with no cost while training: a rank whose collective failed
writes ``failed at <op> #<n>`` under its own key in the default group's store, then waits a short
window (half the group's timeout, between 1 and 30 s) for the other ranks' keys. Ranks blocked in
the same (or any) collective time out too and report; a stopped, looping or dead rank cannot, so
the ranks with no report are the ones named. Keys carry torchrun's restart count and the process
group's generation, so a restarted job never reads the previous attempt's reports.

The timeout is the default process group's: ``zerospeed.init_distributed(timeout=timedelta(...))``
(as in DeepSpeed) or ``ZEROSPEED_DIST_TIMEOUT_S`` in the environment (default 30 minutes, DeepSpeed's
and torch's). Every wait is held to it, on subgroups too (``new_group`` would otherwise give them
torch's 30-minute default whatever the world's timeout is): collectives are started asynchronously
and waited on with that limit (on gloo, where a wait blocks the CPU anyway). Gloo enforces it; under NCCL, torchrun's
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` makes the watchdog fail the operation. Errors that are not
communication failures (a wrong shape, say) are raised unchanged and at once.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from zerospeed.comm.lifecycle import bounded_waits, generation, group_timeout_s

T = TypeVar("T")

_COMM_FAILURE_WORDS = ("timed out", "timeout", "connection", "broken pipe", "peer", "closed", "reset by",
                       "socket", "aborted")
_state: dict[str, Any] = {"seq": 0, "reported": ""}


class CollectiveError(RuntimeError):
    """A collective did not complete; the message names the ranks that did not report."""


def _is_comm_failure(exc: BaseException) -> bool:
    if isinstance(exc, CollectiveError):
        return False
    backend_error = getattr(dist, "DistBackendError", None)
    if backend_error is not None and isinstance(exc, backend_error):
        return True
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, TimeoutError, OSError)) and any(w in text for w in _COMM_FAILURE_WORDS)


def _store() -> Any:
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except Exception:  # noqa: BLE001
        return None


def describe(op: str, seq: int, exc: BaseException) -> CollectiveError:
    """Report this rank's failure through the store, collect the peers' reports, name the silent ranks."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    timeout_s = group_timeout_s()
    window = min(30.0, max(1.0, 0.5 * timeout_s))
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    key = f"zerospeed/health/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{generation()}"
    reports: dict[int, str] = {rank: f"{op} #{seq}"}
    store = _store()
    store_note = ""
    if store is not None and world > 1:
        try:
            if _state["reported"] != key:  # one report per rank and group: its first failure
                store.set(f"{key}/{rank}", f"{op} #{seq}")
                _state["reported"] = key
            deadline = time.monotonic() + window
            while len(reports) < world and time.monotonic() < deadline:
                for q in range(world):
                    if q not in reports and store.check([f"{key}/{q}"]):
                        reports[q] = store.get(f"{key}/{q}").decode()
                time.sleep(0.02)
        except Exception as e:  # noqa: BLE001 - the store's host is gone too
            store_note = f" (the store became unreachable while collecting reports: {str(e).splitlines()[0]})"
    missing = [q for q in range(world) if q not in reports]
    where = f"rank {rank}: {op} (collective #{seq} of this rank) did not complete within the process group's " \
            f"{timeout_s:g}s timeout or lost its peer"
    if missing:
        names = ", ".join(map(str, missing))
        head = (f"{where}: rank{'s' if len(missing) > 1 else ''} {names} stopped participating (no failure report "
                f"within {window:g}s: stopped, stuck before this collective, or dead)")
    else:
        head = f"{where}: every rank reported a failed collective"
    others = "; ".join(f"rank {q} failed at {r}" for q, r in sorted(reports.items()) if q != rank)
    tail = f". Peers' reports: {others}" if others else ""
    return CollectiveError(f"{head}{store_note}{tail}. Cause: {reason}")


def next_seq() -> int:
    _state["seq"] += 1
    return int(_state["seq"])


def checked(op: str, call: Callable[[], T]) -> T:
    """Run a synchronous collective; a communication failure becomes a :class:`CollectiveError`."""
    seq = next_seq()
    try:
        return call()
    except Exception as exc:
        if not _is_comm_failure(exc):
            raise
        raise describe(op, seq, exc) from exc


class CheckedWork:
    """A Work handle whose ``wait()`` turns a communication failure into a :class:`CollectiveError`."""

    def __init__(self, work: Any, op: str) -> None:
        self._work, self._op, self._seq = work, op, next_seq()

    def wait(self, timeout: Any = None) -> Any:
        if timeout is None and bounded_waits():  # subgroups get torch's 30-minute default: hold them
            timeout = datetime.timedelta(seconds=group_timeout_s())  # to the world's timeout
        try:
            return self._work.wait() if timeout is None else self._work.wait(timeout)
        except Exception as exc:
            if not _is_comm_failure(exc):
                raise
            raise describe(self._op, self._seq, exc) from exc

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
