"""Flat algorithms for one reduce-scatter / all-gather / all-reduce over one group, chosen per backend and size.

Each ``start_*`` function starts the collective asynchronously and returns a :class:`Started`: a Work-like
handle (``wait()`` runs the completion step once: a slice copy, an ordered sum), the elements the algorithm
puts on the wire per rank (up to the (N-1)/N factor, as :mod:`zerospeed.comm.counter` counts them) and the
``(intra_host, inter_host)`` bytes this rank sends (:mod:`zerospeed.comm.links`). Nothing here counts: the
public wrappers in :mod:`zerospeed.comm.collectives` record one logical collective each.

Choice on gloo (measured on loopback, 2 and 4 ranks, ``bench/results/gloo_collectives-hierarchical*``):

* ``pairwise`` reduce-scatter: one all-to-all, then this rank sums the ``k`` received chunks *in group-rank
  order* (``((c0 + c1) + c2) + ...``, one IEEE add per element per step, so the result is the same on every
  CPU and a single-process simulation reproduces it bit for bit). It sends ``(k-1)/k`` of the message, the
  bandwidth optimum; gloo's own reduce-scatter was 1.5-2x slower than this at every size measured.
* ``native`` all-gather (gloo's ring): ``(k-1)/k`` of the message.
* ``emulate`` (large single-host messages; the name is historical: until 11-28 both were all-reduces of the
  whole message, 2(k-1)/k on the wire, which gloo runs faster than its own reduce-scatter and all-gather):

  - reduce-scatter in *rounds*: every rank sends chunk ``j`` to rank ``j`` (point-to-point, all started at once)
    and receives the other ranks' chunks one at a time, in group-rank order, into one chunk-sized scratch, adding
    each into its output as it comes: the pairwise algorithm's ordered sum (the same bits), ``(k-1)/k`` on the
    wire, and a scratch of ``1/k`` of the message instead of the whole message (whose fresh pages cost more
    CPU than the transfer). Measured by each rank's CPU time (4 ranks, 24M elements): 32 ms against the
    all-reduce's 55 and the all-to-all's 66 (wall 106 / 156 / 200 ms); 2M: 3.3 / 5.6 / 5.0 ms;
  - all-gather by ``k`` broadcasts, each rank's range from its owner ((k-1)/k on the wire per rank): 19 ms
    against the all-reduce's 54 and gloo's ring all-gather's 62 (wall 116 / 171 / 281 ms); 8M: 8 / 18 / 17 ms.

  These replace the all-reduces because the step time that matters on a CPU host shared by several ranks is
  their CPU time (``bench/sp_bench.py`` measures it; the all-reduce's ring overlaps better only on idle cores).

A group whose ranks span several hosts always takes the byte-optimal algorithms (the network is what is
short); a group on one host takes ``emulate`` above :data:`NATIVE_MAX_NUMEL` elements and the byte-optimal
ones below. ``ZEROSPEED_NATIVE_COLLECTIVES=1`` forces the byte-optimal ones, ``=0`` the size rule (default).
On other backends (NCCL) the backend's own reduce-scatter and all-gather are used.

Before any of these, a single-host gloo group takes shared memory (:mod:`zerospeed.comm.shm`: the same ordered sum,
so the same bits, at 0.3-0.7x the CPU time of the TCP algorithms) when its set-up succeeded and the message is at
least :data:`zerospeed.comm.shm.MIN_BYTES` (the hierarchical intra-host legs too); an explicit ``algorithm`` (the
inter-host legs) keeps TCP.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from zerospeed.comm import health, shm
from zerospeed.comm.links import group_hosts, sent_bytes

__all__ = ["NATIVE_MAX_NUMEL", "Started", "choose", "start_all_gather", "start_all_reduce", "start_reduce_scatter"]

#: Largest message (elements) for which a single-host gloo group uses the byte-optimal algorithms; above it the
#: all-reduce emulation was faster on loopback (4 ranks, 4M-element chunks: all-reduce 122 ms, all-to-all 157 ms).
NATIVE_MAX_NUMEL = 1 << 20

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_ORDERED_OPS = {dist.ReduceOp.SUM: torch.Tensor.add_, dist.ReduceOp.PRODUCT: torch.Tensor.mul_}


class Started:
    """A started collective: ``wait()`` waits for the transfer, then runs ``then`` once."""

    def __init__(self, work: Any, then: Callable[[], None] | None, wire_numel: int, links: tuple[int, int]) -> None:
        self._work, self._then, self._done = work, then, False
        self.wire_numel, self.links = wire_numel, links

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            if self._work is not None:
                self._work.wait() if timeout is None else self._work.wait(timeout)
            if self._then is not None:
                self._then()
            self._done = True
        return True

    def is_completed(self) -> bool:
        """The transfer is done (the completion step then runs in ``wait()``)."""
        return self._done or self._work is None or bool(self._work.is_completed())


class _Works:
    """Several Work handles as one (waited in the order they were started)."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self, timeout: Any = None) -> bool:
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(bool(work.is_completed()) for work in self._works)


