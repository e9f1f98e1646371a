"""Single-host gloo collectives through shared memory: reduce-scatter, all-gather and the equal-split all-to-all.

On one host, gloo moves every byte through loopback TCP: two kernel copies and the TCP stack per byte, on gloo's
loop thread and in the kernel. Here each rank of a group maps one file per rank in ``/dev/shm``; a collective is
one copy of this rank's data into its own segment, one gloo barrier on the group, and reads of the peers'
segments straight into the result (a copy, or the ordered sum).

Set-up (lazily, per process group, collectively; :func:`_setup`): group rank 0 draws a random token and
broadcasts it; each rank creates ``zerospeed-<token>-<global rank>`` (``O_CREAT|O_EXCL``, mode 0600),
``posix_fallocate``\\ s it (a too-small ``/dev/shm``, Docker's 64 MB default, gives ENOSPC here instead of a
SIGBUS later), maps it and writes a header (token, rank); barrier; each rank maps every peer's file and checks
its header (a peer in another mount namespace gives ENOENT or a wrong header); every rank's ok flag is
all-gathered, so all ranks decide the same; barrier; each rank unlinks its own file (the mappings live on; a
crash leaves nothing in ``/dev/shm``, and there is nothing to clean at exit). If any rank failed, every rank warns
once with the reason (path, errno, free space) and the group keeps using TCP: no silent fallback, no crash.

One op (:func:`run`, under a per-group lock): each segment holds two halves; op ``n`` writes half ``n % 2``,
then one synchronisation (:func:`_sync`), then reads the peers' half ``n % 2``. One suffices: a rank starts op ``n``
only after passing op ``n-1``'s, which each peer reached only after finishing op ``n-2``'s reads, the last use of
that half (ops are synchronous and issued in the same order on a group). The reduce-scatter sums
``peer0[me] + peer1[me] + ...`` in group-rank order, the same ordered sum as the TCP pairwise and rounds
algorithms (:mod:`zerospeed.comm.algorithms`), so the bits are identical. A segment grows collectively to the
largest message seen (every rank sees the same sizes), up to :data:`MAX_HALF_BYTES` per half
(``ZEROSPEED_SHM_MAX_BYTES``); a larger message goes through in pieces, one synchronisation each. A failed growth keeps
the old segment (pieces) after one warning.

Used when all hold: backend gloo, every rank of the group on one host (:func:`zerospeed.comm.links.group_hosts`),
CPU tensors, the message at least :data:`MIN_BYTES`, the group's set-up succeeded. ``ZEROSPEED_SHM_COLLECTIVES=0``
turns it off, ``=1`` uses it at every size, unset: the size rule. ``ZEROSPEED_SHM_DIR`` names another directory
(tests point it at a missing one to exercise the fallback). Counting is unchanged: the callers give the
:class:`~zerospeed.comm.algorithms.Started` the elements and intra-host bytes of the pairwise algorithm.

Measured (``bench/shm_bench.py``, 4 ranks on this 2-core host, fp32, per-rank CPU time of one op over all threads,
kernel included; ``bench/results/shm_collectives-20261128-094513.md``, load 1.9-2.3, the code as it is):
reduce-scatter of 4.6M elements (sp_bench's ZeRO-2 bucket) 7.2 ms over TCP -> 3.7 ms (3 pieces), all-gather of 4.6M
5.1 -> 2.4 ms, all-to-all of 1 MB 0.63 -> 0.38 ms; from 1 KB to 256 KB 0.24-0.66x the TCP CPU time, except one
reduce-scatter row at 256 KB, 1.24x, which the earlier run (``..._093204.md``) had at 0.45x: noise at 0.3-0.4 ms.
Hence :data:`MIN_BYTES` of 1 KiB: below that nothing was measured and a message is latency-bound either way. The
per-op synchronisation is an all-reduce of one int, not gloo's barrier: 0.12 ms of CPU and 0.35 ms wall per call
against the barrier's 0.24-0.69 ms and 2.0-2.1 ms (the ``barrier`` and ``all_reduce_1int`` rows). A reduce-scatter
or all-to-all whose output does not overlap its input skips copying this rank's own chunk (no peer reads it).

Pieces and the cap: in 4 MiB halves (``..._093357.md``, under load 3) the 4.6M reduce-scatter took 0.65x and the
all-gather 0.45x TCP's CPU, so a message above the cap goes in pieces rather than back to TCP. The cap is 8 MiB per
half because the segment is memory: ``posix_fallocate`` charges each rank 2 halves of ``/dev/shm`` per group (16 MiB
at most), and a rank's RSS also counts the peers' pages it reads (shared pages count in every process that maps
them; PSS counts them once): sp_worker's SP 4 peak RSS per rank was 780-790 MB with TCP, 815-823 MB at the 8 MiB
cap, 825-840 MB at 64 MiB. At 8 MiB the 4.6M reduce-scatter goes in 3 pieces for 0.53x TCP's CPU against 0.45x in
one (``..._094313.md`` vs ``..._093713.md``: 3.4 vs 3.1 ms).

SP 4 step of ``bench/sp_worker.py`` (hidden 128, 1024 tokens per rank, ZeRO-2; ``bench/shm_bench.py --sp-pairs 3``,
``shm_sp_step-20261128-094726.md``, load 1.6-3.3, alternating): gloo's TCP loop thread 17-20 ms -> 5-6.5 ms per rank
per step, the main thread doing part of that work as copies; per-rank step CPU 0.443 / 0.451 / 0.438 -> 0.428 /
0.431 / 0.428 s (-11 to -20 ms, 2-4.5%); losses bit-identical; SP 1 unchanged (0.352 / 0.349 s).
"""

