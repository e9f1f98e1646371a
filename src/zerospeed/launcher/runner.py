"""The ``zerospeed`` command: DeepSpeed's launcher flags in, torchrun underneath.

``zerospeed --num_procs 2 train.py --config ds.json`` starts two workers on this machine;
``zerospeed --hostfile hosts train.py ...`` run on every host of a DeepSpeed-style hostfile starts
that host's share of a multi-node job. The command only *translates* flags to
``torch.distributed.run`` (torchrun) and calls it in this process, so the elastic agent of PyTorch
does all the work (rendezvous, spawning, signal forwarding, failure reports) and nothing
home-made sits on top of it.

Decisions, and how they differ from DeepSpeed's ``deepspeed`` command:

* No ssh/pdsh fan-out: the command is run on every node (by hand, by SLURM ``srun``, by a k8s
  job), each node finds its own node rank in the hostfile by its hostname, or takes
  ``--node_rank``. This is how torchrun works and keeps the launcher free of remote execution.
* Local runs use torchrun's ``--standalone`` rendezvous (a free port, no clash between jobs)
  unless a ``--master_port``/``--master_addr`` is given, which selects the static rendezvous.
* Multi-node runs use the static rendezvous (``--master_addr``, ``--master_port``, ``--node_rank``)
  unless ``--rdzv_endpoint`` is given, which selects the ``c10d`` (or ``--rdzv_backend``) one.
* Workers read ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` from the environment (torchrun's default);
  ``--local_rank`` is not appended to the script's arguments, so scripts that do not declare it
  still run. Scripts written for DeepSpeed declare it with a default and read ``LOCAL_RANK``.
* With a hostfile, ``--num_nodes`` keeps its first N hosts and ``--num_procs`` the first N slots
  of each host, as in DeepSpeed; every node must end up with the same number of slots because
  torchrun runs the same number of workers per node.
* The exit status is the first failed worker's (``128 + signal`` when a worker was killed by a
  signal, or when the launcher itself was); bad input exits with 2 and one ``zerospeed: error:``
  line naming the flag, path or hostfile line.
* Each worker runs its script through :mod:`.script_wrapper` (``python SCRIPT`` semantics kept), which writes an
  uncaught exception to torchrun's error file instead of printing it; when workers fail, the launcher's last output
  is one short block (:mod:`.failures`): the ranks, the exception's type and message, the file and line in the
  user's script, and the path of the log holding every failed rank's traceback (issue #33).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from zerospeed.launcher import binding, commands, failures, multinode, network, script_wrapper
from zerospeed.launcher.hostfile import (
    HostEntry,
    LaunchError,
    filter_hosts,
    find_node_rank,
    parse_hostfile,
    uniform_slots,
)

DEFAULT_MASTER_PORT = 29500
#: DeepSpeed's name for the file of ``KEY=VALUE`` exports its multi-node runner copies to every node (``DS_ENV_FILE``
#: overrides it). Accelerate imports it (``accelerate launch --use_deepspeed``) and writes it for multi-node runs,
#: which it starts with DeepSpeed's own ``deepspeed`` command (not built); zerospeed's launcher does not read it.
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
EXIT_USAGE = 2


@dataclass(frozen=True)
class LaunchPlan:
    """What will be run: torchrun's argument list and extra environment variables.

    ``torchrun_argv`` is what ``torch.distributed.run.main`` receives (no program name); ``env``
    is added to this process' environment before the call, so the agent and workers inherit it.
    """

    torchrun_argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    #: where the user's program starts in ``torchrun_argv`` (``[--module] SCRIPT ARGS``, after any
    #: ``--bind_cores_to_rank`` worker); ``None`` with ``--no_python``, whose program cannot be wrapped
    program_at: int | None = None

    def worker_argv(self) -> list[str]:
        """``torchrun_argv`` with each worker's program run through :mod:`.script_wrapper`, which records an
        uncaught exception for the failure summary (:mod:`.failures`); what :func:`main` hands to torchrun."""
        if self.program_at is None:
            return list(self.torchrun_argv)
        at = self.program_at
        return [*self.torchrun_argv[:at], script_wrapper.__file__, *self.torchrun_argv[at:]]

    def command_line(self) -> str:
        """The equivalent shell command, as ``--dry_run`` prints it."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        cmd = shlex.join(["torchrun", *self.torchrun_argv])
        return f"{env} {cmd}" if env else cmd


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (a :class:`LaunchError`), not usage + exit."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise LaunchError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="zerospeed",
        description="Launch a (multi-process, multi-node) training script via torchrun, "
        "taking DeepSpeed's launcher flags.",
        allow_abbrev=False,
    )
    p.add_argument("--num_procs", "--num_gpus", "--nproc_per_node", dest="num_procs", type=int,
                   default=None, help="workers per node (default: the hostfile's slots, else the "
                   "number of visible GPUs, else 1)")
    p.add_argument("--nnodes", "--num_nodes", dest="nnodes", default=None,
                   help="number of nodes (N, or MIN:MAX for an elastic c10d job); with a hostfile, "
                   "use only its first N hosts")
    p.add_argument("--node_rank", type=int, default=None,
                   help="rank of this node (default: found in the hostfile by hostname)")
    p.add_argument("--master_addr", default=None,
                   help="address of node 0 for the static rendezvous (default: the first host)")
    p.add_argument("--master_port", type=int, default=None,
                   help=f"port on node 0 for the static rendezvous (default {DEFAULT_MASTER_PORT})")
    p.add_argument("--rdzv_endpoint", default=None,
                   help="host:port of a dynamic rendezvous (selects --rdzv_backend c10d)")
    p.add_argument("--rdzv_backend", default=None, help="rendezvous backend (static, c10d, etcd)")
    p.add_argument("--rdzv_id", default=None, help="job id shared by all nodes of a rendezvous")
    p.add_argument("-H", "--hostfile", default=None,
                   help="DeepSpeed-style hostfile: lines 'hostname slots=N'")
    p.add_argument("-i", "--include", default=None,
                   help="hosts/slots to use, e.g. 'worker-0@worker-1:0,2'")
    p.add_argument("-e", "--exclude", default=None,
                   help="hosts/slots to leave out, e.g. 'worker-1:0'")
    p.add_argument("-m", "--module", action="store_true",
                   help="run user_script as a module (python -m)")
    p.add_argument("--no_python", action="store_true",
                   help="run user_script as an executable, not with python")
    p.add_argument("--autotuning", choices=("tune", "run"), default=None,
                   help="search ZeRO stage, batch sizes, buckets and offload for the script's config "
                   "(tune), then train with the best one (run); see zerospeed.autotuning")
    p.add_argument("--dry_run", action="store_true",
                   help="print the torchrun command instead of running it")
    multinode.add_arguments(p)
    binding.add_arguments(p)
    p.add_argument("user_script", metavar="user_script", nargs="?", default=None,
                   help="training script (or module with --module)")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse launcher flags (``args``: DeepSpeed's keyword; default ``sys.argv[1:]``); raises :class:`LaunchError` on
    bad input."""
    return build_parser().parse_args(list(sys.argv[1:] if args is None else args))


def _parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2), ``"1:4"`` -> (1, 4)."""
    try:
        parts = [int(x) for x in text.split(":")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or parts[0] < 1 or parts[1] < parts[0]:
        raise LaunchError(f"--nnodes: expected a positive integer or MIN:MAX, got {text!r}")
    return parts[0], parts[1]


def _default_num_procs() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _check_script(args: argparse.Namespace) -> None:
    if not args.user_script:
        raise LaunchError("user_script: missing (usage: zerospeed [flags] script.py [args...])")
    if args.module or args.no_python:
        if args.module and args.no_python:
            raise LaunchError("--module and --no_python cannot be used together")
        return
    if not os.path.isfile(args.user_script):
        raise LaunchError(f"user_script: no such file: {args.user_script}")


def _hostfile_plan(
    args: argparse.Namespace, local_names: Iterable[str] | None
) -> tuple[int, int, str, int | None, HostEntry | None]:
    """Resolve a hostfile to (nnodes, nproc_per_node, master_addr, node_rank, this host)."""
    source = args.hostfile
    hosts = filter_hosts(parse_hostfile(source), args.include, args.exclude)
    if args.nnodes is not None:
        low, high = _parse_nnodes(args.nnodes)
        if low != high:
            raise LaunchError("--nnodes: a MIN:MAX range cannot be combined with --hostfile")
        if low > len(hosts):
            raise LaunchError(f"--nnodes: {low} nodes requested but {source} has {len(hosts)}")
        hosts = hosts[:low]
    if args.num_procs is not None:
        short = [h for h in hosts if h.num_slots < args.num_procs]
        if short:
            raise LaunchError(
                f"--num_procs: {args.num_procs} per node requested but host "
                f"{short[0].hostname!r} ({source}:{short[0].line_no}) has {short[0].num_slots} slots"
            )
        hosts = [HostEntry(h.hostname, h.slots[: args.num_procs], h.line_no) for h in hosts]
    nproc = uniform_slots(hosts, source)
    master_addr = args.master_addr or hosts[0].hostname
    node_rank = args.node_rank
    if node_rank is None:
        # the static rendezvous needs our rank; with c10d it only serves to pick our device slots
        try:
            node_rank = find_node_rank(
                hosts, network.local_names_for(hosts) if local_names is None else local_names, source
            )
        except LaunchError:
            if args.rdzv_endpoint is None:
                raise
    if node_rank is not None and not 0 <= node_rank < len(hosts):
        raise LaunchError(f"--node_rank: {node_rank} is not in 0..{len(hosts) - 1} ({source})")
    this_host = hosts[node_rank] if node_rank is not None else None
    return len(hosts), nproc, master_addr, node_rank, this_host


def _visible_devices(host: HostEntry | None) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for a host whose kept slots are not simply ``0..n-1``."""
    if host is None or host.slots == tuple(range(host.num_slots)):
        return {}
    current = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = current.split(",") if current else [str(i) for i in range(max(host.slots) + 1)]
    if max(host.slots) >= len(devices):
        raise LaunchError(
            f"--include/--exclude: slot {max(host.slots)} but CUDA_VISIBLE_DEVICES={current!r}"
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(devices[s] for s in host.slots)}


def build_plan(
    args: argparse.Namespace, local_names: Iterable[str] | None = None
) -> LaunchPlan:
    """Translate parsed launcher flags to a :class:`LaunchPlan` (pure except the file checks).

    ``local_names`` are the names this machine answers to in a hostfile (default: its hostname,
    FQDN and addresses); tests pass them explicitly.
    """
    _check_script(args)
    if args.num_procs is not None and args.num_procs < 1:
        raise LaunchError(f"--num_procs: must be at least 1, got {args.num_procs}")
    if (args.include or args.exclude) and not args.hostfile:
        raise LaunchError("--include/--exclude need a --hostfile to select from")
    if args.rdzv_endpoint and (args.master_addr or args.master_port is not None):
        raise LaunchError(
            "--master_addr/--master_port belong to the static rendezvous; "
            "leave them out with --rdzv_endpoint"
        )
    backend = args.rdzv_backend or ("c10d" if args.rdzv_endpoint else "static")
    if backend != "static" and not args.rdzv_endpoint:
        raise LaunchError(f"--rdzv_backend {backend}: needs --rdzv_endpoint host:port")
    if backend == "static" and args.rdzv_endpoint:
        raise LaunchError("--rdzv_endpoint: not used by --rdzv_backend static")

    env: dict[str, str] = {}
    node_rank = args.node_rank
    master_addr = args.master_addr
    if args.hostfile:
        nnodes_low, nproc, master_addr, node_rank, this_host = _hostfile_plan(args, local_names)
        nnodes = f"{nnodes_low}"
        env.update(_visible_devices(this_host))
    else:
        nproc = args.num_procs if args.num_procs is not None else _default_num_procs()
        nnodes_low, nnodes_high = _parse_nnodes(args.nnodes or "1")
        nnodes = args.nnodes or "1"
        if nnodes_high > 1 and backend == "static":
            if nnodes_low != nnodes_high:
                raise LaunchError("--nnodes: a MIN:MAX range needs --rdzv_endpoint (c10d)")
            if node_rank is None:
                raise LaunchError(
                    f"--node_rank: required with --nnodes {nnodes} (or give --hostfile "
                    "or --rdzv_endpoint)"
                )
            if master_addr is None:
                raise LaunchError(f"--master_addr: required with --nnodes {nnodes}")
    if node_rank is not None and node_rank < 0:
        raise LaunchError(f"--node_rank: must be at least 0, got {node_rank}")

    argv: list[str] = []
    if backend != "static":
        argv += ["--nnodes", nnodes, "--nproc_per_node", str(nproc),
                 "--rdzv_backend", backend, "--rdzv_endpoint", args.rdzv_endpoint]
        if args.rdzv_id is not None:
            argv += ["--rdzv_id", args.rdzv_id]
    elif nnodes == "1" and node_rank in (None, 0) and master_addr is None \
            and args.master_port is None and not args.hostfile:
        argv += ["--standalone", "--nnodes", "1", "--nproc_per_node", str(nproc)]
    else:
        argv += ["--nnodes", nnodes, "--nproc_per_node", str(nproc),
                 "--node_rank", str(node_rank or 0),
                 "--master_addr", master_addr or "127.0.0.1",
                 "--master_port", str(args.master_port or DEFAULT_MASTER_PORT)]
    argv += multinode.torchrun_flags(args)
    bind_env, bind_worker = binding.plan(args, nproc)  # --bind_cores_to_rank: a pinning worker runs the script
    env.update(bind_env)
    argv += bind_worker
    program_at = None if args.no_python else len(argv)
    if args.module:
        argv.append("--module")
    if args.no_python:
        argv.append("--no_python")
    argv += [args.user_script, *args.user_args]
    return LaunchPlan(argv, env, program_at)


def _exit_status(exitcode: int) -> int:
    """A worker's exit code as a shell status (signals as 128 + signum)."""
    if exitcode < 0:
        return 128 - exitcode
    return exitcode if exitcode > 0 else 1


class _DropWorkerFailedRecords(logging.Filter):
    """The agent's ``failed (exitcode: 1) local_rank: 0 ...`` line: the summary printed last says it, better."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed (exitcode")


def _num_ranks(torchrun_argv: list[str]) -> int | None:
    try:
        nnodes = torchrun_argv[torchrun_argv.index("--nnodes") + 1]
        nproc = torchrun_argv[torchrun_argv.index("--nproc_per_node") + 1]
        return int(nnodes) * int(nproc)
    except (ValueError, IndexError):
        return None  # an elastic MIN:MAX job: the count is the rendezvous's


def report_failure(program: str, error: Any, torchrun_argv: list[str]) -> int:
    """Print the failure summary (:mod:`.failures`) last, write the tracebacks' log; returns the exit status."""
    log = failures.log_path(error.failures)
    if log is not None:
        try:
            failures.write_log(error.failures, log)
        except OSError:
            log = None
    sys.stdout.flush()
    lines = failures.summarize(program, error.failures, _num_ranks(torchrun_argv), log)
    print("\n".join(lines), file=sys.stderr)
    _, first = error.get_first_failure()
    return _exit_status(first.exitcode)


def run_torchrun(torchrun_argv: list[str], program: str | None = None) -> int:
    """Run torchrun's agent in this process; returns the exit status for the shell.

    When workers fail, the last thing printed is the short summary of :func:`report_failure` (``program`` names
    the user's script in it; default: torchrun's name for the entry point), not torchrun's failure box.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args as torchrun_parse_args
    from torch.distributed.run import run as torchrun_run

    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    quiet = _DropWorkerFailedRecords()
    agent_log.addFilter(quiet)
    try:
        # torchrun's own main() is this call under @record, whose copy of the failure into a parent's error file
        # (there is none) only logs an error line
        torchrun_run(torchrun_parse_args(torchrun_argv))
    except ChildFailedError as e:
        return report_failure(program or e.name, e, torchrun_argv)
    except SignalException as e:
        print(f"zerospeed: stopped by signal {e.sigval.name}", file=sys.stderr)
        return 128 + int(e.sigval)
    finally:
        agent_log.removeFilter(quiet)
    return 0


def main(args: Sequence[str] | None = None) -> int:
    """Console entry point: parse, translate, run; returns the process exit status.

    ``args`` is the command line after the program name (default ``sys.argv[1:]``), the keyword DeepSpeed's
    ``deepspeed.launcher.runner.main(args=None)`` takes (issue #27)."""
    argv = list(sys.argv[1:] if args is None else args)
    run_command = commands.command(argv[0]) if argv else None
    if run_command is not None:  # `zerospeed serve MODEL_DIR ...`: a command registered by zerospeed.cli
        return run_command(argv[1:])
    try:
        opts = parse_args(argv)
        plan = build_plan(opts)
    except LaunchError as e:
        print(f"zerospeed: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if opts.dry_run:
        print(plan.command_line())
        return 0
    try:
        plan.env.update(multinode.prepare(opts, plan.torchrun_argv, plan.env))
    except LaunchError as e:
        print(f"zerospeed: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    os.environ.update(plan.env)
    if opts.autotuning:  # registered by zerospeed.cli, like the commands
        hook = commands.launch_hook("autotuning")
        if hook is None:
            print("zerospeed: error: --autotuning: the autotuner is not registered (import zerospeed)",
                  file=sys.stderr)
            return EXIT_USAGE
        return hook(opts, argv, plan.torchrun_argv)
    return run_torchrun(plan.worker_argv(), program=opts.user_script)


if __name__ == "__main__":
    sys.exit(main())
