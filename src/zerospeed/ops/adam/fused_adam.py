"""``FusedAdam``: DeepSpeed's name for its GPU Adam, here torch's Adam with DeepSpeed's defaults.

DeepSpeed's ``FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True)`` is decoupled (AdamW) by
default. zerospeed maps it onto ``torch.optim.Adam(decoupled_weight_decay=adam_w_mode)`` with torch's
fused kernel on CPU/CUDA when every parameter lives there. What cannot be matched is refused by
name: ``bias_correction=False`` (torch always corrects) and ``amsgrad=True`` (DeepSpeed refuses it
too). ``set_grad_none`` is accepted; torch's ``zero_grad`` sets gradients to None by default.

Which of torch's implementations runs is the ``adam_kernel`` fast path (``auto``, ``forloop``,
``foreach``, ``fused``; :mod:`zerospeed.ops.adam.kernel_choice`): ``auto`` times them on the
parameters at the first step (or when the engine settles it at start-up); a forced one that cannot
run here is an error naming ``FusedAdam(adam_kernel=...)``. ``fused=True/False`` is torch's own flag
and wins over ``auto`` (a forced ``adam_kernel`` that disagrees with it is an error).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zerospeed.ops.adam.kernel_choice import attach_switch, check_forced, resolve_kernel_setting

_SOURCE = "FusedAdam(adam_kernel=...)"


class FusedAdam(torch.optim.Adam):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True,
                 fused: bool | None = None, adam_kernel: str = "auto") -> None:
        setting = resolve_kernel_setting(adam_kernel, _SOURCE)
        if not bias_correction:
            raise ValueError("FusedAdam: bias_correction=False is not supported by zerospeed (torch's Adam always "
                             "applies bias correction)")
        if amsgrad:
            raise ValueError("FusedAdam: amsgrad=True is not supported (DeepSpeed's FusedAdam refuses it too)")
        self.set_grad_none = set_grad_none
        self.adam_w_mode = adam_w_mode
        groups = [dict(g, params=list(g["params"])) if isinstance(g, dict) else g for g in params]
        if (fused is True and setting not in ("auto", "fused")) or (fused is False and setting == "fused"):
            raise ValueError(f"{_SOURCE}: {setting!r} conflicts with fused={fused}; set one")
        flags: dict[str, bool | None] = {"fused": fused or None}
        if setting != "auto":
            check_forced(setting, [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])], _SOURCE)
            flags = {"fused": setting == "fused" or None, "foreach": setting == "foreach"}
        super().__init__(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode, **flags)
        #: the adam_kernel choice; None when torch's own ``fused`` flag was given with ``auto``
        self.kernel_switch = attach_switch(self, setting, _SOURCE) if fused is None or setting != "auto" else None
