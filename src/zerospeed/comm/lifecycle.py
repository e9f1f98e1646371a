"""Orderly end of the process group zerospeed created: ``zerospeed.shutdown()`` and its ``atexit`` twin.

A DeepSpeed-style script trains, saves, and falls off the end with no barrier and no
``destroy_process_group``. Left to interpreter finalization, each rank tears down its gloo/NCCL
connections whenever it happens to exit: a rank that leaves first closes sockets a slower peer is
still using (a checkpoint's last agreement, an asynchronous save's publication), and the C++
destructors then run after Python's own state is gone, an occasional ``SIGABRT`` that makes a job
whose work was done report failure. So when :func:`zerospeed.comm.init_distributed` creates the
default group it registers :func:`shutdown` with :mod:`atexit`, and scripts may call it explicitly.

Order of :func:`shutdown` (each step bounded; it never raises, since it runs at exit):

1. the *before-teardown* callbacks registered by upper layers (the checkpoint saver registers one
   that waits for in-flight asynchronous saves), so no background thread still uses the group;
2. a barrier through the default group's key-value store, limited to ``timeout_s`` (default: the
   smaller of 60 s and the group's own timeout; ``ZEROSPEED_SHUTDOWN_TIMEOUT_S`` overrides). A
   store barrier rather than a collective: it works on every backend, it has a real time limit, and
   a rank that never arrives is *named* in the warning instead of hanging the others. A rank that is
   exiting because of an uncaught exception skips the barrier (its peers would wait for nothing;
   torchrun stops them anyway), and so does a group whose store is unreachable;
3. ``destroy_process_group()``, which unregisters every subgroup and then the default group. The
   C++ group objects (and the joins of their threads) go only with the last Python reference to
   them; an engine or a watchdog still holding a group keeps it until interpreter finalization.

Decisions: only a group zerospeed created is torn down at exit (a group the user created is the
user's to destroy, though an explicit ``shutdown()`` call tears down whatever default group
exists); a second call is a no-op; the barrier's keys carry torchrun's restart count and a per-
process generation, so an elastic restart or a re-initialised group never sees stale arrivals.

Apart from that teardown, every process that imports this module (every zerospeed engine and collective
does) gets a second, earlier-registered and so later-run ``atexit`` handler, :func:`settle_gloo_workers`,
whoever created the group. Under torch 2.13 a gloo worker thread (``pt_gloo_runloop``) that drops a finished
collective's last reference to a Python-created tensor must take the GIL to release that tensor's Python
object. A rank that leaves right after a collective can reach interpreter finalization first; the worker then
finds the interpreter finalizing, ``pthread_exit`` unwinds through a ``noexcept`` frame and the process dies with
"terminate called without an active exception" (SIGABRT) after its work was done. This hit
``accelerate``'s own process group (``--use_cpu``, which zerospeed did not create and does not tear down) in CI;
a plain two-rank gloo script that exits right after a collective aborts in about a third of its runs here.
The handler releases the GIL for :data:`SETTLE_S` seconds while gloo workers exist, so a worker waiting for the
GIL takes it and finishes while the interpreter is still whole.

The default group's facts that :mod:`zerospeed.comm.health` reads (its timeout, whether it is gloo, the
generation) live here: lifecycle is the lower of the two files, health imports it and not the reverse.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

logger = logging.getLogger("zerospeed")

DEFAULT_SHUTDOWN_TIMEOUT_S = 60.0

_before_teardown: list[Callable[[], None]] = []
_lock = threading.Lock()
_state: dict[str, Any] = {"owned": False, "registered": False, "generation": 0, "failed": False,
                          "hook_installed": False}


#: how long the exit handler releases the GIL for gloo's worker threads to finish (seconds; in 10 slices)
SETTLE_S = 0.05
_GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads


def _gloo_workers_exist() -> bool:
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # not Linux: any initialised group may have gloo workers
        return dist.is_available() and dist.is_initialized()
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().strip() == _GLOO_WORKER:
                    return True
        except OSError:  # the thread ended meanwhile
            continue
    return False


def settle_gloo_workers() -> None:
    """Let gloo's worker threads finish releasing their last collective's tensors before finalization (see
    the module docstring); a no-op in a process without gloo workers. Registered with :mod:`atexit` at import."""
    if _gloo_workers_exist():
        for _ in range(10):
            time.sleep(SETTLE_S / 10)  # each sleep releases the GIL: a worker waiting for it takes it


atexit.register(settle_gloo_workers)


def add_before_teardown(callback: Callable[[], None]) -> None:
    """Run ``callback`` (no arguments, must not raise) at the start of every :func:`shutdown`."""
    if callback not in _before_teardown:
        _before_teardown.append(callback)


def _install_excepthook() -> None:
    # chain the current hook: an uncaught exception marks this rank as failing, so its exit does not
    # wait at the barrier for peers that are still training (they are stopped by the launcher)
    if _state["hook_installed"]:
        return
    previous = sys.excepthook

    def hook(exc_type: Any, exc: Any, tb: Any) -> None:
        _state["failed"] = True
        previous(exc_type, exc, tb)

    sys.excepthook = hook
    _state["hook_installed"] = True


def register_created_group() -> None:
    """Called right after zerospeed created the default process group: tear it down at exit."""
    with _lock:
        _state["owned"] = True
        _state["generation"] += 1
        if not _state["registered"]:
            atexit.register(_at_exit)
            _state["registered"] = True
    _install_excepthook()


def generation() -> int:
    """How many process groups zerospeed created in this process (store keys of a group carry it)."""
    return int(_state["generation"])


#: the default group's timeout and backend, cached per group object (group_timeout_s)
_group: dict[str, Any] = {}


def group_timeout_s() -> float:
    """The default process group's timeout in seconds (cached per group object)."""
    import torch

    try:
        group = dist.distributed_c10d._get_default_group()
    except Exception:  # noqa: BLE001 - no group
        return 1800.0
    if _group.get("timeout_of") != id(group):
        try:
            seconds = float(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
        except Exception:  # noqa: BLE001 - private API moved: assume torch's default
            seconds = 1800.0
        _group["timeout_of"], _group["timeout_s"] = id(group), seconds
        _group["gloo"] = dist.get_backend(group) == "gloo"
    return float(_group["timeout_s"])


def bounded_waits() -> bool:
    """True where a wait with a time limit costs nothing extra (gloo: waits block the CPU anyway).

    Under NCCL ``wait()`` only orders streams; a limit would make it block the CPU, so NCCL keeps its
    own watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, set by torchrun) and its plain waits.
    """
    group_timeout_s()
    return bool(_group.get("gloo", False))


def _at_exit() -> None:
    if _state["owned"]:
        shutdown()


def _timeout_s(explicit: float | None) -> float:
    if explicit is not None:
        return float(explicit)
    env = os.environ.get("ZEROSPEED_SHUTDOWN_TIMEOUT_S")
    if env:
        try:
            return float(env)
        except ValueError:
            logger.warning("zerospeed: ZEROSPEED_SHUTDOWN_TIMEOUT_S=%r is not a number; using %gs", env,
                           DEFAULT_SHUTDOWN_TIMEOUT_S)
    return min(DEFAULT_SHUTDOWN_TIMEOUT_S, group_timeout_s())


def _default_store() -> Any:
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:
        return None
    try:
        return get()
    except Exception:  # noqa: BLE001
        return None


def store_barrier(store: Any, rank: int, world_size: int, key: str, timeout_s: float) -> list[int]:
    """Arrive at ``key`` and wait up to ``timeout_s`` for every rank; return the ranks that did not arrive."""
    store.set(f"{key}/{rank}", "1")
    deadline = time.monotonic() + timeout_s
    missing = [r for r in range(world_size) if r != rank]
    while missing:
        missing = [r for r in missing if not store.check([f"{key}/{r}"])]
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.005)
    return missing


