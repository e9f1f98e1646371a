"""Which parameters are expert (MoE) parameters, and of which expert data-parallel group.

DeepSpeed marks an expert parameter by setting ``param.allreduce = False`` and
``param.group_name = "ep_size_N"`` on the tensor. zerospeed does not put attributes on
``nn.Parameter`` (design rule 8): the mark lives here, in a weak dictionary keyed by the parameter,
so it disappears with the parameter (a ``WeakKeyDictionary`` by identity). The MoE layer calls :func:`mark_expert_param` for each of its
experts' parameters; the optimizer-group helpers and the gradient reduction read it back.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

# keyed by identity (tensors compare element-wise, so a plain WeakKeyDictionary cannot hold them)
_EXPERT_GROUP: WeakIdKeyDictionary = WeakIdKeyDictionary()


def mark_expert_param(param: torch.Tensor, group_name: str) -> None:
    """Record ``param`` as an expert parameter reduced over the expert group ``group_name``."""
    if not torch.is_tensor(param):
        raise TypeError(f"mark_expert_param: expected a tensor, got {type(param).__name__}")
    if not isinstance(group_name, str) or not group_name:
        raise ValueError(f"mark_expert_param: group_name must be a non-empty string, got {group_name!r}")
    _EXPERT_GROUP[param] = group_name


def unmark_expert_param(param: torch.Tensor) -> None:
    _EXPERT_GROUP.pop(param, None)


def expert_group_name(param: torch.Tensor) -> str | None:
    """The expert group of ``param``, or None for a dense (shared) parameter."""
    try:
        return _EXPERT_GROUP.get(param)
    except TypeError:  # not weak-referenceable: cannot have been marked
        return None


def is_expert_param(param: torch.Tensor) -> bool:
    return expert_group_name(param) is not None
