"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): DeepSpeed's ``optimizer.type: "Lion"``.

Facts from DeepSpeed 0.19.8 (``ops/lion/fused_lion.py``, ``ops/lion/cpu_lion.py``, ``csrc/lion/``): defaults
``lr=1e-3, betas=(0.9, 0.999), weight_decay=0``; state ``exp_avg``; per element::

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * wd) - lr * sign(c)       # decoupled decay
    m = beta2 * m + (1 - beta2) * g

Where ``c`` is exactly zero DeepSpeed's two kernels disagree (CUDA: ``c > 0 ? -lr : lr`` moves by +lr; CPU:
``-copysign(lr, c)`` moves by -lr for +0.0); zerospeed uses ``sign(0) = 0`` (no move), as the paper does.
Element-wise, so it runs on ZeRO's flat shards at every stage.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

__all__ = ["DeepSpeedCPULion", "Lion"]


class Lion(torch.optim.Optimizer):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, set_grad_none: bool = True) -> None:
        if lr < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion: invalid lr {lr}, betas {betas} or weight_decay {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                c = m.mul(beta1).add_(g, alpha=1 - beta1)
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(c.sign_(), alpha=-lr)
                m.mul_(beta2).add_(g, alpha=1 - beta2)
        return loss


class DeepSpeedCPULion(Lion):
    """DeepSpeed's ``deepspeed.ops.lion.DeepSpeedCPULion`` (Accelerate maps ``torch`` Lion to it under CPU offload):
    :class:`Lion`, whose states are fp32 (``fp32_optimizer_states=False`` is refused rather than ignored)."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, fp32_optimizer_states: bool = True) -> None:
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPULion: fp32_optimizer_states=False is not supported (states are fp32)")
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
