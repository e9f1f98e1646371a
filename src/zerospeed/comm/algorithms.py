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
* ``emulate``: an all-reduce of the whole message (with the other ranks' ranges zeroed for an all-gather),
  2(k-1)/k on the wire, but gloo's all-reduce is the fastest primitive on loopback for large messages.

A group whose ranks span several hosts always takes the byte-optimal algorithms (the network is what is
short); a group on one host takes ``emulate`` above :data:`NATIVE_MAX_NUMEL` elements and the byte-optimal
ones below. ``ZEROSPEED_NATIVE_COLLECTIVES=1`` forces the byte-optimal ones, ``=0`` the size rule (default).
On other backends (NCCL) the backend's own reduce-scatter and all-gather are used.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from zerospeed.comm import health
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
    algorithm = algorithm or choose(group, input.numel())
    out = output.view(-1)
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


def start_all_gather(output: torch.Tensor, input: torch.Tensor, group: Any, algorithm: str | None = None) -> Started:
    """Concatenate every rank's ``input`` into ``output`` (``k * input.numel()`` elements) in group-rank order."""
    me = dist.get_rank(group)
    nbytes = output.numel() * output.element_size()
    algorithm = algorithm or choose(group, output.numel())
    flat, n = output.view(-1), input.numel()
    if algorithm == "emulate":
        start = me * n
        if flat.narrow(0, start, n).data_ptr() != input.data_ptr():
            flat.narrow(0, start, n).copy_(input.reshape(-1))
        flat.narrow(0, 0, start).zero_()
        flat.narrow(0, start + n, flat.numel() - start - n).zero_()
        work = _checked(dist.all_reduce(output, group=group, async_op=True), "all_gather")
        return Started(work, None, 2 * output.numel(), sent_bytes(group, "ring", nbytes, passes=2))
    # flat views: gloo's all_gather_into_tensor wants the output as k inputs concatenated on dim 0, and callers
    # pass it stacked ([k, *input.shape]) or flat
    work = _checked(_all_gather_single(flat, input.reshape(-1), group=group, async_op=True), "all_gather")
    return Started(work, None, output.numel(), sent_bytes(group, "ring", nbytes))


def start_all_reduce(tensor: torch.Tensor, op: Any, group: Any) -> Started:
    nbytes = tensor.numel() * tensor.element_size()
    work = _checked(dist.all_reduce(tensor, op=op, group=group, async_op=True), "all_reduce")
    return Started(work, None, 2 * tensor.numel(), sent_bytes(group, "ring", nbytes, passes=2))