from __future__ import annotations

import errno as errno_mod
import mmap
import os
import secrets
import threading
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from zerospeed.comm import health
from zerospeed.comm.links import group_hosts

__all__ = ["CALLS", "MAX_HALF_BYTES", "MIN_BYTES", "enabled", "run"]

#: Smallest message (bytes, the whole logical message) sent through shared memory under the size rule.
MIN_BYTES = 1 << 10
#: Largest half of a segment (bytes); larger messages go in pieces. ``ZEROSPEED_SHM_MAX_BYTES`` overrides.
MAX_HALF_BYTES = 8 << 20
_MIN_HALF_BYTES = 1 << 20
_HEADER = 64
_MAGIC = 0x7A73686D  # "zshm"

#: shared-memory collectives run in this process, by kind (tests read it to see which path ran)
CALLS: dict[str, int] = {"reduce_scatter": 0, "all_gather": 0, "all_to_all": 0}

_GROUPS: dict[Any, "_Group"] = {}
_WORLD: list[Any] = [None]
_LOCK = threading.Lock()
_WARNED: set[str] = set()


def _max_half() -> int:
    raw = os.environ.get("ZEROSPEED_SHM_MAX_BYTES", "")
    try:
        value = int(raw) if raw else MAX_HALF_BYTES
    except ValueError:
        raise ValueError(f"ZEROSPEED_SHM_MAX_BYTES: {raw!r} is not a whole number of bytes") from None
    if value < 4096:
        raise ValueError(f"ZEROSPEED_SHM_MAX_BYTES: {value} is below the 4096-byte minimum")
    return value // 4096 * 4096


def _mode() -> str:
    raw = os.environ.get("ZEROSPEED_SHM_COLLECTIVES", "")
    if raw not in ("", "0", "1"):
        raise ValueError(f"ZEROSPEED_SHM_COLLECTIVES: {raw!r} is not '0' (off), '1' (every size) or unset")
    return raw


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


