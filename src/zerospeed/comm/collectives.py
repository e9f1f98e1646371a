"""The only place zerospeed calls torch.distributed collectives.

Each wrapper records the call in :data:`zerospeed.comm.counter.COUNTER` and forwards to torch,
using the torch 2.13 names (``all_gather_single`` / ``reduce_scatter_single``) with a fallback to
the older ``*_into_tensor`` / ``*_tensor`` names. ``async_op=True`` returns torch's Work handle.
With a world of one, collectives are skipped (they would be identities) but still counted, so
tests and the comms logger see the same call pattern at any world size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

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


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: dist.ProcessGroup | None = None,
               async_op: bool = False) -> Any:
    COUNTER.record("all_reduce", tensor.numel(), tensor.element_size())
    if _world(group) == 1:
        return _DoneWork() if async_op else None
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM,
                   group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Reduce ``input`` (numel = world * output.numel) over the group; rank r gets chunk r."""
    COUNTER.record("reduce_scatter", input.numel(), input.element_size())
    if _world(group) == 1:
        output.copy_(input.view_as(output))
        return _DoneWork() if async_op else None
    return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
               async_op: bool = False) -> Any:
    """Concatenate every rank's ``input`` into ``output`` (numel = world * input.numel)."""
    COUNTER.record("all_gather", output.numel(), output.element_size())
    if _world(group) == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input.view_as(output))
        return _DoneWork() if async_op else None
    return _all_gather_single(output, input, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any:
    COUNTER.record("broadcast", tensor.numel(), tensor.element_size())
    if _world(group) == 1:
        return _DoneWork() if async_op else None
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> None:
    COUNTER.record("send", tensor.numel(), tensor.element_size())
    dist.send(tensor, dst=dst, group=group)


def recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    COUNTER.record("recv", tensor.numel(), tensor.element_size())
    dist.recv(tensor, src=src, group=group)


def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> Any:
    COUNTER.record("send", tensor.numel(), tensor.element_size())
    return dist.isend(tensor, dst=dst, group=group)


def irecv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> Any:
    COUNTER.record("recv", tensor.numel(), tensor.element_size())
    return dist.irecv(tensor, src=src, group=group)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if _world(group) > 1:
        dist.barrier(group=group)


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Gather one picklable object per rank (for small control data: error reports, metadata)."""
    world = _world(group)
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out
