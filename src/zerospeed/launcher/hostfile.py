"""DeepSpeed-style hostfiles and ``--include`` / ``--exclude`` filters, as plain data.

A hostfile lists the machines of a job, one per line, in rank order::

    # comment lines and blank lines are ignored; a trailing "# ..." on a host line too
    worker-0 slots=4
    worker-1 slots=4

``slots`` is the number of worker processes (usually accelerators) on that host. The first host is
the rendezvous master and host ``i`` is node rank ``i``.

Filters use DeepSpeed's syntax ``NODE_SPEC[@NODE_SPEC ...]`` with ``NODE_SPEC = NAME[:SLOT[,SLOT]]``:
``--include "worker-0@worker-1:0,2"`` keeps all of worker-0 and slots 0 and 2 of worker-1;
``--exclude "worker-1:0"`` drops slot 0 of worker-1 (a bare name drops the whole host). A host's
resources are therefore a list of slot indices, not just a count: when the kept slots of this
machine are not ``0..n-1`` the launcher exposes exactly those devices (``CUDA_VISIBLE_DEVICES``).

Everything here is pure (no processes, no network) except :func:`local_host_names`, so it is
tested without launching anything. Every error is a :class:`LaunchError` whose message names the
file and line, or the flag, to fix.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass


class LaunchError(ValueError):
    """Bad launcher input; the message is one line naming the flag, path or line to fix."""


@dataclass(frozen=True)
class HostEntry:
    """One host line of a hostfile.

    Attributes:
        hostname: name (or address) as written in the hostfile.
        slots: the slot indices this job may use on the host (``0..slots-1`` before filtering).
        line_no: 1-based line in the hostfile, for error messages.
    """

    hostname: str
    slots: tuple[int, ...]
    line_no: int

    @property
    def num_slots(self) -> int:
        return len(self.slots)


def parse_hostfile_text(text: str, source: str = "<hostfile>") -> list[HostEntry]:
    """Parse hostfile ``text``; ``source`` names it in errors. Returns hosts in file order."""
    hosts: list[HostEntry] = []
    seen: dict[str, int] = {}
    for line_no, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{line_no}"
        fields = line.split()
        if len(fields) != 2 or not fields[1].startswith("slots="):
            raise LaunchError(
                f"{where}: expected 'hostname slots=N', got {raw.strip()!r}"
            )
        hostname, slots_field = fields
        slots_text = slots_field[len("slots="):]
        try:
            num_slots = int(slots_text)
        except ValueError:
            raise LaunchError(
                f"{where}: slots must be a positive integer, got {slots_text!r}"
            ) from None
        if num_slots < 1:
            raise LaunchError(f"{where}: slots must be a positive integer, got {num_slots}")
        if hostname in seen:
            raise LaunchError(
                f"{where}: host {hostname!r} is already listed on line {seen[hostname]}"
            )
        seen[hostname] = line_no
        hosts.append(HostEntry(hostname, tuple(range(num_slots)), line_no))
    if not hosts:
        raise LaunchError(f"{source}: no hosts found (expected lines 'hostname slots=N')")
    return hosts


def parse_hostfile(path: str | os.PathLike[str]) -> list[HostEntry]:
    """Read and parse the hostfile at ``path`` (errors name ``--hostfile`` and the path)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise LaunchError(f"--hostfile: no such file: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise LaunchError(f"--hostfile: cannot read {path}: {e.strerror}") from None
    return parse_hostfile_text(text, source=path)


def _parse_filter(spec: str, flag: str) -> dict[str, tuple[int, ...] | None]:
    """``"a@b:0,1"`` -> ``{"a": None, "b": (0, 1)}`` (``None`` = the whole host)."""
    result: dict[str, tuple[int, ...] | None] = {}
    for node_spec in spec.split("@"):
        node_spec = node_spec.strip()
        if not node_spec:
            raise LaunchError(f"{flag}: empty host in {spec!r} (format: host[:slot,slot]@host...)")
        name, has_slots, slot_text = node_spec.partition(":")
        slots: tuple[int, ...] | None = None
        if has_slots:
            try:
                slots = tuple(int(s) for s in slot_text.split(","))
            except ValueError:
                raise LaunchError(
                    f"{flag}: slots of {name!r} must be comma-separated integers, "
                    f"got {slot_text!r}"
                ) from None
        if name in result:  # the same host named twice: the union of what was named
            previous = result[name]
            slots = None if previous is None or slots is None else (*previous, *slots)
        result[name] = None if slots is None else tuple(sorted(set(slots)))
    return result


def filter_hosts(
    hosts: list[HostEntry], include: str | None = None, exclude: str | None = None
) -> list[HostEntry]:
    """Apply DeepSpeed's ``--include`` or ``--exclude`` to ``hosts`` (at most one of them).

    Hosts keep their file order; hosts left with no slots are dropped. Naming a host or slot that
    the hostfile does not have is an error, so a typo cannot silently run a smaller job.
    """
    if include and exclude:
        raise LaunchError("--include and --exclude cannot be used together")
    if not include and not exclude:
        return list(hosts)
    flag = "--include" if include else "--exclude"
    spec = _parse_filter(include or exclude or "", flag)
    by_name = {h.hostname: h for h in hosts}
    for name, slots in spec.items():
        if name not in by_name:
            raise LaunchError(f"{flag}: host {name!r} is not in the hostfile")
        bad = [s for s in slots or () if s not in by_name[name].slots]
        if bad:
            raise LaunchError(
                f"{flag}: host {name!r} has slots 0..{by_name[name].num_slots - 1}, "
                f"not {bad[0]}"
            )
    kept: list[HostEntry] = []
    for host in hosts:
        if include:
            if host.hostname not in spec:
                continue
            chosen = spec[host.hostname]
            slots = host.slots if chosen is None else chosen
        else:
            dropped = spec.get(host.hostname, ())
            slots = () if dropped is None else tuple(s for s in host.slots if s not in dropped)
        if slots:
            kept.append(HostEntry(host.hostname, tuple(slots), host.line_no))
    if not kept:
        raise LaunchError(f"{flag}: no hosts left after filtering")
    return kept


def uniform_slots(hosts: list[HostEntry], source: str = "<hostfile>") -> int:
    """The common slot count of ``hosts``; torchrun needs the same number of workers per node."""
    first = hosts[0]
    for host in hosts[1:]:
        if host.num_slots != first.num_slots:
            raise LaunchError(
                f"{source}:{host.line_no}: host {host.hostname!r} has {host.num_slots} slots but "
                f"{first.hostname!r} (line {first.line_no}) has {first.num_slots}; torchrun runs "
                "the same number of processes on every node"
            )
    return first.num_slots


def local_host_names() -> set[str]:
    """Names and addresses by which a hostfile may refer to this machine."""
    names = {"localhost", "127.0.0.1"}
    hostname = socket.gethostname()
    names.update({hostname, hostname.split(".", 1)[0]})
    try:
        fqdn = socket.getfqdn()
        names.update({fqdn, fqdn.split(".", 1)[0]})
        _, aliases, addresses = socket.gethostbyname_ex(hostname)
        names.update(aliases)
        names.update(addresses)
    except OSError:
        pass  # an unresolvable own name still leaves the plain hostname to match
    return {n for n in names if n}


def find_node_rank(
    hosts: list[HostEntry], local_names: Iterable[str], source: str = "<hostfile>"
) -> int:
    """Index of this machine in ``hosts``, matching any of ``local_names``."""
    names = set(local_names)
    matches = [i for i, h in enumerate(hosts) if h.hostname in names]
    if not matches:
        listed = ", ".join(h.hostname for h in hosts)
        raise LaunchError(
            f"--hostfile: this machine ({socket.gethostname()}) is not among the hosts of "
            f"{source} ({listed}); pass --node_rank explicitly"
        )
    if len(matches) > 1:
        raise LaunchError(
            f"--hostfile: this machine matches several hosts of {source} "
            f"({', '.join(hosts[i].hostname for i in matches)}); pass --node_rank explicitly"
        )
    return matches[0]
