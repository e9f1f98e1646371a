"""DeepSpeed's tensor-fragment API (``deepspeed.utils.safe_get_full_grad`` and its companions) over zerospeed's state.

A parameter's gradient, fp32 (master) value and optimizer states live, at ZeRO stages 1-3, as fragments of flat
per-bucket shards spread over the data-parallel ranks. These functions read or write them by parameter, as DeepSpeed
0.19.8's ``deepspeed/utils/tensor_fragment.py`` defines them:

* ``safe_get_full_grad(p)`` / ``safe_set_full_grad(p, value)``: the whole gradient the next ``engine.step()`` applies,
  averaged over the data-parallel ranks (still multiplied by the fp16 loss scale, as DeepSpeed's), as fp32 (exact: the
  ranks' sum divided by their number, a power of two for 1, 2, 4...); the setter takes the same convention. At stages
  0-1 gradients are reduced at the accumulation boundary, so between micro-batches there is no reduced gradient yet:
  the getter then refuses in one line.
* ``safe_get_full_fp32_param(p)`` / ``safe_set_full_fp32_param(p, value)``: the fp32 master (the parameter itself when
  training in fp32). As in DeepSpeed, setting the master changes the 16-bit copy at the next step.
* ``safe_get_full_optimizer_state(p, key)`` / ``safe_set_full_optimizer_state(p, value, key)``: an element-wise
  optimizer state (``exp_avg``, ``exp_avg_sq``...); a key the optimizer does not hold is a ``ValueError`` naming the
  keys it holds.
* every getter returns fp32 (a new tensor), as DeepSpeed's do.
* ``safe_get_local_*`` / ``safe_set_local_*``: ZeRO-3 only (an ``AssertionError`` elsewhere, as DeepSpeed's): this
  rank's fragment, the same elements as ``p.ds_tensor`` (zerospeed's buckets are flat, so a rank's fragment of one
  parameter may be shorter than 1/N of it, or empty).
* ``safe_update_full_grad_vectorized(params, update_func)``: ``set(update_func(get(p), p))`` for each parameter.

Every full getter is a collective over the bucket's group at stages 1-3 (each rank contributes its fragment to a
zero-filled buffer that is summed, which is exact): every rank must call it for the same parameters in the same order,
as in DeepSpeed. Setters take the full value on every rank and keep this rank's fragment (no communication).

A parameter no engine manages, or one the optimizer does not update (frozen), reads as None (the full gradient of an
unmanaged parameter is its ``.grad``, as DeepSpeed's), and setters leave it alone, as DeepSpeed's do. One difference,
deliberate: at ZeRO stage 0 without bf16 DeepSpeed keeps no fp32 master mapping, so its ``safe_get_full_fp32_param``
and ``safe_get_full_optimizer_state`` return None there; zerospeed returns the values at every stage."""

from __future__ import annotations

import weakref
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable

import torch

from zerospeed import comm
from zerospeed.checkpoint.shards import opt_mode
from zerospeed.zero import owners

_LOCAL_ONLY = "This API is only defined for ZeRO-3 partitioned parameters"


class TensorFragmentError(ValueError, AssertionError):
    """A value of the wrong size for a parameter (DeepSpeed asserts, so this is also an ``AssertionError``)."""


