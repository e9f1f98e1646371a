"""ALST's tiled compute (DeepSpeed's names): run a per-token function over tiles of the sequence so that only
one tile's intermediate activations exist at a time.

* :class:`TiledMLP` (``TiledMLP.apply(fn, module, x, shards, compute_params)``): ``fn(module, x_tile)`` per tile
  under ``no_grad`` in forward (only ``x`` is kept), recomputed tile by tile in backward.
* :func:`sequence_tiled_compute` / :class:`SequenceTiledCompute`: the same for any ``fn(**kwargs)`` whose
  ``kwargs_to_shard`` are ``[batch, seq, ...]`` tensors, with an optional sum/mean of the outputs (a loss).
* :class:`TiledFusedLogitsLoss`: logits and loss tile by tile, their backward run at once inside forward, so the
  ``[seq, vocab]`` logits never exist whole; backward only scales the stored gradients.

Decision (how gradients reach ZeRO): DeepSpeed back-propagates every tile into the parameters' ``.grad`` and
marks parameters with ``ds_grad_is_ready`` so its hooks wait for the last tile. zerospeed keeps no attributes on
parameters; instead each tile's parameter gradients are computed with ``torch.autograd.grad`` (nothing is
accumulated), summed here, and returned once from the autograd function, whose inputs include the parameters.
Autograd then accumulates each parameter's gradient once per backward, and ZeRO's gradient hooks fire once, as
for an untiled layer. ``compute_params`` therefore must list every parameter ``fn`` uses; when it is None the
parameters of the module (:class:`TiledMLP`) or of the modules in ``kwargs_to_pass`` are taken.

Tiles: ``ceil(seq / shards)`` tokens each (the last may be shorter), so a sequence ``shards`` does not divide is
handled exactly. The results equal the untiled ones up to the order of the sums of per-tile parameter gradients
(fp32: a few ulps of the gradient's magnitude per tile).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "sequence_tiled_compute"]


def _params_of(compute_params: Any, *holders: Any) -> list[torch.Tensor]:
    if compute_params is not None:
        params = list(compute_params)
    else:
        params = [p for h in holders if isinstance(h, nn.Module) for p in h.parameters()]
    seen: set[int] = set()
    out = []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _bounds(length: int, shards: int) -> list[tuple[int, int]]:
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"tiled compute: shards must be a positive int, got {shards!r}")
    step = max(1, math.ceil(length / shards))
    return [(start, min(step, length - start)) for start in range(0, length, step)]


def _add(sums: list[Any], grads: tuple[Any, ...], *not_ours: Any) -> None:
    """Add one tile's parameter gradients into ``sums``, in place from the second tile on, so that a sum and one
    tile's gradient are all that exist (not a third tensor per ``+``). The first tile's gradient becomes the sum
    when autograd made it fresh; one that is a view of, or shares storage with, ``not_ours`` (the incoming
    gradient, the input) is copied first. The values are those of ``sum + g``, bit for bit."""
    for i, g in enumerate(grads):
        if g is None:
            continue
        if sums[i] is not None:
            sums[i].add_(g)
        elif g._base is not None or any(t is not None and torch.is_tensor(t) and
                                         t.untyped_storage().data_ptr() == g.untyped_storage().data_ptr()
                                         for t in not_ours):
            sums[i] = g.clone()
        else:
            sums[i] = g


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable, module: Any, shards: int, x: torch.Tensor, *params: torch.Tensor) -> Any:
        ctx.fn, ctx.module, ctx.shards, ctx.params = fn, module, shards, list(params)
        ctx.save_for_backward(x)
        with torch.no_grad():
            outs = [fn(module, x.narrow(-2, s, n)) for s, n in _bounds(x.shape[-2], shards)]
        return torch.cat(outs, dim=-2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        want_x = ctx.needs_input_grad[3]
        x_grad = torch.zeros_like(x) if want_x else None
        sums: list[Any] = [None] * len(ctx.params)
        for start, n in _bounds(x.shape[-2], ctx.shards):
            tile = x.narrow(-2, start, n).detach().requires_grad_(want_x)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, tile)
            got = torch.autograd.grad(out, ([tile] if want_x else []) + ctx.params, grad.narrow(-2, start, n),
                                      allow_unused=True)
            if x_grad is not None:
                x_grad.narrow(-2, start, n).copy_(got[0])
                got = got[1:]
            _add(sums, got, grad, x)
            del got, out  # this tile's gradients and output: gone before the next tile is recomputed
        return (None, None, None, x_grad, *sums)


class TiledMLP:
    """``TiledMLP.apply(fn, module, x, shards, compute_params=None)``: ``fn(module, x)`` computed over ``shards``
    tiles of ``x``'s sequence dimension (``-2``: ``[batch, seq, hidden]`` or ``[seq, hidden]``)."""

    @staticmethod
    def apply(fn: Callable, module: Any, x: torch.Tensor, shards: int, compute_params: Any = None) -> torch.Tensor:
        params = _params_of(compute_params, module)
        _bounds(x.shape[-2], shards)
        return _TiledMLP.apply(fn, module, shards, x, *params)


