"""``FusedAdam``: DeepSpeed's name for its GPU Adam, here torch's Adam with DeepSpeed's defaults.

DeepSpeed's ``FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True)`` is decoupled (AdamW) by
default. zerospeed maps it onto ``torch.optim.Adam(decoupled_weight_decay=adam_w_mode)`` with torch's
fused kernel on CPU/CUDA when every parameter lives there. What cannot be matched is refused by
name: ``bias_correction=False`` (torch always corrects) and ``amsgrad=True`` (DeepSpeed refuses it
too). ``set_grad_none`` is accepted; torch's ``zero_grad`` sets gradients to None by default.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class FusedAdam(torch.optim.Adam):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True,
                 fused: bool | None = None) -> None:
        if not bias_correction:
            raise ValueError("FusedAdam: bias_correction=False is not supported by zerospeed (torch's Adam always "
                             "applies bias correction)")
        if amsgrad:
            raise ValueError("FusedAdam: amsgrad=True is not supported (DeepSpeed's FusedAdam refuses it too)")
        self.set_grad_none = set_grad_none
        self.adam_w_mode = adam_w_mode
        groups = list(params)
        if fused is None:
            tensors = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
            fused = bool(tensors) and all(torch.is_tensor(p) and p.is_floating_point() and
                                          p.device.type in ("cpu", "cuda") for p in tensors)
        super().__init__(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode, fused=fused or None)
