"""DeepSpeed's ``deepspeed.moe.utils`` names, reading expert marks from :mod:`zerospeed.moe.registry`.

``split_params_into_different_moe_groups_for_optimizer`` follows DeepSpeed's contract (facts from
DeepSpeed 0.19.8's ``deepspeed/moe/utils.py``): the input groups keep their dense parameters; for
each input group and each expert group name found among all groups a new group is appended that
copies the input group's options and sets ``name`` to the expert group name and ``moe`` to True;
with ``max_group_size`` (elements, default 178956971) an expert group is cut into consecutive
groups of at most that many elements (a single larger parameter gets a group of its own).
Decisions: the input dicts are not modified (DeepSpeed edits them in place; the return value is
what callers use); an input group without a ``name`` is keyed by its position instead of failing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerospeed.moe.registry import expert_group_name, is_expert_param

DEFAULT_MAX_GROUP_SIZE = 178956971


def is_moe_param(param: torch.Tensor) -> bool:
    """True for an expert parameter (marked by the MoE layer in the registry)."""
    return is_expert_param(param)


def split_params_into_shared_and_expert_params(params: list[nn.Parameter]) -> tuple[list[nn.Parameter],
                                                                                    list[nn.Parameter]]:
    shared = [p for p in params if not is_moe_param(p)]
    expert = [p for p in params if is_moe_param(p)]
    return shared, expert


def split_params_grads_into_shared_and_expert_params(params: list[nn.Parameter]) -> tuple[list[torch.Tensor],
                                                                                           list[torch.Tensor]]:
    shared = [p.grad.to(p.dtype) for p in params if p.grad is not None and not is_moe_param(p)]
    expert = [p.grad.to(p.dtype) for p in params if p.grad is not None and is_moe_param(p)]
    return shared, expert


def _chunks(params: list[nn.Parameter], max_numel: float) -> list[list[nn.Parameter]]:
    out: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        if current and size + p.numel() > max_numel:
            out.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        out.append(current)
    return out


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any,
                                                         max_group_size: float | None = DEFAULT_MAX_GROUP_SIZE
                                                         ) -> list[dict[str, Any]]:
    """Optimizer parameter groups with expert parameters moved to groups of their own (see module
    docstring). ``param_groups`` is a dict, a list or a tuple of dicts with a ``params`` list."""
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups = list(param_groups)
    else:
        raise ValueError(f"split_params_into_different_moe_groups_for_optimizer: expected a dict or a list/tuple "
                         f"of parameter-group dicts, got {type(param_groups).__name__}")
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise ValueError(f"split_params_into_different_moe_groups_for_optimizer: group {i} is not a dict with "
                             "a 'params' list")
    materialised = [dict(g, params=list(g["params"])) for g in groups]
    names: list[str] = []
    for g in materialised:
        for p in g["params"]:
            name = expert_group_name(p)
            if name is not None and name not in names:
                names.append(name)
    dense = [dict(g, params=[p for p in g["params"] if not is_moe_param(p)]) for g in materialised]
    extra: list[dict[str, Any]] = []
    for g in materialised:
        for name in names:
            experts = [p for p in g["params"] if expert_group_name(p) == name]
            template = {**g, "name": name, "moe": True}
            if max_group_size is None:
                extra.append({**template, "params": experts})
            else:
                extra.extend({**template, "params": chunk} for chunk in _chunks(experts, max_group_size))
    return dense + extra


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return bool(param_group.get("moe", False))


def has_moe_layers(model: nn.Module) -> tuple[bool, int]:
    """(whether any parameter of ``model`` is an expert parameter, number of experts if the MoE
    layer says so, else 0)."""
    for module in model.modules():
        num = getattr(module, "num_experts", None)
        if num is not None and any(is_moe_param(p) for p in module.parameters()):
            return True, int(num)
    return any(is_moe_param(p) for p in model.parameters()), 0
