"""Run a function on N local ranks over gloo, with a hard timeout and every rank's failure reported.

``run_distributed(fn, world_size, *args, timeout=...)`` starts ``world_size`` processes, each with
torch's default process group initialised (gloo on CPU, one torch thread per rank), calls
``fn(*args, **kwargs)`` in each, and returns the list of per-rank return values (rank order).

Reliability decisions:

* Processes come from a ``forkserver`` with torch (and torch._dynamo, which the first optimizer
  constructor imports) and zerospeed's engine preloaded: safe (no fork of a process whose OpenMP
  pool is running) and fast (imported once per test session, not once per rank).
* A rank that raises is reported with its traceback; once any rank has failed the others get a
  short grace period and are then killed, so a peer blocked in a collective never hangs the suite.
* A run that does not finish within ``timeout`` seconds is killed and reported with the ranks
  that did not finish. The process group's own timeout is set below that, so a collective that
  cannot complete raises inside the rank first, with its traceback.
* Results travel as ``torch.save`` bytes, so tensors come back without shared-memory handles.
* The rendezvous store is served by the calling process on a port the OS assigns as it binds, and the
  ranks join it as clients: no port is picked first and bound later, so two runs at once (two test
  sessions, a benchmark beside the suite) cannot take each other's port (EADDRINUSE).

``fn`` must be importable by name (a module-level function), as for any multiprocessing target.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback
from typing import Any, Callable

import torch

_CTX: Any = None
_FAIL_GRACE_S = 5.0


class DistributedTestError(RuntimeError):
    """One or more ranks failed or timed out; the message holds every rank's report."""


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # torch.optim.Optimizer's constructor imports torch._dynamo (~5 s): pay it once, here.
        # HF model classes are what most multi-process tests build: import them once here, not per
        # rank (the forkserver skips a preload module that is not installed)
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "zerospeed",
                                     "zerospeed.runtime.initialize", "transformers",
                                     "transformers.models.llama.modeling_llama",
                                     "transformers.models.gpt2.modeling_gpt2"])
    return _CTX


def _rendezvous_store(timeout_s: float) -> Any:
    """A TCPStore served here, bound to a port the OS picks at bind time (no pick-then-bind race)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, pg_timeout_s: float,
            results: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    status, payload = "ok", b""
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size=world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=pg_timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        # every rank's gloo mesh is complete before any rank runs fn: a rank whose init returned first and whose fn
        # ends at once (an expected error) would otherwise exit and close its sockets while a slower peer is still
        # connecting ("Gloo connectFullMesh failed ... Connection closed by peer", seen at load ~30)
        dist.barrier()
        value = fn(*args, **kwargs)
        buf = io.BytesIO()
        torch.save(value, buf)
        payload = buf.getvalue()
    except BaseException:  # report everything, including KeyboardInterrupt from a kill
        status, payload = "error", traceback.format_exc().encode()
    results.put((rank, status, payload))
    try:
        if dist.is_initialized() and status == "ok":
            dist.destroy_process_group()
    except Exception:
        pass


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results."""
    if world_size < 1:
        raise ValueError(f"run_distributed: world_size must be >= 1, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    pg_timeout_s = max(5.0, timeout * 0.8)
    store = _rendezvous_store(timeout)  # kept alive (served) until every rank has reported
    port = int(store.port)
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, pg_timeout_s, results, args, kwargs),
                         daemon=True, name=f"zerospeed-rank{r}") for r in range(world_size)]
    for p in procs:
        p.start()
    reports: dict[int, tuple[str, bytes]] = {}
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while len(reports) < world_size:
        now = time.monotonic()
        limit = deadline if failed_at is None else min(deadline, failed_at + _FAIL_GRACE_S)
        if now >= limit:
            break
        try:
            rank, status, payload = results.get(timeout=min(0.5, limit - now))
        except queue_mod.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
            continue
        reports[rank] = (status, payload)
        if status != "ok" and failed_at is None:
            failed_at = time.monotonic()
    for p in procs:
        p.join(timeout=2.0 if len(reports) == world_size else 0.1)
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)
    del store
    problems = []
    for r in range(world_size):
        if r not in reports:
            why = "timed out" if failed_at is None and time.monotonic() >= deadline else "did not finish"
            problems.append(f"rank {r}: {why} (exit code {procs[r].exitcode}) after {timeout:.0f}s limit"
                            if why == "timed out" else f"rank {r}: {why} (killed after a peer failed; exit code {procs[r].exitcode})")
        elif reports[r][0] != "ok":
            problems.append(f"rank {r} raised:\n{reports[r][1].decode()}")
    if problems:
        raise DistributedTestError(f"{fn.__name__} on world size {world_size} failed:\n" + "\n".join(problems))
    return [torch.load(io.BytesIO(reports[r][1]), weights_only=False) for r in range(world_size)]
