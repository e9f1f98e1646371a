"""Run a training script many times as torchrun would, cheaply: ``python forked_ranks.py SCRIPT RUNS WORLD OUT``.

torch, zerospeed and the engine are imported once here; each run forks ``WORLD`` children which
get torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` on a fresh loopback
port), run ``SCRIPT OUT/run<i>`` as ``__main__`` and then leave through the interpreter's ordinary
exit (``SystemExit`` at the top level: ``atexit`` handlers, module teardown, C++ destructors), the
path a script that falls off its end takes. ``gc.freeze()`` before the forks keeps the children's
final collection from walking (and copying) the preloaded modules, which would cost seconds per run.

Prints one JSON line: ``[[exit status of rank 0, ...], ...]`` per run (``-signum`` for a signal).
Once a rank of a run failed, the others get ``FORKED_RANKS_GRACE_S`` seconds (default 30) to finish
before they are SIGKILLed (a SIGSTOPped rank included), so a failed run never hangs the driver.
"""

import faulthandler
import gc
import json
import os
import runpy
import signal
import socket
import sys
import time

import torch  # noqa: F401 - preloaded for the children
import torch._dynamo  # noqa: F401 - the optimizer constructor imports it
import torch.distributed  # noqa: F401

import zerospeed.runtime.initialize  # noqa: F401

GRACE_S = float(os.environ.get("FORKED_RANKS_GRACE_S", "30"))
script, num_runs, world_size, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
gc.freeze()
statuses = []
for run in range(num_runs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = os.path.join(out, f"run{run}")
    os.makedirs(run_dir, exist_ok=True)
    pids = []
    started = time.monotonic()
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                              LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port))
            faulthandler.register(signal.SIGUSR1, all_threads=True)
            sys.argv = [script, run_dir]
            runpy.run_path(script, run_name="__main__")
            sys.exit(0)  # reaches the top level of this file: the ordinary interpreter exit
        pids.append(pid)
    codes: list[int | None] = [None] * world_size
    pending = {pid: rank for rank, pid in enumerate(pids)}
    kill_at = None
    while pending:  # once a rank failed, the others get GRACE seconds, then SIGKILL (a stopped rank too)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if kill_at is not None and time.monotonic() > kill_at:
                for other in pending:  # first, where is it stuck? (faulthandler prints its stacks)
                    os.kill(other, signal.SIGUSR1)
                time.sleep(1.0)
                for other in pending:
                    os.kill(other, signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(0.01)
            continue
        rank = pending.pop(pid)
        codes[rank] = os.waitstatus_to_exitcode(status)
        if codes[rank] != 0 and kill_at is None:
            kill_at = time.monotonic() + GRACE_S
    statuses.append(codes)
    print(f"forked_ranks: run {run}: exit statuses {codes}, {time.monotonic() - started:.1f}s", file=sys.stderr,
          flush=True)
print(json.dumps(statuses), flush=True)
