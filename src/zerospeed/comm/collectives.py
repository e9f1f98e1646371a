"""The only place zerospeed calls torch.distributed collectives.

Each wrapper records the call in :data:`zerospeed.comm.counter.COUNTER` and forwards to torch,
using the torch 2.13 names (``all_gather_single`` / ``reduce_scatter_single``) with a fallback to
the older ``*_into_tensor`` / ``*_tensor`` names. ``async_op=True`` returns a Work handle.
With a world of one, collectives are skipped (they would be identities) but still counted, so
tests and the comms logger see the same call pattern at any world size.

Algorithm choice: a group whose ranks span hosts evenly runs reduce-scatter, all-gather and all-reduce in two
levels (:mod:`zerospeed.comm.hierarchical`: inside the host, across hosts on 1/local_size of the data, inside
the host), so each host's link carries the ZeRO formula's bytes; otherwise one flat algorithm per backend and
size (:mod:`zerospeed.comm.algorithms`: on gloo, an all-to-all reduce-scatter with an ordered sum and the
native all-gather for small messages and across hosts; for large single-host ones a reduce-scatter in
point-to-point rounds with the same ordered sum and an all-gather by one broadcast per rank, which take the
least CPU time on loopback). The counter records the logical collective (what ZeRO's accounting is
about), the elements the chosen algorithm put on the wire, and the bytes this rank sent inside its host and
across hosts (:mod:`zerospeed.comm.links`). ``ZEROSPEED_NATIVE_COLLECTIVES=1`` forces the byte-optimal flat
algorithms; ``ZEROSPEED_HIERARCHICAL=0`` keeps every collective flat. On one host, gloo's reduce-scatter,
all-gather and equal-split all-to-all go through shared memory (:mod:`zerospeed.comm.shm`;
``ZEROSPEED_SHM_COLLECTIVES=0`` turns it off), counted as the pairwise algorithm they replace.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zerospeed.comm import algorithms, health, hierarchical, shm
from zerospeed.comm.counter import COUNTER
from zerospeed.comm.links import sent_bytes

ReduceOp = dist.ReduceOp


class _DoneWork:
    """Stand-in for a completed Work handle (world of one)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _issue(op: str, start: Any, async_op: bool) -> Any:
    """Start a collective (``start(async_op)``) so that a peer that stopped participating is named
    (:mod:`zerospeed.comm.health`): a checked call, or a checked Work handle."""
    work = health.CheckedWork(start(True), op)
    if async_op:
        return work
    work.wait()
    return None


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _finish(handle: Any, async_op: bool) -> Any:
    if async_op:
        return handle
    handle.wait()
    return None


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: dist.ProcessGroup | None = None,
               async_op: bool = False) -> Any:
    """Sum (or ``op``) ``tensor`` over the group, in place; two-level when the group spans hosts
    (:mod:`zerospeed.comm.hierarchical`)."""
    single = _world(group) == 1
    if single:
        COUNTER.record("all_reduce", tensor.numel(), tensor.element_size(), wire_numel=0)
        return _DoneWork() if async_op else None
    split = hierarchical.split_for(group, tensor.numel(), op) if tensor.is_contiguous() else None
    if split is not None:
        handle, wire, links = hierarchical.all_reduce(tensor, op, split)
        COUNTER.record("all_reduce", tensor.numel(), tensor.element_size(), wire_numel=wire, links=links)
        return _finish(handle, async_op)
    started = algorithms.start_all_reduce(tensor, op, group)
    COUNTER.record("all_reduce", tensor.numel(), tensor.element_size(), links=started.links)
    return _finish(started, async_op)