class SequenceTiledCompute(torch.autograd.Function):
    """The autograd function behind :func:`sequence_tiled_compute` (forward under ``no_grad`` per tile, backward
    recomputes each tile). Arguments after the fixed ones: the sharded tensors, the passed values, the params."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, seqlen: int, shards: int, keys_to_shard: list[str], keys_to_pass: list[str],
                grad_key: str, num_params: int, unshard_dim: int, reduction: str | None, *args: Any) -> Any:
        n_shard, n_pass = len(keys_to_shard), len(keys_to_pass)
        sharded = dict(zip(keys_to_shard, args[:n_shard]))
        passed = dict(zip(keys_to_pass, args[n_shard:n_shard + n_pass]))
        ctx.params = list(args[n_shard + n_pass:])
        ctx.fn, ctx.sharded, ctx.passed, ctx.grad_key = fn, sharded, passed, grad_key
        ctx.unshard_dim, ctx.reduction, ctx.nargs = unshard_dim, reduction, len(args)
        ctx.grad_index = keys_to_shard.index(grad_key)
        ctx.bounds = _bounds(seqlen, shards)
        with torch.no_grad():
            outs = [fn(**{k: v.narrow(1, s, n) for k, v in sharded.items()}, **passed) for s, n in ctx.bounds]
            if unshard_dim == 0:
                out = torch.stack([o.reshape(()) for o in outs])
            else:
                out = torch.cat(outs, dim=unshard_dim)
            ctx.out_numel = out.numel()
            if reduction is None:
                return out
            if reduction == "mean":
                return out.mean()
            if reduction == "sum":
                return out.sum()
        raise ValueError(f"sequence_tiled_compute: output_reduction {reduction!r} is not one of None, 'mean', 'sum'")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x = ctx.sharded[ctx.grad_key]
        x_grad = torch.zeros_like(x)
        sums: list[Any] = [None] * len(ctx.params)
        offset = 0
        for i, (start, n) in enumerate(ctx.bounds):
            tile = x.narrow(1, start, n).detach().requires_grad_(True)
            kwargs = {k: (tile if k == ctx.grad_key else v.narrow(1, start, n)) for k, v in ctx.sharded.items()}
            with torch.enable_grad():
                out = ctx.fn(**kwargs, **ctx.passed)
            if ctx.reduction == "sum":
                g = grad.expand_as(out) if ctx.unshard_dim else grad.reshape(()).expand(out.shape)
            elif ctx.reduction == "mean":
                g = (grad / ctx.out_numel).expand(out.shape)
            elif ctx.unshard_dim == 0:
                g = grad[i].reshape(out.shape)
            else:
                g = grad.narrow(ctx.unshard_dim, offset, out.shape[ctx.unshard_dim])
                offset += out.shape[ctx.unshard_dim]
            got = torch.autograd.grad(out, [tile] + ctx.params, g, allow_unused=True)
            if got[0] is not None:
                x_grad.narrow(1, start, n).copy_(got[0])
            _add(sums, got[1:], grad, x)
            del got, out, g
        arg_grads: list[Any] = [None] * (ctx.nargs - len(ctx.params))
        arg_grads[ctx.grad_index] = x_grad
        return (None,) * 9 + tuple(arg_grads) + tuple(sums)


def sequence_tiled_compute(fn: Callable, seqlen: int, shards: int, kwargs_to_shard: dict[str, torch.Tensor],
                           kwargs_to_pass: dict[str, Any], grad_requiring_tensor_key: str, compute_params: Any = None,
                           output_unshard_dimension: int = 1, output_reduction: str | None = "mean") -> Any:
    """``fn(**kwargs_to_shard tile, **kwargs_to_pass)`` over ``shards`` tiles of dimension 1 (the sequence) of every
    ``kwargs_to_shard`` tensor; outputs concatenated along ``output_unshard_dimension`` (0: one scalar per tile,
    stacked), then summed / averaged / returned as they are (``output_reduction`` "sum", "mean", None).
    Only ``kwargs_to_shard[grad_requiring_tensor_key]`` (and the parameters) receive gradients."""
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(f"sequence_tiled_compute: grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not a "
                         f"key of kwargs_to_shard {sorted(kwargs_to_shard)}")
    params = _params_of(compute_params, *kwargs_to_pass.values())
    return SequenceTiledCompute.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                      grad_requiring_tensor_key, len(params), output_unshard_dimension,
                                      output_reduction, *kwargs_to_shard.values(), *kwargs_to_pass.values(), *params)


class _FusedLogitsLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable, module: Any, shards: int, reduction: str, has_mask: bool,
                x: torch.Tensor, y: torch.Tensor, mask: Any, *params: torch.Tensor) -> torch.Tensor:
        if reduction not in ("mean", "sum"):
            raise ValueError(f"TiledFusedLogitsLoss: output_reduction {reduction!r} is not 'mean' or 'sum'")
        bounds = _bounds(x.shape[1], shards)
        scale = 1.0 / len(bounds) if reduction == "mean" else 1.0
        x_grad = torch.zeros_like(x)
        sums: list[Any] = [None] * len(params)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for start, n in bounds:
            tile = x.narrow(1, start, n).detach().requires_grad_(True)
            extra = (mask.narrow(1, start, n),) if has_mask else ()
            with torch.enable_grad():
                loss = fn(module, tile, y.narrow(1, start, n), *extra) * scale
            got = torch.autograd.grad(loss, [tile, *params], allow_unused=True)
            x_grad.narrow(1, start, n).copy_(got[0])
            _add(sums, got[1:], x)
            total = total + loss.detach().float()
            del got, loss  # the previous tile's gradients are not kept while the next tile's logits exist
        ctx.save_for_backward(x_grad, *[s if s is not None else torch.zeros(()) for s in sums])
        ctx.has_sum = [s is not None for s in sums]
        return total.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x_grad, *sums = ctx.saved_tensors
        params = [s * grad if has else None for s, has in zip(sums, ctx.has_sum)]
        return (None, None, None, None, None, x_grad * grad, None, None, *params)


class TiledFusedLogitsLoss:
    """``TiledFusedLogitsLoss.apply(fn, module, x, y, mask, shards, compute_params, output_reduction="mean")``:
    ``fn(module, x_tile, y_tile[, mask_tile])`` (a scalar loss per tile) over ``shards`` tiles of dimension 1;
    the per-tile losses are averaged ("mean") or summed ("sum"). Use "sum" of per-tile token sums and divide by the
    real-token count when tiles hold different numbers of real tokens (as DeepSpeed recommends)."""

    @staticmethod
    def apply(fn: Callable, module: Any, x: torch.Tensor, y: torch.Tensor, mask: Any, shards: int,
              compute_params: Any = None, output_reduction: str = "mean") -> torch.Tensor:
        params = _params_of(compute_params, module)
        return _FusedLogitsLoss.apply(fn, module, shards, output_reduction, mask is not None, x, y, mask, *params)