def shutdown(timeout_s: float | None = None) -> None:
    """Finish in-flight work, meet every rank at a bounded barrier, then destroy the process groups.

    Safe to call more than once, with no group, or from an ``atexit`` handler; never raises.
    """
    for callback in list(_before_teardown):
        try:
            callback()
        except Exception as e:  # noqa: BLE001 - teardown must go on
            logger.warning("zerospeed: shutdown: %s", e)
    with _lock:
        if not (dist.is_available() and dist.is_initialized()):
            _state["owned"] = False
            return
        rank, world_size = dist.get_rank(), dist.get_world_size()
        limit = _timeout_s(timeout_s)
        store = _default_store() if world_size > 1 and not _state["failed"] else None
        if store is not None:
            key = (f"zerospeed/shutdown/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
                   f"{_state['generation']}")
            try:
                store.set_timeout(datetime.timedelta(seconds=max(limit, 1.0)))
                missing = store_barrier(store, rank, world_size, key, limit)
                if not missing:
                    # the store may live in rank 0's process: rank 0 leaves only after every rank saw the
                    # barrier complete, so no peer finds the store gone while it is still polling
                    store.set(f"{key}/passed/{rank}", "1")
                    if rank == 0:
                        store_barrier(store, rank, world_size, f"{key}/passed", min(limit, 5.0))
                if missing:
                    print(f"zerospeed: shutdown: rank {rank}: rank(s) {', '.join(map(str, missing))} did not reach "
                          f"the end of the job within {limit:g}s (ZEROSPEED_SHUTDOWN_TIMEOUT_S); "
                          "destroying the process group anyway", file=sys.stderr, flush=True)
            except Exception as e:  # noqa: BLE001 - the store's host left already: nothing to wait for
                logger.debug("zerospeed: shutdown barrier skipped: %s", e)
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001
            logger.warning("zerospeed: shutdown: destroy_process_group failed: %s", e)
        _state["owned"] = False
