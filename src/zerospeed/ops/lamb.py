"""LAMB with DeepSpeed's ``FusedLamb`` semantics, in plain PyTorch (any device, vectorised).

What DeepSpeed computes (``deepspeed/ops/lamb/fused_lamb.py`` and the kernel
``csrc/lamb/fused_lamb_cuda_kernel.cu``, read with the search tool), per parameter tensor ``w``::

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat = m / (1 - beta1**step)      v_hat = v / (1 - beta2**step)   (only with bias_correction)
    denom = sqrt(v_hat) + eps          (eps_inside_sqrt=True: sqrt(v_hat + eps))
    update = m_hat / denom + weight_decay * w
    ratio = clamp(||w|| / ||update||, min_coeff, max_coeff), or 1 when either norm is 0
    w = w - lr * ratio * update

Defaults are FusedLamb's: ``lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
eps_inside_sqrt=False, weight_decay=0, max_grad_norm=0, max_coeff=10, min_coeff=0.01``;
``amsgrad=True`` is refused, as FusedLamb refuses it.

Decisions:

* The trust ratio is per tensor of ``param_groups``: when ZeRO hands this optimizer flat shards,
  the ratio is per shard, the same as DeepSpeed's FusedLamb on its flattened groups.
* State per tensor is ``step`` (int), ``exp_avg``, ``exp_avg_sq`` in the parameter's dtype, the keys
  FusedLamb uses, so optimizer checkpoints carry over; ``state_dict()`` is torch's.
* ``max_grad_norm > 0`` divides the gradients by ``(group_grad_norm + 1e-6) / max_grad_norm`` when
  that exceeds 1, FusedLamb's formula with the norm taken over the param group here (FusedLamb
  expects the caller to pass it). The zerospeed factory does not expose it: DeepSpeed's engine
  rejects ``max_grad_norm`` in the optimizer config in favour of ``gradient_clipping``.
* Tensors are bucketed by (device, dtype) and each bucket is updated with ``torch._foreach_*``
  ops; the ratios are computed as one tensor, so a step does not synchronise with the device
  (a tensor ``lr`` is read with ``float()``, which does).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["Lamb"]


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms of half-precision tensors are accumulated in fp32 (their squares overflow fp16)."""
    return torch.promote_types(dtype, torch.float32)


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al., 2019, https://arxiv.org/abs/1904.00962) as DeepSpeed's FusedLamb runs it."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError("Lamb does not support the AMSGrad variant (neither does DeepSpeed's FusedLamb)")
        if not 0.0 <= float(lr):
            raise ValueError(f"invalid learning rate: {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid betas: {betas}; need two values in [0, 1)")
        if not 0.0 <= eps:
            raise ValueError(f"invalid eps: {eps}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"invalid weight_decay: {weight_decay}")
        if not 0.0 <= max_grad_norm:
            raise ValueError(f"invalid max_grad_norm: {max_grad_norm}")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(
                f"invalid trust-ratio bounds: need 0 <= min_coeff ({min_coeff}) <= max_coeff ({max_coeff})"
            )
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self._last_coeffs: list[tuple[list[int], torch.Tensor]] = []

    def get_lamb_coeffs(self) -> list[float]:
        """Trust ratios of the latest step, in param-group order (FusedLamb's method name)."""
        coeffs: dict[int, float] = {}
        for indices, ratios in self._last_coeffs:
            coeffs.update(zip(indices, ratios.tolist()))
        return [coeffs[i] for i in sorted(coeffs)]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._last_coeffs = []
        position = 0
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            if not with_grad:
                continue
            if any(p.grad.is_sparse for p in with_grad):
                raise RuntimeError("Lamb does not support sparse gradients")
            clip = self._clip_factor(with_grad, group["max_grad_norm"])
            buckets: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
            for i, p in enumerate(with_grad):
                buckets[(p.device, p.dtype)].append(i)
            for indices in buckets.values():
                params = [with_grad[i] for i in indices]
                ratios = self._update_bucket(group, params, clip)
                self._last_coeffs.append(([position + i for i in indices], ratios))
            position += len(with_grad)
        return loss

    @staticmethod
    def _clip_factor(params: list[torch.Tensor], max_grad_norm: float) -> torch.Tensor | None:
        """FusedLamb's divisor ``max(1, (||g|| + 1e-6) / max_grad_norm)`` over the group, or None."""
        if max_grad_norm <= 0:
            return None
        device = params[0].grad.device
        norms = [
            torch.linalg.vector_norm(p.grad, dtype=_norm_dtype(p.grad.dtype)).to(device, torch.float32)
            for p in params
        ]
        total = torch.linalg.vector_norm(torch.stack(norms))
        return torch.clamp((total + 1e-6) / max_grad_norm, min=1.0)

    def _update_bucket(
        self, group: dict[str, Any], params: list[torch.Tensor], clip: torch.Tensor | None
    ) -> torch.Tensor:
        """Apply one LAMB step to tensors of one device and dtype; return their trust ratios."""
        beta1, beta2 = group["betas"]
        grads = [p.grad for p in params]
        if clip is not None:
            grads = torch._foreach_div(grads, clip.to(params[0].device, params[0].dtype))
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if len(state) == 0:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])

        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

        if group["bias_correction"]:
            bc1 = [1.0 - beta1**s for s in steps]
            bc2 = [1.0 - beta2**s for s in steps]
        else:
            bc1 = bc2 = [1.0] * len(steps)
        denom = torch._foreach_div(exp_avg_sqs, bc2)
        if group["eps_inside_sqrt"]:
            torch._foreach_add_(denom, group["eps"])
            torch._foreach_sqrt_(denom)
        else:
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, group["eps"])
        update = torch._foreach_div(exp_avgs, bc1)
        torch._foreach_div_(update, denom)
        del denom
        if group["weight_decay"] != 0:
            torch._foreach_add_(update, params, alpha=group["weight_decay"])

        norm_dtype = _norm_dtype(params[0].dtype)
        w_norm = torch.stack(torch._foreach_norm(params, 2, dtype=norm_dtype))
        u_norm = torch.stack(torch._foreach_norm(update, 2, dtype=norm_dtype))
        ratios = torch.where(
            (w_norm > 0) & (u_norm > 0),
            (w_norm / u_norm).clamp(min=group["min_coeff"], max=group["max_coeff"]),
            torch.ones_like(w_norm),
        )
        torch._foreach_mul_(update, list(ratios.to(params[0].dtype).unbind(0)))
        torch._foreach_add_(params, update, alpha=-float(group["lr"]))
        return ratios
