"""DeepSpeed's ``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``, which Accelerate's ``get_state_dict`` calls.

A state dict's tensors are often views into larger storages (a flat ZeRO buffer, a fused weight); ``torch.save``
writes a view's whole storage. Cloning each tensor to ``device`` first saves only its own elements.
"""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = torch.device("cpu")) -> Any:
    """``item`` with every tensor (in nested lists, tuples and dicts) detached, cloned and moved to ``device``.

    Containers are rebuilt with their own type (a dict subclass such as ``OrderedDict`` stays one); other
    values are returned as they are.
    """
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return type(item)(*(clone_tensors_for_torch_save(v, device) for v in item)) if hasattr(item, "_fields") \
            else tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


__all__ = ["clone_tensors_for_torch_save"]