class _Group:
    """One group's mapped segments (own and peers', by group rank), its op counter and lock."""

    def __init__(self, group: Any) -> None:
        self.group, self.lock = group, threading.Lock()
        self.ranks = group_hosts(group)[0]
        self.k, self.me = len(self.ranks), dist.get_rank(group)
        self.half, self.segments, self.ops, self.ok, self.grow = 0, [], 0, None, True
        self.paths: list[str] = []  # the last set-up's files (unlinked once mapped; tests check)
        self.flag = torch.zeros(1, dtype=torch.int32)  # the per-op synchronisation (see _sync)

    def halves(self, n_bytes: int) -> None:
        """Make each half hold ``n_bytes`` (collective; every rank asks the same), within the cap."""
        if self.ok is False or (self.ok and (n_bytes <= self.half or not self.grow)):
            return
        cap = _max_half()
        size = min(cap, max(_MIN_HALF_BYTES, 1 << max(0, n_bytes - 1).bit_length()))
        if self.ok and size <= self.half:
            return
        segments, reason = _setup(self, size)
        if segments is not None:
            self.segments, self.half, self.ok, self.ops = segments, size, True, 0
            self.grow = size < cap
        elif self.ok:  # growth failed on some rank: keep the segment and send in pieces
            self.grow = False
            _warn_once(f"grow{reason}", f"zerospeed: could not grow the shared-memory collectives' buffer of group "
                       f"{list(self.ranks)} to {size} bytes ({reason}); larger messages go in pieces")
        else:
            self.ok = False
            _warn_once("setup", f"zerospeed: shared-memory collectives are off for group {list(self.ranks)}, which "
                       f"uses gloo's TCP instead: {reason}. Set ZEROSPEED_SHM_COLLECTIVES=0 to silence this")


def _free_bytes(directory: str) -> str:
    try:
        st = os.statvfs(directory)
        return f"{st.f_bavail * st.f_frsize} bytes free in {directory}"
    except OSError as e:
        return f"{directory} unreadable: {e.strerror}"


def _barrier(group: Any, what: str) -> None:
    health.CheckedWork(dist.barrier(group=group, async_op=True), what).wait()


def _sync(g: _Group, what: str) -> None:
    """Every rank of the group has written its half: an all-reduce of one int, which no rank completes before
    every rank has entered it; at 4 ranks it costs a fraction of gloo's barrier (``bench/shm_bench.py``'s
    ``barrier`` and ``all_reduce_1int`` rows; see the module docstring)."""
    health.CheckedWork(dist.all_reduce(g.flag, group=g.group, async_op=True), what).wait()


def _map(path: str, size: int, create: bool) -> tuple[mmap.mmap, torch.Tensor]:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR if create else os.O_RDWR, 0o600)
    try:
        if create:
            os.posix_fallocate(fd, 0, size)
        elif os.fstat(fd).st_size < size:
            raise OSError(errno_mod.EINVAL, f"{path} holds {os.fstat(fd).st_size} bytes, expected {size}")
        mem = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return mem, torch.frombuffer(mem, dtype=torch.uint8)


def _setup(g: _Group, half: int) -> tuple[list[torch.Tensor] | None, str]:
    """Create, exchange and check the group's segments (see the module docstring). Every rank returns the same
    outcome: the segments by group rank, or None and the reasons."""
    directory = os.environ.get("ZEROSPEED_SHM_DIR", "/dev/shm")
    token = torch.tensor([secrets.randbits(62) if g.me == 0 else 0], dtype=torch.int64)
    health.CheckedWork(dist.broadcast(token, group=g.group, group_src=0, async_op=True), "shm set-up").wait()
    tok = int(token.item())
    size = _HEADER + 2 * half
    paths = [os.path.join(directory, f"zerospeed-{tok:016x}-{r}") for r in g.ranks]
    mine, reason, segments = paths[g.me], "", [None] * g.k
    g.paths = paths
    created = False
    try:
        try:
            _, seg = _map(mine, size, create=True)  # the tensor keeps the mapping alive
            created = True
            seg[:_HEADER].view(torch.int64)[:3] = torch.tensor([_MAGIC, tok, g.ranks[g.me]])
            segments[g.me] = seg
        except OSError as e:
            reason = f"rank {g.ranks[g.me]} could not create {mine} ({size} bytes): {e.strerror or e} " \
                     f"(errno {e.errno}; {_free_bytes(directory)})"
        _barrier(g.group, "shm set-up")
        for j, path in enumerate(paths):
            if reason or j == g.me:
                continue
            try:
                _, seg = _map(path, size, create=False)
            except OSError as e:
                reason = f"rank {g.ranks[g.me]} could not open rank {g.ranks[j]}'s {path}: {e.strerror or e} " \
                         f"(errno {e.errno}; a peer in another container or mount namespace?)"
                break
            head = seg[:_HEADER].view(torch.int64)[:3].tolist()
            if head != [_MAGIC, tok, g.ranks[j]]:
                reason = f"rank {g.ranks[g.me]} found a wrong header in {path}: " \
                         f"another /dev/shm than rank {g.ranks[j]}'s"
                break
            segments[j] = seg
        flags = torch.zeros(g.k, dtype=torch.int32)
        flags[g.me] = 0 if reason else 1
        health.CheckedWork(dist.all_reduce(flags, group=g.group, async_op=True), "shm set-up").wait()
        _barrier(g.group, "shm set-up")
    finally:
        if created:
            try:
                os.unlink(mine)
            except OSError:
                pass
    failed = [g.ranks[j] for j in range(g.k) if int(flags[j]) == 0]
    if failed:
        return None, reason or f"rank(s) {failed} could not set up (their warnings give the reason)"
    return [s[_HEADER:] for s in segments], ""


