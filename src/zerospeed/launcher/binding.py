"""``--bind_cores_to_rank`` / ``--bind_core_list``: give each local rank its own CPU cores.

DeepSpeed facts kept (``deepspeed/utils/numa.py``, 0.19.8): the core list is comma-separated
numbers or inclusive ``a-b`` ranges in ascending order without overlap (``"0,2-4,6"``); each of
the node's ``n`` ranks gets ``len(cores) // n`` consecutive cores of the list (rank ``r`` the
slice ``[r*k, (r+1)*k)``); ``OMP_NUM_THREADS`` is set to that count; ``KMP_AFFINITY`` in the
environment is refused (it overrides the binding); fewer cores than ranks is an error.

How, differently from DeepSpeed (which prefixes each worker with ``numactl``): torchrun starts
every worker with the same command, so the launcher starts ``python -m
zerospeed.launcher.bind_worker SCRIPT ARGS`` instead of ``python SCRIPT ARGS``; that worker
computes its cores from ``LOCAL_RANK``, calls ``os.sched_setaffinity`` and then ``exec``\\s the
real command, which inherits the affinity (and ``OMP_NUM_THREADS``, so torch uses that many
threads). No numactl is needed; memory binding to a NUMA node is left to the kernel's first-touch
policy. Without ``--bind_core_list`` the cores are those the launcher itself may run on
(``os.sched_getaffinity``), not DeepSpeed's ``0..physical_cores-1``, so a container's or job's CPU
set is respected.
"""

from __future__ import annotations

import argparse
import os

from zerospeed.launcher.hostfile import LaunchError

CORES_ENV = "ZEROSPEED_BIND_CORES"  # the node's expanded core list, "0,1,2,3"
NPROC_ENV = "ZEROSPEED_BIND_NPROC"  # ranks per node sharing it


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bind_cores_to_rank", action="store_true",
                   help="bind each local rank to its own share of the CPU cores and set OMP_NUM_THREADS to it")
    p.add_argument("--bind_core_list", default=None,
                   help="cores to share among the local ranks, e.g. '0-15,32-47' (default: all this "
                   "process may use); needs --bind_cores_to_rank")


def parse_core_list(text: str) -> list[int]:
    """``"0,2-4,6"`` -> ``[0, 2, 3, 4, 6]`` (ascending, non-overlapping, as DeepSpeed requires)."""
    cores: list[int] = []
    for item in text.split(","):
        bounds = item.split("-")
        try:
            if len(bounds) == 1:
                start = end = int(bounds[0])
            elif len(bounds) == 2:
                start, end = int(bounds[0]), int(bounds[1])
            else:
                raise ValueError
        except ValueError:
            raise LaunchError(f"--bind_core_list: bad item {item!r} in {text!r} (expected N or A-B)") from None
        if start < 0 or end < start:
            raise LaunchError(f"--bind_core_list: bad range {item!r} in {text!r} (need 0 <= A <= B)")
        if cores and start <= cores[-1]:
            raise LaunchError(f"--bind_core_list: {item!r} in {text!r} overlaps or is not in ascending order")
        cores.extend(range(start, end + 1))
    return cores


def cores_for_rank(cores: list[int], nproc: int, local_rank: int) -> list[int]:
    per_rank = len(cores) // nproc
    if per_rank < 1:
        raise LaunchError(f"--bind_cores_to_rank: {len(cores)} cores for {nproc} processes per node; each rank "
                          "needs at least one")
    if not 0 <= local_rank < nproc:
        raise LaunchError(f"--bind_cores_to_rank: local rank {local_rank} is not in 0..{nproc - 1}")
    return cores[per_rank * local_rank: per_rank * (local_rank + 1)]


def plan(args: argparse.Namespace, nproc: int) -> tuple[dict[str, str], list[str]]:
    """(environment for the workers, the worker module to put before the user's ``[--module] script``)."""
    if not args.bind_cores_to_rank:
        if args.bind_core_list is not None:
            raise LaunchError("--bind_core_list: needs --bind_cores_to_rank")
        return {}, []
    if "KMP_AFFINITY" in os.environ:
        raise LaunchError("--bind_cores_to_rank: KMP_AFFINITY is set and would override the binding; unset it")
    if args.no_python:
        raise LaunchError("--bind_cores_to_rank: not supported with --no_python")
    if args.bind_core_list is not None:
        cores = parse_core_list(args.bind_core_list)
        allowed = os.sched_getaffinity(0)
        outside = [c for c in cores if c not in allowed]
        if outside:
            raise LaunchError(f"--bind_core_list: cores {outside} are not available to this process "
                              f"(available: {sorted(allowed)})")
    else:
        cores = sorted(os.sched_getaffinity(0))
    per_rank = len(cores_for_rank(cores, nproc, 0))
    env = {CORES_ENV: ",".join(map(str, cores)), NPROC_ENV: str(nproc), "OMP_NUM_THREADS": str(per_rank)}
    return env, ["--module", "zerospeed.launcher.bind_worker"]  # the runner adds the program (and its --module)
