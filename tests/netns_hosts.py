"""Two "hosts" on one machine: two network namespaces joined by a veth pair, for multi-host tests.

:class:`TwoHosts` creates namespaces ``zs<pid><a|b>``, a veth pair between them with addresses in
a private test subnet (``10.213.<n>.0/24``, ``n`` derived from the pid) that exists only inside
the two namespaces, brings ``lo`` up in each, and writes ``/etc/netns/<ns>/hosts`` (``ip netns
exec`` mounts it over ``/etc/hosts`` inside the namespace) mapping the hostfile names to the
namespace addresses. Commands run in a namespace with their own UTS namespace, so each "host" has
the hostname the test chooses: distinct names, or one shared name resolving to 127.0.0.1 as in many
containers. Traffic never leaves the two namespaces (nothing is routed to or from the host's own
network). Everything is removed on ``close()``, which the context manager, a ``finally`` and an
``atexit`` handler all call (idempotent); processes still running inside are killed first.

:func:`unavailable_reason` says why namespaces cannot be made here (not root, no ``ip``/``unshare``,
no permission), for a ``pytest.skip`` that tells the user what to do.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

_REASON: list[str | None] = []


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable_reason() -> str | None:
    """None when this process can create network namespaces, else why not (cached)."""
    if _REASON:
        return _REASON[0]
    reason = None
    if os.name != "posix" or not hasattr(os, "geteuid") or os.geteuid() != 0:
        reason = "network namespaces need root (run `make test-multihost` as root, as CI does)"
    elif shutil.which("ip") is None or shutil.which("unshare") is None:
        reason = "the `ip` (iproute2) and `unshare` (util-linux) commands are needed for network namespaces"
    else:
        probe = f"zsprobe{os.getpid()}"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            reason = f"cannot create a network namespace here: {made.stderr.strip()}"
        else:
            _ip("netns", "del", probe, check=False)
    _REASON.append(reason)
    return reason


class TwoHosts:
    """Namespaces ``a`` and ``b`` on one veth link; ``names`` maps hostfile names to them."""

    def __init__(self, names: tuple[str, str] = ("hostA", "hostB"), hostnames: tuple[str, str] | None = None) -> None:
        pid = os.getpid()
        self.ns = (f"zs{pid}a", f"zs{pid}b")
        self.veth = (f"zs{pid}a0", f"zs{pid}b0")
        subnet = 10 + pid % 240
        self.addr = (f"10.213.{subnet}.1", f"10.213.{subnet}.2")
        self.names = names
        self.hostnames = hostnames or names
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        atexit.register(self.close)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        for ns in self.ns:
            _ip("netns", "add", ns)
        _ip("link", "add", self.veth[0], "netns", self.ns[0], "type", "veth", "peer", "name", self.veth[1],
            "netns", self.ns[1])
        shared = "127.0.0.1" if self.hostnames[0] == self.hostnames[1] else None
        lines = ["127.0.0.1 localhost"]
        if shared:
            lines.append(f"{shared} {self.hostnames[0]}")  # one hostname on both hosts, resolving to loopback
        lines += [f"{a} {n}" for a, n in zip(self.addr, self.names)]
        for ns, veth, addr in zip(self.ns, self.veth, self.addr):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            _ip("-n", ns, "link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("\n".join(lines) + "\n")

    def __enter__(self) -> "TwoHosts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def command(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``host`` (0 or 1) with that host's hostname."""
        return ["ip", "netns", "exec", self.ns[host], "unshare", "--uts", "sh", "-c",
                f'hostname "$0" && exec "$@"', self.hostnames[host], *argv]

    def start(self, host: int, argv: list[str], env: dict[str, str], **kwargs: object) -> subprocess.Popen:
        proc = subprocess.Popen(self.command(host, argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True, **kwargs)  # type: ignore[arg-type]
        self._procs.append(proc)
        return proc

    def rx_tx_bytes(self, host: int = 0) -> tuple[int, int]:
        """Bytes received and sent on host ``host``'s end of the veth link so far."""
        out = subprocess.run(["ip", "netns", "exec", self.ns[host], "cat",
                              f"/sys/class/net/{self.veth[host]}/statistics/rx_bytes",
                              f"/sys/class/net/{self.veth[host]}/statistics/tx_bytes"],
                             capture_output=True, text=True, check=True, timeout=30).stdout.split()
        return int(out[0]), int(out[1])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for ns in self.ns:
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:  # anything of ours left inside (a worker that escaped its session)
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.ns:
            for _ in range(3):
                if _ip("netns", "del", ns, check=False).returncode == 0 or ns not in _ip("netns", "list").stdout:
                    break
                time.sleep(0.2)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        try:
            if Path("/etc/netns").is_dir() and not any(Path("/etc/netns").iterdir()):
                Path("/etc/netns").rmdir()
        except OSError:
            pass
