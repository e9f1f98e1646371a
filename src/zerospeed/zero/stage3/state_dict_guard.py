"""Refuse to hand out a ZeRO-3 placeholder through ``module.state_dict()``.

A partitioned parameter's ``.data`` is an empty placeholder between uses, so ``model.state_dict()``
(and everything built on it: HF's ``save_pretrained``, ``torch.save(model.state_dict())``) would
silently yield 0-element tensors. A state-dict post-hook (a public ``nn.Module`` hook, registered by
zerospeed on every module that owns partitioned parameters) raises instead, naming the parameter
and the calls that consolidate it.

Only values that would be written are checked: ``state_dict(keep_vars=True)`` returns the
``Parameter`` objects themselves (zerospeed's checkpoint code reads names and identities that way),
and a parameter gathered at the time (inside ``zero.GatheredParameters``) has its full value.

Under ``zerospeed-as-deepspeed`` (the alias calls :func:`allow_placeholders`) the check is off, as in DeepSpeed:
libraries written for DeepSpeed call ``model.state_dict()`` on a partitioned model for its keys (Transformers'
``from_pretrained`` at ZeRO-3) and save through DeepSpeed's consolidating calls instead.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from zerospeed.zero.stage3 import registry

_guarded: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()
_placeholders_allowed = [False]


def allow_placeholders() -> None:
    """DeepSpeed's behaviour for this process: ``state_dict()`` of a partitioned module holds its empty placeholders."""
    _placeholders_allowed[0] = True

ADVICE = ("call zerospeed.integrations.transformers.save_pretrained(engine, save_dir) or "
          "engine.save_16bit_model(save_dir) on every rank (or engine.consolidated_state_dict()), or read it "
          "inside zero.GatheredParameters(model.parameters())")


def _check(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    if _placeholders_allowed[0]:
        return
    for name, p in module._parameters.items():
        value = state_dict.get(prefix + name)
        if p is None or value is None or isinstance(value, nn.Parameter) or value.numel() != 0 or p.numel() != 0:
            continue
        if registry.lookup(p) is not None:
            raise RuntimeError(f"state_dict(): parameter '{prefix + name}' is partitioned by ZeRO-3 (0 elements on "
                               f"this rank), so a state dict would hold an empty tensor; {ADVICE}")


def guard(module: nn.Module) -> None:
    """Install the check on ``module`` (once)."""
    if module not in _guarded:
        _guarded[module] = module.register_state_dict_post_hook(_check)


def guard_tree(root: nn.Module) -> None:
    """Install the check on every module of ``root`` that registers partitioned parameters."""
    for module in root.modules():
        if any(p is not None and registry.lookup(p) is not None for p in module._parameters.values()):
            guard(module)


__all__ = ["ADVICE", "allow_placeholders", "guard", "guard_tree"]
