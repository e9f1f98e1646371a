"""The only place zerospeed calls torch.distributed collectives.

Each wrapper records the call in :data:`zerospeed.comm.counter.COUNTER` and forwards to torch,
using the torch 2.13 names (``all_gather_single`` / ``reduce_scatter_single``) with a fallback to
the older ``*_into_tensor`` / ``*_tensor`` names. ``async_op=True`` returns a Work handle.
With a world of one, collectives are skipped (they would be identities) but still counted, so
tests and the comms logger see the same call pattern at any world size.

Algorithm choice per backend (measured, see bench/results/gloo_collectives*): gloo's
reduce-scatter and all-gather are 2-3x slower than its all-reduce of the *full* tensor on CPU
(14M fp32, 2 ranks: reduce-scatter 224 ms, all-gather 224 ms, all-reduce 76 ms). On gloo, a
reduce-scatter is therefore carried out as an in-place all-reduce of the input plus a slice copy
(the input is clobbered: callers pass scratch), and an all-gather as an all-reduce of the output
with every other rank's range zeroed. The counter records the logical collective (what ZeRO's
accounting is about) and, separately, the elements the chosen algorithm put on the wire.
``ZEROSPEED_NATIVE_COLLECTIVES=1`` turns this off (for benchmarks of the native path).
"""

from __future__ import annotations

from typing import Any

import os

import torch
import torch.distributed as dist

from zerospeed.comm import health
from zerospeed.comm.counter import COUNTER

ReduceOp = dist.ReduceOp

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _DoneWork:
    """Stand-in for a completed Work handle (world of one)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _ThenWork:
    """A Work handle that runs a completion step (a slice copy) once, after the wait."""

    def __init__(self, work: Any, then: Any) -> None:
        self._work, self._then, self._done = work, then, False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            self._work.wait() if timeout is None else self._work.wait(timeout)
            self._then()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


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


def _emulate_with_all_reduce(group: dist.ProcessGroup | None) -> bool:
    if os.environ.get("ZEROSPEED_NATIVE_COLLECTIVES", "0") == "1":
        return False
    return dist.get_backend(group) == "gloo"


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: dist.ProcessGroup | None = None,
               async_op: bool = False) -> Any:
    single = _world(group) == 1
    COUNTER.record("all_reduce", tensor.numel(), tensor.element_size(), wire_numel=0 if single else None)
    if single:
        return _DoneWork() if async_op else None
    return _issue("all_reduce", lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a), async_op)


def reduce_scatter(output: torch.Tensor, input: Any, op: Any = ReduceOp.SUM,
                   group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Reduce ``input`` (numel = world * output.numel) over the group; rank r gets chunk r.

    ``input`` is scratch: its contents are unspecified afterwards (on gloo it holds the full sum).
    ``input`` may also be a list of ``world`` tensors (torch's / DeepSpeed's list form; not clobbered).
    ``output`` may be this rank's own chunk of ``input`` (an in-place reduce-scatter): on gloo that
    costs no copy at all; on the native path a temporary keeps the collective's buffers apart.
    """
    world = _world(group)
    if isinstance(input, (list, tuple)):
        return _reduce_scatter_list(output, list(input), op, group, async_op)
    if world == 1:
        COUNTER.record("reduce_scatter", input.numel(), input.element_size(), wire_numel=0)
        output.copy_(input.view_as(output))
        return _DoneWork() if async_op else None
    if _emulate_with_all_reduce(group):
        COUNTER.record("reduce_scatter", input.numel(), input.element_size(), wire_numel=2 * input.numel())
        mine = input.reshape(-1).narrow(0, dist.get_rank(group) * output.numel(), output.numel())
        work = health.CheckedWork(dist.all_reduce(input, op=op, group=group, async_op=True), "reduce_scatter")
        if mine.data_ptr() == output.data_ptr():  # in place: the sum already sits in the output
            if async_op:
                return work
            work.wait()
            return None
        finish = _ThenWork(work, lambda: output.view(-1).copy_(mine))
        if async_op:
            return finish
        finish.wait()
        return None
    COUNTER.record("reduce_scatter", input.numel(), input.element_size())
    start, end = input.data_ptr(), input.data_ptr() + input.numel() * input.element_size()
    if start <= output.data_ptr() < end:  # output aliases input: reduce into a temporary
        temp = torch.empty_like(output)
        work = health.CheckedWork(_reduce_scatter_single(temp, input, op=op, group=group, async_op=True),
                                  "reduce_scatter")
        finish = _ThenWork(work, lambda: output.copy_(temp))
        if async_op:
            return finish
        finish.wait()
        return None
    return _issue("reduce_scatter",
                  lambda a: _reduce_scatter_single(output, input, op=op, group=group, async_op=a), async_op)


def all_gather(output: Any, input: torch.Tensor, group: dist.ProcessGroup | None = None,
               async_op: bool = False) -> Any:
    """Concatenate every rank's ``input`` into ``output`` (numel = world * input.numel).

    ``output`` may also be a list of ``world`` tensors (torch's / DeepSpeed's list form).
    """
    world = _world(group)
    if isinstance(output, (list, tuple)):
        return _all_gather_list(list(output), input, group, async_op)
    if world == 1:
        COUNTER.record("all_gather", output.numel(), output.element_size(), wire_numel=0)
        if output.data_ptr() != input.data_ptr():
            output.copy_(input.view_as(output))
        return _DoneWork() if async_op else None
    if _emulate_with_all_reduce(group):
        COUNTER.record("all_gather", output.numel(), output.element_size(), wire_numel=2 * output.numel())
        flat, n = output.view(-1), input.numel()
        start = dist.get_rank(group) * n
        if flat.narrow(0, start, n).data_ptr() != input.data_ptr():
            flat.narrow(0, start, n).copy_(input.reshape(-1))
        flat.narrow(0, 0, start).zero_()
        flat.narrow(0, start + n, flat.numel() - start - n).zero_()
        return _issue("all_gather", lambda a: dist.all_reduce(output, group=group, async_op=a), async_op)
    COUNTER.record("all_gather", output.numel(), output.element_size())
    return _issue("all_gather", lambda a: _all_gather_single(output, input, group=group, async_op=a), async_op)


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
    COUNTER.record("all_to_all", input.numel(), input.element_size(), wire_numel=0 if single else None)
    if single:
        output.copy_(input)
        return _DoneWork() if async_op else None
    return _issue("all_to_all", lambda a: dist.all_to_all_single(
        output, input, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes, group=group,
        async_op=a), async_op)


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
