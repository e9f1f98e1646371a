"""What a multi-node launch needs from the network: this node's interface, its node rank, a reachable master.

Three problems a new user meets on their first two-node run, each solved here before torchrun starts:

* **Which interface gloo/NCCL use.** Without ``GLOO_SOCKET_IFNAME``, gloo binds to the address the
  machine's *hostname* resolves to. In containers that name often resolves to ``127.0.0.1``; the
  rank then tells its peers to reach it at 127.0.0.1, which on another host is that host's own
  loopback, and the job fails after its timeout. When neither ``GLOO_SOCKET_IFNAME`` nor
  ``NCCL_SOCKET_IFNAME`` is set and the job spans several nodes, :func:`socket_ifname_env` picks the
  interface that carries traffic to the master address (the kernel's own route choice: the source
  address of a UDP socket "connected" to the master, no packet sent) and sets both variables to
  it, logging the choice. A variable the user set is never changed.
* **Which hostfile line is this node.** A hostfile line may name this node by a name that is not
  its hostname (``hostA`` in a hostfile, ``box`` as hostname). :func:`local_addresses` lists the
  addresses of this node's interfaces, so a line whose name *resolves* to one of them is this node.
  Loopback addresses never match by resolution: a name resolving to 127.x is every node.
* **Rendezvous errors that name the address.** :func:`check_master` runs before torchrun: on node 0
  the master port must be free on this node (else ``--master_port: <addr>:<port> is already in
  use``, at once); on the other nodes the master must become reachable within the rendezvous
  timeout (else an error naming the address, the port and the last socket error), instead of
  torchrun's long wait and stack trace. The probe opens and closes one TCP connection per second;
  torch's store server ignores such a client.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import sys
import time
from collections.abc import Iterable
from typing import Any

from zerospeed.launcher.hostfile import LaunchError

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
DEFAULT_RDZV_TIMEOUT_S = 900.0


def resolve_ipv4(name: str) -> str | None:
    """The first IPv4 address ``name`` resolves to, or None."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    return str(infos[0][4][0]) if infos else None


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def interface_addresses() -> dict[str, list[str]]:
    """``{interface name: [IPv4 addresses]}`` of this node (this network namespace)."""
    import psutil

    out: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        v4 = [a.address for a in addrs if a.family == socket.AF_INET]
        if v4:
            out[name] = v4
    return out


def local_addresses() -> set[str]:
    """Every IPv4 address of this node's interfaces, loopback included."""
    return {a for addrs in interface_addresses().values() for a in addrs}


def route_source(address: str) -> str:
    """The local address the kernel would use to send to ``address`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((address, 9))
        return str(s.getsockname()[0])


def interface_for(master: str) -> tuple[str, str, str]:
    """``(interface, local address, master address)`` of the route from this node to ``master``."""
    master_ip = resolve_ipv4(master)
    if master_ip is None:
        raise LaunchError(f"--master_addr: cannot resolve {master!r} to an IPv4 address")
    try:
        source = route_source(master_ip)
    except OSError as e:
        raise LaunchError(f"--master_addr: no route from this node to {master} ({master_ip}): {e.strerror}") from None
    for name, addrs in interface_addresses().items():
        if source in addrs:
            return name, source, master_ip
    raise LaunchError(f"--master_addr: the route to {master} ({master_ip}) leaves from {source}, "
                      "which no interface of this node has")


def socket_ifname_env(master: str, environ: dict[str, str], log: bool = True) -> dict[str, str]:
    """``{GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME}`` for a multi-node job, or ``{}`` when the user set either."""
    if any(environ.get(v) for v in IFNAME_VARS):
        return {}
    name, source, master_ip = interface_for(master)
    if log:
        print(f"zerospeed: using network interface {name} ({source}), the route to the master {master} "
              f"({master_ip}): GLOO_SOCKET_IFNAME={name} NCCL_SOCKET_IFNAME={name} (set either to choose)",
              file=sys.stderr, flush=True)
    return dict.fromkeys(IFNAME_VARS, name)


def names_by_address(names: Iterable[str], local: set[str]) -> set[str]:
    """The ``names`` that resolve to a non-loopback address in ``local`` (this node's addresses)."""
    found = set()
    for name in names:
        ip = resolve_ipv4(name)
        if ip is not None and not is_loopback(ip) and ip in local:
            found.add(name)
    return found


def local_names_for(hosts: Iterable[Any]) -> set[str]:
    """Names by which ``hosts`` (hostfile entries) may refer to this node: its own names, and the
    entries whose name resolves to one of its (non-loopback) interface addresses."""
    from zerospeed.launcher.hostfile import local_host_names

    names = local_host_names()
    return names | names_by_address([h.hostname for h in hosts], local_addresses())


def check_master(master: str, port: int, is_master: bool, timeout_s: float) -> None:
    """Fail fast, naming the address, when the rendezvous cannot work (see the module docstring)."""
    master_ip = resolve_ipv4(master)
    if master_ip is None:
        raise LaunchError(f"--master_addr: cannot resolve {master!r} to an IPv4 address")
    where = f"{master}:{port}" if master == master_ip else f"{master}:{port} ({master_ip})"
    if is_master:
        if master_ip not in local_addresses() and not is_loopback(master_ip):
            raise LaunchError(f"--master_addr: this is node 0 (the master) but {where} is not an address of "
                              "this node; node 0 of the hostfile must be the master")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("" if not is_loopback(master_ip) else master_ip, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise LaunchError(f"--master_port: {where} is already in use on this node (another job, or "
                                      "a previous one still exiting): pick a free --master_port") from None
                raise LaunchError(f"--master_port: cannot listen on {where}: {e.strerror}") from None
        return
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        try:
            with socket.create_connection((master_ip, port), timeout=min(5.0, max(timeout_s, 0.1))):
                return
        except OSError as e:
            last = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            raise LaunchError(f"--master_addr/--master_port: cannot reach the master at {where} within "
                              f"{timeout_s:g}s (--rdzv_timeout): {last}; check the address, the port and that "
                              "node 0 was started")
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
