"""Run a training script many times as torchrun would, cheaply: ``python forked_ranks.py SCRIPT RUNS WORLD OUT``.

torch, zerospeed and the engine are imported once here; each run forks ``WORLD`` children which
get torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` on a fresh loopback
port), run ``SCRIPT OUT/run<i>`` as ``__main__`` and then leave through the interpreter's ordinary
exit (``SystemExit`` at the top level: ``atexit`` handlers, module teardown, C++ destructors), the
path a script that falls off its end takes. ``gc.freeze()`` before the forks keeps the children's
final collection from walking (and copying) the preloaded modules, which would cost seconds per run.

Prints one JSON line: ``[[exit status of rank 0, ...], ...]`` per run (``-signum`` for a signal).
"""

import gc
import json
import os
import runpy
import socket
import sys

import torch  # noqa: F401 - preloaded for the children
import torch._dynamo  # noqa: F401 - the optimizer constructor imports it
import torch.distributed  # noqa: F401

import zerospeed.runtime.initialize  # noqa: F401

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
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                              LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port))
            sys.argv = [script, run_dir]
            runpy.run_path(script, run_name="__main__")
            sys.exit(0)  # reaches the top level of this file: the ordinary interpreter exit
        pids.append(pid)
    codes = []
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        codes.append(os.waitstatus_to_exitcode(status))
    statuses.append(codes)
print(json.dumps(statuses), flush=True)
