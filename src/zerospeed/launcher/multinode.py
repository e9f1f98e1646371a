"""Launcher flags and pre-flight steps for multi-node and fault-tolerant jobs (used by :mod:`.runner`).

* ``--max_restarts N`` is handed to torchrun's elastic agent: when a worker dies, the agent stops
  the worker group and starts it again, up to N times (default 0, as torchrun). The restarted
  workers resume from their last checkpoint themselves (``engine.load_checkpoint`` at start-up,
  see README "Elastic restart and resume"); ``TORCHELASTIC_RESTART_COUNT`` tells them which attempt
  they are.
* ``--monitor_interval S``: how often the agent checks its workers (torchrun's flag; a smaller
  value restarts sooner after a kill).
* ``--rdzv_timeout S`` (default 900): how long a node waits for the master before giving up.
* Before torchrun starts a multi-node job (:func:`prepare`): the network interface for gloo/NCCL is
  chosen when the user set none, and the master address/port are checked, so a wrong address or a
  busy port is one error line naming the address (see :mod:`.network`).
"""

from __future__ import annotations

import argparse
import os

from zerospeed.launcher import network
from zerospeed.launcher.hostfile import LaunchError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max_restarts", type=int, default=None,
                   help="restart the worker group up to N times when a worker fails (torchrun's elastic agent)")
    p.add_argument("--monitor_interval", type=float, default=None,
                   help="seconds between the agent's checks of its workers (torchrun's default: 0.1)")
    p.add_argument("--rdzv_timeout", type=float, default=network.DEFAULT_RDZV_TIMEOUT_S,
                   help=f"seconds a node waits for the master (default {network.DEFAULT_RDZV_TIMEOUT_S:g})")


def torchrun_flags(args: argparse.Namespace) -> list[str]:
    """Flags for torchrun, placed before the script."""
    out: list[str] = []
    if args.max_restarts is not None:
        if args.max_restarts < 0:
            raise LaunchError(f"--max_restarts: must be at least 0, got {args.max_restarts}")
        out += ["--max_restarts", str(args.max_restarts)]
    if args.monitor_interval is not None:
        if args.monitor_interval <= 0:
            raise LaunchError(f"--monitor_interval: must be positive, got {args.monitor_interval:g}")
        out += ["--monitor_interval", f"{args.monitor_interval:g}"]
    if args.rdzv_timeout <= 0:
        raise LaunchError(f"--rdzv_timeout: must be positive, got {args.rdzv_timeout:g}")
    return out


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def prepare(args: argparse.Namespace, torchrun_argv: list[str], env: dict[str, str]) -> dict[str, str]:
    """Pre-flight for a multi-node job: check the master, pick the interface; returns extra environment."""
    nnodes = _flag(torchrun_argv, "--nnodes") or "1"
    if "--standalone" in torchrun_argv or nnodes.split(":")[-1] == "1":
        return {}
    endpoint = _flag(torchrun_argv, "--rdzv_endpoint")
    if endpoint is not None:
        host, _, port_text = endpoint.rpartition(":")
        master, port, is_master = (host or endpoint), int(port_text or 29400), None
    else:
        master = _flag(torchrun_argv, "--master_addr") or "127.0.0.1"
        port = int(_flag(torchrun_argv, "--master_port") or 29500)
        is_master = _flag(torchrun_argv, "--node_rank") == "0"
    if is_master is not None:  # the c10d endpoint may be any node's agent: only resolve it
        network.check_master(master, port, is_master, args.rdzv_timeout)
    return network.socket_ifname_env(master, {**os.environ, **env})