@dataclass(frozen=True)
class _Where:
    strategy: Any
    index: int  # the bucket's position in strategy.state.buckets (and in shard_views())
    bucket: Any
    slot: Any  # the parameter's slot in the bucket's flat layout
    pos: int

    @property
    def lo(self) -> int:  # this rank's fragment of the parameter, in the bucket's flat coordinates
        return max(self.slot.offset, self.bucket.shard_start)

    @property
    def hi(self) -> int:
        return max(self.lo, min(self.slot.offset + self.slot.numel, self.bucket.shard_end))

    @property
    def numel(self) -> int:
        """Elements of the parameter on this rank (0: its slot lies in other ranks' shards)."""
        return self.hi - self.lo

    def in_param(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's fragment's elements of a whole, flattened parameter-sized tensor."""
        return full.reshape(-1).narrow(0, self.lo - self.slot.offset, self.numel) if self.numel else full[:0]

    def in_shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's fragment's elements of a flat shard-sized tensor (the bucket's range of this rank)."""
        return flat.narrow(0, self.lo - self.bucket.shard_start, self.numel) if self.numel else flat[:0]

    @property
    def sharded(self) -> bool:
        return self.bucket.layout.world_size > 1

    @property
    def group(self) -> Any:
        return getattr(self.bucket, "comm_group", getattr(self.bucket, "group", None))

    @property
    def grad_divisor(self) -> float:
        """Internal gradients are summed over ranks and multiplied by the pre-scale; DeepSpeed's are averaged."""
        return float(self.strategy.dp_world_size) * float(getattr(self.strategy.options, "prescale", 1.0))


_index: "weakref.WeakKeyDictionary[Any, dict[int, tuple[int, int]]]" = weakref.WeakKeyDictionary()


def _params_of(bucket: Any) -> list[tuple[int, Any]]:
    live = getattr(bucket, "live_params", None)
    return live() if callable(live) else list(enumerate(bucket.params))


def _locate(param: Any) -> _Where | None:
    """Where ``param``'s optimizer-held state lives, or None (not managed, frozen, not in the optimizer)."""
    strategy = owners.strategy_of(param)
    state = getattr(strategy, "state", None)
    if state is None:
        return None
    table = _index.get(strategy)
    if table is None:
        table = {id(p): (bi, pos) for bi, b in enumerate(state.buckets) for pos, p in _params_of(b)}
        _index[strategy] = table
    found = table.get(id(param))
    if found is None:
        return None
    bucket = state.buckets[found[0]]
    if dict(_params_of(bucket)).get(found[1]) is not param:
        return None
    return _Where(strategy, found[0], bucket, bucket.layout.slots[found[1]], found[1])


def _is_zero3(param: Any) -> bool:
    from zerospeed.zero.stage3 import registry

    return registry.lookup(param) is not None


# -- the flat tensors a kind of state lives in ------------------------------------------------------------------------
def _fragment(where: _Where, key: str | None) -> torch.Tensor:
    """This rank's fragment of ``where``'s parameter: the master (``key`` None), the reduced gradient (``"grad"``
    internally) or optimizer state ``key``. A view of the live tensor (writes go through)."""
    if key == "\0grad":
        return where.in_shard(where.bucket.reduced_grad())
    view = where.strategy.shard_views()[where.index]
    if key is None:
        return where.in_shard(view.master)
    optimizer = where.strategy.state.optimizer
    flat_mode = opt_mode(view) == "flat"
    tensor = view.opt_tensors[0] if flat_mode else view.opt_tensors[where.pos]
    state = optimizer.state.get(tensor, {})
    value = state.get(key)
    if not torch.is_tensor(value) or value.numel() != tensor.numel():
        held = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.numel() == tensor.numel())
        raise ValueError(f"{key} not found in optimizer state fragment: {type(optimizer).__name__} holds "
                         f"{held or 'no element-wise state yet (before its first step)'} for this parameter")
    return where.in_shard(value.reshape(-1)) if flat_mode else where.in_param(value)


def _resident(strategy: Any, write: bool) -> ExitStack:
    """Offloaded state in memory for the block (stage 3 ``offload_param`` shards, offloaded optimizer states and
    masters), written back after it when ``write``; nothing without offload."""
    stack = ExitStack()
    params = getattr(strategy, "resident_params", None)
    if callable(params):
        stack.enter_context(params(dirty=write))
    states = getattr(getattr(strategy, "state", None), "resident_for_checkpoint", None)
    if callable(states):
        stack.enter_context(states(write))
    return stack


def _check_grads_reduced(where: _Where) -> None:
    if not getattr(where.strategy.reducer, "reduced", True):
        raise RuntimeError("safe_get_full_grad: at ZeRO stages 0-1 gradients are reduced over the data-parallel ranks "
                           "in the backward of the accumulation boundary; call it after that backward and before "
                           "engine.step() (this backward was not a boundary: gradient_accumulation_steps > 1)")


def _get_full(where: _Where, key: str | None) -> torch.Tensor:
    with _resident(where.strategy, write=False):
        local = _fragment(where, key)
        full = torch.zeros(where.slot.numel, dtype=torch.float32, device=local.device)
        where.in_param(full).copy_(local)
    if where.sharded:
        comm.all_reduce(full, group=where.group)  # disjoint fragments: the sum is exact
    if key == "\0grad":
        full.div_(where.grad_divisor)
    return full.view(where.slot.shape)