#: calls of the reduce-scatter in rounds per process group: their point-to-point tags. Counted per group, since
#: the members of a group make the same calls on it in the same order (not so across groups: expert groups)
_ROUNDS_CALLS: dict[tuple[int, int], int] = {}


class _Rounds(Started):
    """A reduce-scatter in rounds (see the module docstring): the sends start at once, the receives run in
    group-rank order, each into the same scratch and then combined into ``out``. ``wait()`` runs the remaining
    receives. gloo's point-to-point Work reports completion only once waited for, so ``is_completed()`` waits
    too (a poller then returns at once instead of polling forever)."""

    def __init__(self, out: torch.Tensor, flat: torch.Tensor, combine: Callable, group: Any, k: int, me: int) -> None:
        n = out.numel()
        self.out, self.chunks, self.combine, self.group, self.k, self.me = out, flat.view(k, n), combine, group, k, me
        self.own = self.chunks[me]
        if me > 0 and self.own.data_ptr() == out.data_ptr():  # in place: keep this rank's addend
            self.own = self.own.clone()
        self.scratch = torch.empty_like(out)
        key = (id(dist.group.WORLD), id(group if group is not None else dist.group.WORLD))
        calls = _ROUNDS_CALLS[key] = _ROUNDS_CALLS.get(key, -1) + 1
        self.tag = (1 << 24) + calls % (1 << 20)
        self.src, self.recv, self.sends = 0, None, []

    def start(self, nbytes: int) -> "_Rounds":
        self.sends = [_checked(dist.isend(self.chunks[j], group=self.group, group_dst=j, tag=self.tag),
                               "reduce_scatter") for j in range(self.k) if j != self.me]
        self._post()
        super().__init__(None, None, self.out.numel() * self.k, sent_bytes(self.group, "pairwise", nbytes))
        return self

    def _post(self) -> None:
        """Combine what needs no receive (this rank's chunk), then post the receive of the next source."""
        while self.src < self.k and self.src == self.me:
            self._add(self.own)
        if self.src < self.k and self.recv is None:
            self.recv = _checked(dist.irecv(self.scratch, group=self.group, group_src=self.src, tag=self.tag),
                                 "reduce_scatter")

    def _add(self, part: torch.Tensor) -> None:
        if self.src == 0:
            self.out.copy_(part)
        else:
            self.combine(self.out, part)
        self.src += 1

    def wait(self, timeout: Any = None) -> bool:
        while not self._done and self.src < self.k:
            self.recv.wait()
            self.recv = None
            self._add(self.scratch)
            self._post()
        for work in self.sends:
            work.wait()
        self.sends, self.scratch, self.own = [], None, None
        self._done = True
        return True

    def is_completed(self) -> bool:
        return self.wait()


def _combine(op: Any) -> Callable[[torch.Tensor, torch.Tensor], Any] | None:
    if op in _ORDERED_OPS:
        return _ORDERED_OPS[op]
    if op == dist.ReduceOp.MAX:
        return lambda acc, x: torch.maximum(acc, x, out=acc)
    if op == dist.ReduceOp.MIN:
        return lambda acc, x: torch.minimum(acc, x, out=acc)
    return None


def spans_hosts(group: Any) -> bool:
    _, hosts = group_hosts(group)
    return len(set(hosts)) > 1


def choose(group: Any, numel: int) -> str:
    """``"native"`` (the byte-optimal algorithms) or ``"emulate"`` (an all-reduce) for a gloo group."""
    if dist.get_backend(group) != "gloo":
        return "native"
    forced = os.environ.get("ZEROSPEED_NATIVE_COLLECTIVES", "")
    if forced == "1" or spans_hosts(group):
        return "native"
    return "native" if numel <= NATIVE_MAX_NUMEL else "emulate"


def _checked(work: Any, what: str) -> Any:
    return health.CheckedWork(work, what)


