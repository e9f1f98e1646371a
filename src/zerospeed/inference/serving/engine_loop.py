"""The thread that owns the inference engine: the only caller of ``add_request``/``step``/``abort``.

HTTP handlers run on uvicorn's event loop and must never block it on a forward pass, and the engine
is not thread-safe; so one thread owns the engine and everything else talks to it through a
thread-safe command queue (:meth:`EngineLoop.submit`, :meth:`EngineLoop.abort`). Results go back
through a per-request *sink*, a callable the engine thread calls with each item; the server's sink
hands the item to the request's ``asyncio.Queue`` with ``loop.call_soon_threadsafe``.

Items a sink receives, in order: :data:`ACCEPTED` once the engine took the request (or a
:class:`RequestError` if it refused it), then :class:`RequestOutput` objects until one is
``finished``, or an :class:`EngineFailure` if a step raised.

Decisions:

* The engine thread drains all pending commands before each step, so an abort frees its KV blocks
  before the next forward, and new requests join the next ragged batch.
* Admission is bounded: :meth:`submit` counts requests accepted beyond the engine's running slots
  (``max_num_seqs``, or the running count when more run) and raises :class:`QueueFull` past
  ``max_waiting``; the server answers 429. So ``max_num_seqs + max_waiting`` requests are taken at
  once even when they all arrive before the engine stepped (counting against the last step's
  running count alone admitted only ``max_waiting`` of a burst). A request the engine keeps
  waiting for another reason (KV blocks, the decode K/V budget) still holds a slot here.
* A ``step()`` that raises fails the requests that were in the engine (each gets an
  :class:`EngineFailure` and is aborted) and the loop goes on: one bad request or a transient
  fault never takes the server down.
* Weight updates (issue #32, :mod:`zerospeed.inference.serving.weight_sync`): :meth:`request_update` queues a
  callable that swaps the weights. From then on new requests are held (not refused), the running ones finish,
  the callable runs on this thread with no request in the engine, ``weights_version`` becomes what it returns,
  and the held requests are admitted. So every request runs on one version, which each output carries
  (``RequestOutput.weights_version``).
* ``stop()`` aborts what is left; the server calls it after uvicorn has finished or cancelled every
  in-flight HTTP request, so a graceful shutdown lets running requests complete first.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zerospeed.inference.api import EngineStats, RequestError, RequestOutput, SamplingParams
from zerospeed.inference.serving.metrics import ServingMetrics

log = logging.getLogger("zerospeed.serve")

ACCEPTED = "accepted"

Sink = Callable[[Any], None]


class QueueFull(Exception):
    """More requests are waiting than ``max_waiting`` allows."""


class ServerClosing(Exception):
    """The server is shutting down and takes no new requests."""


@dataclass
class EngineFailure:
    """The engine raised while running this request; ``message`` is safe to show to the client."""

    message: str


@dataclass
class _Tracked:
    sink: Sink
    arrival: float
    last_token: float | None = None


class EngineLoop:
    """Runs ``engine.step()`` in a dedicated thread and routes its outputs to per-request sinks."""

    def __init__(self, engine: Any, max_waiting: int, idle_poll_s: float = 1.0) -> None:
        if max_waiting < 1:  # a new request waits for one step at least
            raise ValueError(f"max_waiting: must be at least 1, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self._idle_poll_s = idle_poll_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_in_flight = 0  # submitted and not yet finished (guarded by _lock)
        self._closing = False
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._stats: EngineStats = engine.stats()
        self._num_running = 0
        scheduler = getattr(engine, "scheduler", None)
        self._num_slots = int(getattr(scheduler, "max_num_seqs", 0) or getattr(engine, "max_num_seqs", 0) or 0)
        self.metrics = ServingMetrics(self.snapshot)
        self._thread = threading.Thread(target=self._run, name="zerospeed-engine", daemon=True)
        self._failure: BaseException | None = None
        self.weights_version = 0
        self._update: Callable[[], int] | None = None  # engine thread only (see request_update)
        self._held: list[tuple] = []  # "group" commands held while an update waits for the engine to drain

    # -- any thread ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def snapshot(self) -> tuple[EngineStats, int, int]:
        """(last engine stats, running requests, waiting requests) for /metrics and tests."""
        with self._lock:
            stats, running, in_flight = self._stats, self._num_running, self._num_in_flight
        return stats, running, max(0, in_flight - running)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               sink: Sink) -> None:
        """Queue a request; raises :class:`QueueFull` or :class:`ServerClosing` instead."""
        self.submit_group([(request_id, prompt_token_ids, params, sink, None)])

    def submit_group(self, entries: list[tuple[str, list[int], SamplingParams, Sink, str | None]]) -> None:
        """Queue the engine requests of one HTTP request together (``(id, prompt, params, sink,
        fork_of)``; a fork names an earlier entry): the engine thread adds them in one drain, so a
        fork always finds its parent still in its prompt. Admission counts the group as one
        waiting request (``n`` choices of one prompt are one request to the client)."""
        with self._lock:
            if self._closing:
                raise ServerClosing()
            if self._num_in_flight - max(self._num_running, self._num_slots) >= self.max_waiting:
                raise QueueFull()
            self._num_in_flight += len(entries)
        now = time.perf_counter()
        self._inbox.put(("group", [(rid, ids, params, sink, fork_of, now)
                                   for rid, ids, params, sink, fork_of in entries]))

    def request_update(self, apply: Callable[[], int]) -> None:
        """Run ``apply`` on the engine thread once no request is in the engine (new ones wait); its return value
        is the new ``weights_version``. An exception it raises leaves the version as it was."""
        self._inbox.put(("update", apply))

    def abort(self, request_id: str) -> None:
        """Cancel a request (no-op when it already finished); its blocks are freed before the next
        step."""
        self._inbox.put(("abort", request_id))

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is left and join the engine thread."""
        with self._lock:
            self._closing = True
        if self._thread.is_alive():
            self._inbox.put(("stop",))
            self._thread.join(timeout)

    # -- engine thread ---------------------------------------------------------------------------
    def _deliver(self, sink: Sink, item: Any) -> None:
        try:
            sink(item)
        except Exception:  # noqa: BLE001 - a closed event loop must not kill the engine thread
            log.debug("dropping an item for a closed request", exc_info=True)

    def _finish(self, request_id: str) -> _Tracked | None:
        rec = self._tracked.pop(request_id, None)
        if rec is not None:
            with self._lock:
                self._num_in_flight -= 1
        return rec

    def _refuse(self, sink: Sink, error: BaseException) -> None:
        with self._lock:
            self._num_in_flight -= 1
        self._deliver(sink, error)

    def _handle(self, cmd: tuple) -> bool:
        """Apply one command; False for ``stop``."""
        kind = cmd[0]
        if kind == "group" and self._update is not None:
            self._held.append(cmd)
        elif kind == "update":
            self._update = cmd[1]
        elif kind == "group":
            for entry in cmd[1]:
                self._handle(("add", *entry))
        elif kind == "add":
            _, rid, ids, params, sink, fork_of, arrival = cmd
            try:
                if fork_of is None:
                    self.engine.add_request(rid, ids, params)
                else:
                    self.engine.add_request(rid, ids, params, fork_of=fork_of)
            except RequestError as e:
                self._refuse(sink, e)
                return True
            except Exception as e:  # noqa: BLE001 - the engine must keep serving the others
                log.error("add_request(%s) raised:\n%s", rid, traceback.format_exc())
                self._refuse(sink, EngineFailure(f"the engine could not take the request: {e}"))
                return True
            self._tracked[rid] = _Tracked(sink, arrival)
            self._deliver(sink, ACCEPTED)
        elif kind == "abort":
            rid = cmd[1]
            rec = self._finish(rid)
            if rec is not None:
                self._abort_in_engine(rid)
                self.metrics.finished.labels("abort").inc()
                self._deliver(rec.sink, RequestOutput(rid, [], finished=True, finish_reason="abort"))
        elif kind == "stop":
            return False
        return True

    def _abort_in_engine(self, rid: str) -> None:
        try:
            self.engine.abort(rid)
        except Exception:  # noqa: BLE001
            log.error("abort(%s) raised:\n%s", rid, traceback.format_exc())

    def _route(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            rec = self._tracked.get(out.request_id)
            if rec is None:  # aborted by its client in the meantime
                continue
            n = len(out.new_token_ids)
            if n:
                if rec.last_token is None:
                    self.metrics.ttft.observe(now - rec.arrival)
                    n_gaps = n - 1
                    gap = 0.0
                else:
                    n_gaps = n
                    gap = (now - rec.last_token) / n
                for _ in range(n_gaps):
                    self.metrics.itl.observe(gap)
                rec.last_token = now
            out.weights_version = self.weights_version
            if out.finished:
                self._finish(out.request_id)
                self.metrics.e2e.observe(now - rec.arrival)
                self.metrics.finished.labels(
                    "error" if out.error else (out.finish_reason or "stop")).inc()
            self._deliver(rec.sink, out)

    def _fail_all(self, message: str) -> None:
        for rid in list(self._tracked):
            rec = self._finish(rid)
            self._abort_in_engine(rid)
            self.metrics.finished.labels("error").inc()
            self._deliver(rec.sink, EngineFailure(message))

    def _refresh_stats(self) -> None:
        try:
            stats = self.engine.stats()
        except Exception:  # noqa: BLE001
            log.error("stats() raised:\n%s", traceback.format_exc())
            return
        with self._lock:
            self._stats = stats
            self._num_running = stats.num_running

    def _apply_update(self) -> None:
        apply, self._update = self._update, None
        try:
            self.weights_version = int(apply())
        except Exception:  # noqa: BLE001 - the old weights stay; the caller of request_update got the error
            log.error("weight update failed, serving the old weights (version %d):\n%s", self.weights_version,
                      traceback.format_exc())
        held, self._held = self._held, []
        for cmd in held:
            self._handle(cmd)

    def _run(self) -> None:
        running = True
        try:
            while running:
                if self._update is not None and not self.engine.has_unfinished():
                    self._apply_update()
                    continue
                if not self.engine.has_unfinished():
                    if self._tracked:  # the engine forgot them: fail them rather than hang them
                        self._fail_all("the engine dropped the request")
                        self._refresh_stats()
                    try:
                        running = self._handle(self._inbox.get(timeout=self._idle_poll_s))
                    except queue.Empty:
                        continue
                while running:
                    try:
                        running = self._handle(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                if running and self.engine.has_unfinished():
                    try:
                        outputs = self.engine.step()
                    except Exception as e:  # noqa: BLE001
                        log.error("engine step raised:\n%s", traceback.format_exc())
                        self._fail_all(f"the engine failed while generating: {type(e).__name__}: {e}")
                    else:
                        self._route(outputs)
                self._refresh_stats()
        except BaseException as e:  # a bug here would otherwise hang every client
            self._failure = e
            log.critical("engine thread died:\n%s", traceback.format_exc())
        finally:
            with self._lock:
                self._closing = True
            for rid in list(self._tracked):
                rec = self._finish(rid)
                self._abort_in_engine(rid)
                self._deliver(rec.sink, RequestOutput(rid, [], finished=True, finish_reason="abort"))
            while True:  # requests submitted after the last drain
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if cmd[0] == "group":
                    for entry in cmd[1]:
                        self._refuse(entry[3], ServerClosing())
            self._refresh_stats()