def reduce_scatter(output: torch.Tensor, input: Any, op: Any = ReduceOp.SUM,
                   group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Reduce ``input`` (numel = world * output.numel) over the group; rank r gets chunk r.

    ``input`` is scratch: its contents are unspecified afterwards (on gloo it may hold the full sum).
    ``input`` may also be a list of ``world`` tensors (torch's / DeepSpeed's list form; not clobbered).
    ``output`` may be this rank's own chunk of ``input`` (an in-place reduce-scatter).
    The algorithm (:mod:`zerospeed.comm.algorithms`, :mod:`zerospeed.comm.hierarchical`) depends on the
    backend, the size and whether the group spans hosts.
    """
    world = _world(group)
    if isinstance(input, (list, tuple)):
        return _reduce_scatter_list(output, list(input), op, group, async_op)
    if world == 1:
        COUNTER.record("reduce_scatter", input.numel(), input.element_size(), wire_numel=0)
        if output.data_ptr() != input.data_ptr():
            output.copy_(input.view_as(output))
        return _DoneWork() if async_op else None
    split = hierarchical.split_for(group, input.numel(), op)
    if split is not None:
        handle, wire, links = hierarchical.reduce_scatter(output, input, op, split)
        COUNTER.record("reduce_scatter", input.numel(), input.element_size(), wire_numel=wire, links=links)
        return _finish(handle, async_op)
    started = algorithms.start_reduce_scatter(output, input, op, group)
    COUNTER.record("reduce_scatter", input.numel(), input.element_size(), wire_numel=started.wire_numel,
                   links=started.links)
    return _finish(started, async_op)


def all_gather(output: Any, input: torch.Tensor, group: dist.ProcessGroup | None = None,
               async_op: bool = False) -> Any:
    """Concatenate every rank's ``input`` into ``output`` (numel = world * input.numel).

    ``output`` may also be a list of ``world`` tensors (torch's / DeepSpeed's list form).
    ``input`` may be this rank's own range of ``output``.
    """
    world = _world(group)
    if isinstance(output, (list, tuple)):
        return _all_gather_list(list(output), input, group, async_op)
    if world == 1:
        COUNTER.record("all_gather", output.numel(), output.element_size(), wire_numel=0)
        if output.data_ptr() != input.data_ptr():
            output.copy_(input.view_as(output))
        return _DoneWork() if async_op else None
    split = hierarchical.split_for(group, output.numel())
    if split is not None:
        handle, wire, links = hierarchical.all_gather(output, input, split)
        COUNTER.record("all_gather", output.numel(), output.element_size(), wire_numel=wire, links=links)
        return _finish(handle, async_op)
    started = algorithms.start_all_gather(output, input, group)
    COUNTER.record("all_gather", output.numel(), output.element_size(), wire_numel=started.wire_numel,
                   links=started.links)
    return _finish(started, async_op)


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any:
    COUNTER.record("broadcast", tensor.numel(), tensor.element_size())
    if _world(group) == 1:
        return _DoneWork() if async_op else None
    return _issue("broadcast", lambda a: dist.broadcast(tensor, src=src, group=group, async_op=a), async_op)


def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> None:
    COUNTER.record("send", tensor.numel(), tensor.element_size())
    health.CheckedWork(dist.isend(tensor, dst=dst, group=group), f"send to rank {dst}").wait()


def recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    COUNTER.record("recv", tensor.numel(), tensor.element_size())
    health.CheckedWork(dist.irecv(tensor, src=src, group=group), f"recv from rank {src}").wait()


def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> Any:
    COUNTER.record("send", tensor.numel(), tensor.element_size())
    return health.CheckedWork(dist.isend(tensor, dst=dst, group=group), f"send to rank {dst}")


def irecv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> Any:
    COUNTER.record("recv", tensor.numel(), tensor.element_size())
    return health.CheckedWork(dist.irecv(tensor, src=src, group=group), f"recv from rank {src}")


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if _world(group) > 1:
        health.CheckedWork(dist.barrier(group=group, async_op=True), "barrier").wait()


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Gather one picklable object per rank (for small control data: error reports, metadata)."""
    world = _world(group)
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    health.checked("all_gather_object", lambda: dist.all_gather_object(out, obj, group=group))
    return out


# -- DeepSpeed's names (``deepspeed.comm``) -------------------------------------------------------------
def _all_gather_list(outputs: list[torch.Tensor], input: torch.Tensor, group: dist.ProcessGroup | None,
                     async_op: bool) -> Any:
    world = _world(group)
    if len(outputs) != world:
        raise ValueError(f"all_gather: got {len(outputs)} output tensors for a group of {world} ranks")
    COUNTER.record("all_gather", input.numel() * world, input.element_size(), wire_numel=0 if world == 1 else None)
    if world == 1:
        outputs[0].copy_(input)
        return _DoneWork() if async_op else None
    return _issue("all_gather", lambda a: dist.all_gather(outputs, input, group=group, async_op=a), async_op)


def _reduce_scatter_list(output: torch.Tensor, inputs: list[torch.Tensor], op: Any,
                         group: dist.ProcessGroup | None, async_op: bool) -> Any:
    world = _world(group)
    if len(inputs) != world:
        raise ValueError(f"reduce_scatter: got {len(inputs)} input tensors for a group of {world} ranks")
    flat = torch.cat([t.reshape(-1) for t in inputs])  # scratch: the caller's list is left as it was
    return reduce_scatter(output, flat, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                           group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any:
    """DeepSpeed / torch name of :func:`all_gather` (concatenation along the first dimension)."""
    if output_tensor.numel() != input_tensor.numel() * _world(group):
        raise ValueError(f"all_gather_into_tensor: output has {output_tensor.numel()} elements, expected "
                         f"{input_tensor.numel()} x {_world(group)} ranks")
    return all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any:
    """DeepSpeed / torch name of :func:`reduce_scatter`; unlike zerospeed's internal form, the
    caller's ``input_tensor`` is left unchanged (torch's contract)."""
    if input_tensor.numel() != output_tensor.numel() * _world(group):
        raise ValueError(f"reduce_scatter_tensor: input has {input_tensor.numel()} elements, expected "
                         f"{output_tensor.numel()} x {_world(group)} ranks")
    return reduce_scatter(output_tensor, input_tensor.clone(), op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: dist.ProcessGroup | None = None,
                      async_op: bool = False) -> Any:
    """Scatter ``input``'s chunks to every rank and gather theirs into ``output`` (torch's semantics)."""
    single = _world(group) == 1
    even = output_split_sizes is None and input_split_sizes is None
    links = sent_bytes(group, "pairwise", input.numel() * input.element_size()) if even and not single else (0, 0)
    COUNTER.record("all_to_all", input.numel(), input.element_size(), wire_numel=0 if single else None, links=links)
    if single:
        output.copy_(input)
        return _DoneWork() if async_op else None
    if even and _shm_all_to_all(output, input, group):
        return _DoneWork() if async_op else None
    return _issue("all_to_all", lambda a: dist.all_to_all_single(
        output, input, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes, group=group,
        async_op=a), async_op)


def _shm_all_to_all(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """An equal-split all-to-all through shared memory on one host (:mod:`zerospeed.comm.shm`); False: not
    eligible or the group's set-up failed (TCP then)."""
    k = _world(group)
    if input.numel() % k or output.numel() != input.numel() or output.dtype != input.dtype \
            or not shm.enabled(group, input, input.numel() * input.element_size()):
        return False  # TCP, which raises its own error for a bad shape
    n = input.numel() // k
    rows = output.view(k, n) if output.is_contiguous() else torch.empty(k, n, dtype=output.dtype)
    src = input.reshape(k, n)
    apart = not algorithms._overlap(rows, src)
    done = shm.run("all_to_all", group, src, k, None, lambda j, a, b, data: rows[j, a:b].copy_(data),
                   own_from_src=apart)
    if done and not output.is_contiguous():
        output.copy_(rows.view(output.shape))
    return done


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: dist.ProcessGroup | None = None,
           async_op: bool = False) -> Any:
    """Reduce ``tensor`` onto global rank ``dst``."""
    single = _world(group) == 1
    COUNTER.record("reduce", tensor.numel(), tensor.element_size(), wire_numel=0 if single else None)
    if single:
        return _DoneWork() if async_op else None
    return _issue("reduce", lambda a: dist.reduce(tensor, dst=dst, op=op, group=group, async_op=a), async_op)


def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: dist.ProcessGroup | None = None,
                         async_op: bool = False) -> Any:
    """DeepSpeed's name for the all-reduce used by tensor-parallel inference (same collective)."""
    return all_reduce(tensor, op=op, group=group, async_op=async_op)