def start_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Any, group: Any,
                         algorithm: str | None = None) -> Started:
    """Reduce ``input`` (``k * output.numel()`` elements, scratch) over ``group``; this rank gets its chunk."""
    k, me = dist.get_world_size(group), dist.get_rank(group)
    n = output.numel()
    nbytes = input.numel() * input.element_size()
    out = output.view(-1)
    if algorithm is None and k > 1 and _combine(op) is not None and input.numel() == k * n \
            and input.dtype == out.dtype and shm.enabled(group, input, nbytes):  # else TCP (its errors too)
        started = _shm_reduce_scatter(out, input, _combine(op), group, k)
        if started is not None:
            return started
    algorithm = algorithm or choose(group, input.numel())
    if algorithm == "emulate" and _combine(op) is not None and k > 1:
        return _Rounds(out, input.reshape(-1), _combine(op), group, k, me).start(nbytes)
    if algorithm == "emulate" or (algorithm == "native" and dist.get_backend(group) == "gloo" and _combine(op) is None):
        mine = input.reshape(-1).narrow(0, me * n, n)
        work = _checked(dist.all_reduce(input, op=op, group=group, async_op=True), "reduce_scatter")
        then = None if mine.data_ptr() == out.data_ptr() else (lambda: out.copy_(mine))
        return Started(work, then, 2 * input.numel(), sent_bytes(group, "ring", nbytes, passes=2))
    if dist.get_backend(group) != "gloo":
        start, end = input.data_ptr(), input.data_ptr() + nbytes
        temp = torch.empty_like(out) if start <= out.data_ptr() < end else out
        work = _checked(_reduce_scatter_single(temp, input, op=op, group=group, async_op=True), "reduce_scatter")
        then = None if temp is out else (lambda: out.copy_(temp))
        return Started(work, then, input.numel(), sent_bytes(group, "ring", nbytes))
    combine = _combine(op)
    received = torch.empty(input.numel(), dtype=input.dtype, device=input.device)
    work = _checked(dist.all_to_all_single(received, input.reshape(-1), group=group, async_op=True), "reduce_scatter")

    def ordered_sum() -> None:
        parts = received.view(k, n)
        out.copy_(parts[0])
        for i in range(1, k):
            combine(out, parts[i])

    return Started(work, ordered_sum, input.numel(), sent_bytes(group, "pairwise", nbytes))


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _shm_reduce_scatter(out: torch.Tensor, input: torch.Tensor, combine: Callable, group: Any,
                        k: int) -> Started | None:
    """The reduce-scatter through shared memory (:mod:`zerospeed.comm.shm`): the pairwise algorithm's ordered
    sum over the peers' chunks, read in place; None if the group's set-up failed (then TCP)."""
    n = out.numel()

    def place(j: int, a: int, b: int, data: torch.Tensor) -> None:
        out[a:b].copy_(data) if j == 0 else combine(out[a:b], data)

    src = input.reshape(k, n)
    apart = not _overlap(out, src)  # out written while src is still read: own chunk through shm then
    if not shm.run("reduce_scatter", group, src, k, None, place, own_from_src=apart):
        return None
    return Started(None, None, input.numel(), sent_bytes(group, "pairwise", input.numel() * input.element_size()))


def start_all_gather(output: torch.Tensor, input: torch.Tensor, group: Any, algorithm: str | None = None) -> Started:
    """Concatenate every rank's ``input`` into ``output`` (``k * input.numel()`` elements) in group-rank order."""
    me = dist.get_rank(group)
    nbytes = output.numel() * output.element_size()
    flat, n = output.view(-1), input.numel()
    if algorithm is None and flat.numel() == dist.get_world_size(group) * n > n and input.dtype == flat.dtype \
            and shm.enabled(group, input, nbytes):
        rows = flat.view(-1, n)

        def place(j: int, a: int, b: int, data: torch.Tensor) -> None:
            if j != me or rows[me].data_ptr() != input.data_ptr():  # this rank's range may already be its input
                rows[j, a:b].copy_(data)

        if shm.run("all_gather", group, input.reshape(1, n), 1, 0, place):
            return Started(None, None, output.numel(), sent_bytes(group, "pairwise", nbytes))
    algorithm = algorithm or choose(group, output.numel())
    if algorithm == "emulate":  # k broadcasts, rank i's range from rank i (gloo runs them on its worker threads)
        mine = flat.narrow(0, me * n, n)
        if mine.data_ptr() != input.data_ptr():
            mine.copy_(input.reshape(-1))
        works = [_checked(dist.broadcast(flat.narrow(0, i * n, n), group=group, group_src=i, async_op=True),
                          "all_gather") for i in range(dist.get_world_size(group))]
        return Started(_Works(works), None, output.numel(), sent_bytes(group, "pairwise", nbytes))
    # flat views: gloo's all_gather_into_tensor wants the output as k inputs concatenated on dim 0, and callers
    # pass it stacked ([k, *input.shape]) or flat
    work = _checked(_all_gather_single(flat, input.reshape(-1), group=group, async_op=True), "all_gather")
    return Started(work, None, output.numel(), sent_bytes(group, "ring", nbytes))


def start_all_reduce(tensor: torch.Tensor, op: Any, group: Any) -> Started:
    nbytes = tensor.numel() * tensor.element_size()
    work = _checked(dist.all_reduce(tensor, op=op, group=group, async_op=True), "all_reduce")
    return Started(work, None, 2 * tensor.numel(), sent_bytes(group, "ring", nbytes, passes=2))
