"""``zerospeed serve --tensor-parallel N``: N ranks started through the launcher, rank 0 serves HTTP.

Decisions:

* The command re-enters itself under torchrun (the launcher's ``run_torchrun``, ``--standalone``
  on this machine, ``--module`` the serving command :mod:`zerospeed.inference.serving.cli`, which hands
  a worker back here: ``RANK`` is set) with the same arguments; each worker initialises the
  default process group (gloo on CPU, NCCL on GPU, through ``zerospeed.comm``) and builds its
  shard of the engine with ``build_engine(..., tensor_parallel=N)``.
* Rank 0 runs the HTTP server exactly as one rank does (the engine thread drives the
  tensor-parallel engine, which broadcasts each ragged batch); ranks > 0 run
  ``engine.run_worker_loop()`` until rank 0's ``engine.shutdown()`` releases them.
* Ranks > 0 ignore SIGINT/SIGTERM: shutdown is rank 0's decision (it finishes or cancels the
  in-flight requests first), so a worker never leaves rank 0 blocked in a collective.
* SIGTERM/SIGINT to the command reach torchrun's agent, which passes them to the ranks and waits
  for them; the command then exits 0 like a one-rank server (torchrun itself would report 143).
* Before anything starts, a build without the engine's tensor-parallel runtime is a clear
  usage error instead of N processes failing one by one.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
from typing import Any

RUNTIME_MODULE = "zerospeed.inference.tp_runtime"


def available() -> bool:
    """Whether the engine's tensor-parallel runtime is part of this build."""
    return importlib.util.find_spec(RUNTIME_MODULE) is not None


def main(args: argparse.Namespace, argv: list[str], cli: Any) -> int:
    """From the command: start ``args.tensor_parallel`` ranks through torchrun (in a worker: serve or follow).

    ``cli`` is the serving command's module (:mod:`zerospeed.inference.serving.cli`), passed in rather than
    imported: the command imports this file, so this file does not import it back.
    """
    if not available():
        print("zerospeed serve: error: --tensor-parallel: the inference engine's "
              f"tensor-parallel runtime ({RUNTIME_MODULE}) is not in this build; use "
              f"--tensor-parallel 1 (got {args.tensor_parallel})", file=sys.stderr, flush=True)
        return 2
    if "RANK" in os.environ:  # already a torchrun worker (someone ran `zerospeed --num_procs N`)
        return worker_main(args, cli)
    from zerospeed.launcher.runner import run_torchrun

    torchrun_argv = ["--standalone", "--nnodes", "1", "--nproc_per_node", str(args.tensor_parallel),
                     "--module", "zerospeed.inference.serving.cli", *argv]
    status = run_torchrun(torchrun_argv)
    if status in (128 + signal.SIGTERM, 128 + signal.SIGINT):
        # torchrun's agent passed the signal on to the ranks and waited for them: rank 0 finished
        # its in-flight requests and released the others, as a one-rank server does on SIGTERM
        return 0
    return status


def worker_main(args: argparse.Namespace, cli: Any) -> int:
    """One rank of a tensor-parallel server (``cli``: as in :func:`main`)."""
    from zerospeed.comm.dist import get_rank, get_world_size, init_distributed
    from zerospeed.inference.build import build_engine
    _error, engine_kwargs, run_server = cli._error, cli.engine_kwargs, cli.run_server

    rank = int(os.environ.get("RANK", "0"))
    if rank > 0:  # rank 0 decides when to stop
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    init_distributed()
    if get_world_size() != args.tensor_parallel:
        return _error(f"--tensor-parallel: {args.tensor_parallel} but the world has "
                      f"{get_world_size()} ranks", 2)
    try:
        engine = build_engine(args.model_dir, tensor_parallel=args.tensor_parallel,
                              **engine_kwargs(args))
    except (ValueError, OSError) as e:
        return _error(f"{args.model_dir}: {e}", 1)
    if get_rank() == 0:
        return run_server(args, engine=engine)
    engine.run_worker_loop()
    return 0
