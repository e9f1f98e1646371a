"""Selective activation checkpointing through torch's API (``create_selective_checkpoint_contexts``).

A policy decides per operator whether its output is saved in the forward or recomputed in the
backward. Named policies:

* ``"save_matmuls"``: save the outputs of matmul-type operators (mm, addmm, bmm, baddbmm,
  scaled-dot-product attention), recompute everything else (norms, activations, dropout, reshapes).
  The expensive FLOPs are not repeated while the cheap, memory-heavy element-wise outputs are
  dropped; the memory saved is smaller than with full recomputation, the time overhead far smaller.
* ``"save_attention"``: save only attention outputs (the one op whose recompute is quadratic).

A list of operator names (``["aten.mm", "aten.addmm"]``) saves those; a callable
``policy(ctx, op, *args, **kwargs) -> torch.utils.checkpoint.CheckpointPolicy`` is used as is.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from zerospeed.config import ConfigError

_ATTENTION = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
_MATMULS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm") + _ATTENTION
NAMED = {"save_matmuls": _MATMULS, "save_attention": _ATTENTION}


def _ops(names: tuple[str, ...] | list[str]) -> frozenset[Any]:
    out = set()
    for name in names:
        short = name[len("aten."):] if name.startswith("aten.") else name
        packet = getattr(torch.ops.aten, short, None)
        if packet is None:
            raise ConfigError("activation_checkpointing.selective_policy", f"{name!r} is not an aten operator")
        out.add(packet)
    return frozenset(out)


def _policy_saving(ops: frozenset[Any]) -> Callable[..., CheckpointPolicy]:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        packet = getattr(op, "overloadpacket", op)
        return CheckpointPolicy.MUST_SAVE if packet in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def resolve_policy(policy: Any) -> Callable[..., CheckpointPolicy]:
    """A policy function from a name, a list of operator names, or a callable."""
    if callable(policy):
        return policy
    if isinstance(policy, str):
        if policy not in NAMED:
            raise ConfigError("activation_checkpointing.selective_policy",
                              f"{policy!r} is not one of {', '.join(map(repr, NAMED))} (or a list of aten operators)")
        return _policy_saving(_ops(NAMED[policy]))
    if isinstance(policy, (list, tuple)) and policy and all(isinstance(p, str) for p in policy):
        return _policy_saving(_ops(list(policy)))
    raise ConfigError("activation_checkpointing.selective_policy",
                      f"{policy!r} is not a policy name, a list of aten operator names or a callable")


def context_fn(policy: Callable[..., CheckpointPolicy]) -> Callable[[], Any]:
    """The ``context_fn`` for ``torch.utils.checkpoint.checkpoint(use_reentrant=False, ...)``."""
    return functools.partial(create_selective_checkpoint_contexts, policy)