def _state(group: Any) -> _Group:
    with _LOCK:
        if dist.group.WORLD is not _WORLD[0]:  # a new world: drop the old groups' mappings
            _GROUPS.clear()
            _WORLD[0] = dist.group.WORLD
        key = id(group if group is not None else dist.group.WORLD)
        g = _GROUPS.get(key)
        if g is None:
            g = _GROUPS[key] = _Group(group)
        return g


def enabled(group: Any, tensor: torch.Tensor, message_bytes: int) -> bool:
    """Whether a collective of ``message_bytes`` over ``group`` goes through shared memory (same answer on every
    rank of the group: backend, hosts, device and sizes are the same there)."""
    mode = _mode()
    if mode == "0" or tensor.device.type != "cpu" or dist.get_backend(group) != "gloo":
        return False
    if mode == "" and message_bytes < MIN_BYTES:
        return False
    _, hosts = group_hosts(group)
    if len(hosts) < 2 or len(set(hosts)) > 1:
        return False
    return _state(group).ok is not False


def run(kind: str, group: Any, src: torch.Tensor, rows: int, read_row: int | None,
        place: Callable[[int, int, int, torch.Tensor], None], own_from_src: bool = False) -> bool:
    """One shared-memory collective over ``group``.

    ``src`` is this rank's data as ``[rows, m]`` (``rows`` is the group size, or 1 for an all-gather); every
    rank writes ``src[:, a:b]`` into its own half; after the synchronisation ``place(j, a, b, data)`` is called
    for each group rank ``j`` in order with peer ``j``'s row ``read_row`` (None: this rank's group rank) of that
    piece. ``own_from_src`` (``read_row`` None only; the caller's ``place`` must not write into ``src``): this
    rank's own row is read by no peer, so it is not copied and ``place`` gets it from ``src``.
    Returns False (nothing done) when the group's set-up failed: the caller then takes TCP.
    """
    g = _state(group)
    with g.lock:
        m, esize = src.shape[1], src.element_size()
        g.halves(rows * m * esize)
        if not g.ok:
            return False
        CALLS[kind] += 1
        row = g.me if read_row is None else read_row
        skip = own_from_src and read_row is None
        width = m if rows * m * esize <= g.half else g.half // (rows * esize)
        width = width // 16 * 16 if m > width >= 16 else width  # pieces of whole cache lines
        for a in range(0, max(m, 1), width):
            b = min(m, a + width)
            w, off = b - a, (g.ops % 2) * g.half
            g.ops += 1
            mine = g.segments[g.me][off:off + rows * w * esize].view(src.dtype).view(rows, w)
            if skip:
                mine[:row].copy_(src[:row, a:b])
                mine[row + 1:].copy_(src[row + 1:, a:b])
            else:
                mine.copy_(src[:, a:b])
            _sync(g, kind)
            for j in range(g.k):
                if skip and j == g.me:
                    place(j, a, b, src[row, a:b])
                else:
                    place(j, a, b, g.segments[j][off + row * w * esize:off + (row + 1) * w * esize].view(src.dtype))
        return True
