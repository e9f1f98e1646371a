"""DeepSpeed's ``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`` (Accelerate maps ``torch.optim.Adagrad`` to it under
CPU optimizer offload): ``torch.optim.Adagrad`` with DeepSpeed's signature and defaults (lr 1e-2, eps 1e-10).

DeepSpeed's version is a C++ kernel over the same update; zerospeed's offload runs element-wise torch optimizers on
the host-held shards (zero/optimizer_kinds.py), so torch's Adagrad is the whole of it. ``amsgrad`` is not an Adagrad
option (DeepSpeed refuses it too) and ``fp32_optimizer_states=False`` is refused rather than ignored.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad: amsgrad=True is not an Adagrad option")
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdagrad: fp32_optimizer_states=False is not supported (states are fp32)")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)


__all__ = ["DeepSpeedCPUAdagrad"]
