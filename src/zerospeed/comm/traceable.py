"""Collectives that torch.compile can put inside a graph: ``torch.library`` custom ops over the
counted wrappers of :mod:`zerospeed.comm.collectives`.

Dynamo cannot trace the wrappers themselves (the counter, the bounded waits of ``comm.health``), so a
compiled region calls these ops instead: to Dynamo and Inductor each is one opaque node with a
known output shape, and when the graph runs it calls the same counted collective as eager code.

* ``zerospeed::all_reduce_sum(x, group) -> Tensor`` - a new tensor, the sum of ``x`` over the group;
* ``zerospeed::all_gather_stack(x, group, world) -> Tensor`` - shape ``(world, *x.shape)``.

A process group is passed as an integer from :func:`group_id` (graphs hold no Python objects);
``group_id`` is a constant for Dynamo (``torch.compiler.assume_constant_result``), so tracing it
costs no guard. ``None`` (the default group) is 0. A group must be registered eagerly (the
tensor-parallel layers do it when they are built): while tracing, Dynamo hands ``group_id`` a
stand-in for the group that compares equal to the real one, which finds the registration.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.comm import collectives

_GROUPS: dict[int, Any] = {0: None}
_IDS: dict[Any, int] = {}


@torch.compiler.assume_constant_result
def group_id(group: Any) -> int:
    """A stable integer for ``group`` (registered on first eager use)."""
    if group is None:
        return 0
    gid = _IDS.get(group)
    if gid is None:
        if type(group).__name__ == "FakeScriptObject":
            raise RuntimeError("zerospeed.comm.traceable: a process group used inside torch.compile was never "
                               "registered; call zerospeed.comm.traceable.group_id(group) before compiling")
        gid = _IDS[group] = len(_GROUPS)
        _GROUPS[gid] = group
    return gid


@torch.library.custom_op("zerospeed::all_reduce_sum", mutates_args=())
def all_reduce_sum(x: torch.Tensor, group: int) -> torch.Tensor:
    out = x.contiguous().clone()
    collectives.all_reduce(out, group=_GROUPS[group])
    return out


@all_reduce_sum.register_fake
def _all_reduce_sum_fake(x: torch.Tensor, group: int) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("zerospeed::all_gather_stack", mutates_args=())
def all_gather_stack(x: torch.Tensor, group: int, world: int) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((world, *x.shape))
    collectives.all_gather(out, x, group=_GROUPS[group])
    return out


@all_gather_stack.register_fake
def _all_gather_stack_fake(x: torch.Tensor, group: int, world: int) -> torch.Tensor:
    return x.new_empty((world, *x.shape))