def _set_full(where: _Where, value: torch.Tensor, key: str | None, what: str) -> None:
    if not torch.is_tensor(value) or value.numel() != where.slot.numel:
        got = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise TensorFragmentError(f"{what}: value has shape {got}, the parameter {where.slot.name!r} has shape "
                                  f"{tuple(where.slot.shape)} ({where.slot.numel} elements)")
    part = where.in_param(value.detach())
    with _resident(where.strategy, write=True), torch.no_grad():
        local = _fragment(where, key)
        if key == "\0grad":
            part = part.to(local.dtype) * where.grad_divisor
        local.copy_(part)


# -- DeepSpeed's names -------------------------------------------------------------------------------------------------
def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The whole fp32 master of ``param`` (the parameter itself in fp32 training); None if no optimizer holds it."""
    where = _locate(param)
    return None if where is None else _get_full(where, None)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite ``param``'s fp32 master with ``value`` (the whole parameter; every rank passes the same)."""
    where = _locate(param)
    if where is not None:
        _set_full(where, value, None, "safe_set_full_fp32_param")


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The whole optimizer state ``optim_state_key`` (e.g. ``exp_avg``) of ``param``, fp32."""
    where = _locate(param)
    return None if where is None else _get_full(where, optim_state_key)


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Overwrite the optimizer state ``optim_state_key`` of ``param`` with ``value`` (the whole parameter)."""
    where = _locate(param)
    if where is not None:
        _set_full(where, value, optim_state_key, "safe_set_full_optimizer_state")


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The whole gradient of ``param`` the next step applies, averaged over data-parallel ranks (see the module
    docstring); an unmanaged parameter's ``.grad``."""
    where = _locate(param)
    if where is None:
        return param.grad
    _check_grads_reduced(where)
    return _get_full(where, "\0grad")


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite the gradient of ``param`` that the next step applies (the averaged convention of the getter)."""
    where = _locate(param)
    if where is None:
        if param.grad is not None:
            param.grad.copy_(value)
        return
    _check_grads_reduced(where)
    _set_full(where, value, "\0grad", "safe_set_full_grad")


def safe_update_full_grad_vectorized(param_list: list[torch.nn.Parameter],
                                     update_func: Callable[[torch.Tensor, torch.nn.Parameter], torch.Tensor]) -> None:
    """For each parameter that requires grad: set its full gradient to ``update_func(full gradient, param)``."""
    for p in param_list:
        if p.requires_grad:
            grad = safe_get_full_grad(p)
            if grad is not None:
                safe_set_full_grad(p, update_func(grad, p))


def _local(param: torch.nn.Parameter) -> _Where | None:
    assert _is_zero3(param), _LOCAL_ONLY
    return _locate(param)


def _get_local(param: torch.nn.Parameter, key: str | None) -> torch.Tensor | None:
    where = _local(param)
    if where is None:
        return None
    if key == "\0grad":
        _check_grads_reduced(where)
    with _resident(where.strategy, write=False):
        local = _fragment(where, key)
        out = local.to(torch.float32, copy=True)
    return out.div_(where.grad_divisor) if key == "\0grad" else out


def _set_local(param: torch.nn.Parameter, value: torch.Tensor, key: str | None, what: str) -> None:
    where = _local(param)
    if where is None:
        return
    n = where.numel
    if not torch.is_tensor(value) or value.numel() != n:
        got = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise TensorFragmentError(f"{what}: value has shape {got}; this rank's fragment of {where.slot.name!r} has "
                                  f"{n} elements (param.ds_tensor.numel())")
    with _resident(where.strategy, write=True), torch.no_grad():
        local = _fragment(where, key)
        part = value.detach().reshape(-1).to(local.dtype)
        local.copy_(part * where.grad_divisor if key == "\0grad" else part)


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's fragment of ``param``'s averaged gradient (ZeRO-3)."""
    return _get_local(param, "\0grad")


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite this rank's fragment of ``param``'s gradient (ZeRO-3; the averaged convention)."""
    _set_local(param, value, "\0grad", "safe_set_local_grad")


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's fragment of ``param``'s fp32 master (ZeRO-3)."""
    return _get_local(param, None)


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite this rank's fragment of ``param``'s fp32 master (ZeRO-3)."""
    _set_local(param, value, None, "safe_set_local_fp32_param")


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """This rank's fragment of optimizer state ``optim_state_key`` of ``param`` (ZeRO-3)."""
    return _get_local(param, optim_state_key)


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Overwrite this rank's fragment of optimizer state ``optim_state_key`` of ``param`` (ZeRO-3)."""
    _set_local(param, value, optim_state_key, "safe_set_local_optimizer_state")


__all__ = ["TensorFragmentError", "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
           "safe_update_full_grad_vectorized"]
