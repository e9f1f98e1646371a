"""1-bit LAMB (Li et al. 2021, DeepSpeed's ``OneBitLamb``): LAMB whose momenta are all-reduced at 1 bit per
element after a warm-up, with the layer-wise LAMB coefficients frozen and rescaled by how much the fresh variance
moved.

DeepSpeed 0.19.x's algorithm (``runtime/fp16/onebit/lamb.py``), step ``t`` (one per call):

* step 1 only creates the state (DeepSpeed's initialisation step: the parameters do not move);
* warm-up (``t`` up to ``freeze_step``): plain LAMB on the group's averaged gradient, without bias correction
  (``bias_correction`` is accepted and unused, as in DeepSpeed): ``m = b1 m + (1-b1) g``,
  ``v = b2 v + (1-b2) g^2``, ``u = m / (sqrt(v) + eps) + weight_decay * p``, coefficient
  ``c = clamp(||p|| / ||u||, min_coeff, max_coeff)`` (1 when either norm is 0), ``p -= lr * c * u``; each
  ``c != 1`` feeds ``lamb_coeff_freeze = coeff_beta * lamb_coeff_freeze + (1 - coeff_beta) * c``; at
  ``freeze_step`` the variance is copied into ``exp_avg_sq_fresh``;
* compression (after the step that reaches ``freeze_step``): at its first step every momentum gets
  ``scaling_coeff = mean_k(rms(m_k)) / rms(m)`` (one scale for all layers, so one compressed buffer suits them);
  each rank updates ``m`` with its local gradient, scales it, and all the momenta, concatenated and padded, go
  through one 1-bit compressed all-reduce (:mod:`zerospeed.comm.compressed`, error feedback on both sides; the
  padding keeps its values between steps, as DeepSpeed's flat buffer does); then ``m`` is unscaled, the gradient
  reconstructed as ``(m - b1 m_prev) / (1 - b1)`` updates ``exp_avg_sq_fresh``, and the frozen coefficient is
  scaled by ``factor = max((sqrt(v) + eps) / (sqrt(v_fresh) + eps))`` (blended towards 1 by the share of weight
  decay in the update, clamped to ``[factor_min, factor_max]`` and to within ``factor_threshold`` of the last
  factor): ``p -= lr * lamb_coeff_freeze * factor * u`` with the frozen ``v`` in ``u``.

Every rank decodes the same momenta, so parameters stay identical. The error buffers (and the padding) are the
rank-local state of the first parameter (:mod:`zerospeed.ops.onebit_common`): an engine checkpoint resumes bit for
bit at the same world size and by the documented rule at another (DeepSpeed drops them on load). Differences:
at world size 1 the compressed all-reduce is the identity; a momentum that is all zeros at the end of warm-up
gets ``scaling_coeff`` 1 (DeepSpeed divides by its zero norm).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

from zerospeed.comm import collectives
from zerospeed.comm.compressed import compressed_all_reduce
from zerospeed.ops.onebit_common import RankLocalState, check_common, log_backend, padded_numel

__all__ = ["OneBitLamb"]


class OneBitLamb(RankLocalState, torch.optim.Optimizer):
    rank_local_keys = ("worker_error", "server_error", "momentum_pad")
    #: the momenta are compressed as one buffer in parameter order: ZeRO-0 keeps the order the user gave
    order_sensitive = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, freeze_step: int = 100000, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", coeff_beta: float = 0.9, factor_max: float = 4.0,
                 factor_min: float = 0.5, factor_threshold: float = 0.1, group: Any = None) -> None:
        check_common("OneBitLamb", betas, amsgrad, eps_inside_sqrt, comm_backend_name, {"freeze_step": (freeze_step, 0)})
        if not min_coeff <= max_coeff:
            raise ValueError(f"OneBitLamb: min_coeff {min_coeff} is above max_coeff {max_coeff}")
        if not factor_min <= factor_max:
            raise ValueError(f"OneBitLamb: factor_min {factor_min} is above factor_max {factor_max}")
        if not 0.0 <= coeff_beta < 1.0:
            raise ValueError(f"OneBitLamb: coeff_beta must be in [0, 1), got {coeff_beta!r}")
        if not 0.0 <= factor_threshold:
            raise ValueError(f"OneBitLamb: factor_threshold must be >= 0, got {factor_threshold!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction, max_grad_norm=max_grad_norm,
                                      max_coeff=max_coeff, min_coeff=min_coeff))
        self.freeze_step = freeze_step
        self.coeff_beta = coeff_beta
        self.factor_max = factor_max
        self.factor_min = factor_min
        self.factor_threshold = factor_threshold
        self.group = group
        self.engine_reduces = False
        #: the coefficients of the last step, one per parameter (DeepSpeed's get_lamb_coeffs())
        self.lamb_coeffs: list[float] = []
        log_backend("OneBitLamb", comm_backend_name, cuda_aware, group)

    def bind_data_parallel_group(self, group: Any) -> None:
        """Engine mode (ZeRO stage 0): the engine averages the warm-up gradients, then sends nothing."""
        self.group = group
        self.engine_reduces = True

    def steps_taken(self) -> int:
        return max((int(st.get("step", 0)) for st in self.state.values()), default=0)

    def _compressing(self, t: int) -> bool:
        """Whether step ``t + 1`` compresses (DeepSpeed's ``lamb_freeze_key`` after step ``t``)."""
        return t >= 2 and t >= self.freeze_step

    def communicates_gradients(self) -> bool:
        return self._compressing(self.steps_taken())

    def get_lamb_coeffs(self) -> list[float]:
        return self.lamb_coeffs

    def _world(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def _error_length(self, p: torch.Tensor) -> int:
        return sum(q.numel() for q in self._all_params())  # the buffer is all the momenta

    # -- the step ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        world = self._world()
        t_before = self.steps_taken()
        compressing = self._compressing(t_before)
        params = self._all_params()
        if compressing:
            last = {p: self.state[p]["exp_avg"].clone() for p in params}
            if "scaling_coeff" not in self.state[params[0]]:
                rms = [(torch.norm(self.state[p]["exp_avg"]) / (self.state[p]["exp_avg"].numel() ** 0.5)).item()
                       for p in params]
                united = sum(rms) / len(rms)
                for p, s in zip(params, rms):
                    self.state[p]["scaling_coeff"] = united / s if s != 0 else 1.0
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    state.update(step=0, lamb_coeff_freeze=0.0, last_factor=1.0)
                    for key in ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh"):
                        state[key] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = state["step"]
                if t == 1:  # DeepSpeed's initialisation step
                    continue
                grad = p.grad.detach().float()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if compressing:
                    m.mul_(b1).add_(grad, alpha=1 - b1)
                    m.mul_(state["scaling_coeff"])
                    continue
                if world > 1 and not self.engine_reduces:
                    grad = grad.clone()
                    collectives.all_reduce(grad, group=self.group)
                    grad.div_(world)
                m.mul_(b1).add_(grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                if t == self.freeze_step:
                    state["exp_avg_sq_fresh"] = v.detach().clone()
                target = p if p.dtype == torch.float32 else p.float()
                weight_norm = target.pow(2).sum().sqrt()
                update = m / (v.sqrt() + group["eps"])
                if group["weight_decay"] > 0.0:
                    update += group["weight_decay"] * target
                update_norm = update.pow(2).sum().sqrt()
                coeff = 1.0
                if weight_norm != 0 and update_norm != 0:
                    coeff = min(max((weight_norm / update_norm).item(), group["min_coeff"]), group["max_coeff"])
                if coeff != 1.0:
                    state["lamb_coeff_freeze"] = self.coeff_beta * state["lamb_coeff_freeze"] + \
                        (1 - self.coeff_beta) * coeff
                self.lamb_coeffs.append(coeff)
                target.add_(-group["lr"] * coeff * update)
                if target is not p:
                    p.copy_(target)
        if compressing and self.steps_taken() > 1:
            self._exchange(params, world)
            self._compressed_update(params, last)
        return loss

    def _exchange(self, params: list[torch.Tensor], world: int) -> None:
        """All momenta (and the persistent padding) through one compressed all-reduce, in place."""
        if world == 1:
            return
        numel = sum(p.numel() for p in params)
        first = self.state[params[0]]
        padded = padded_numel(numel, world)
        device = first["exp_avg"].device
        if "worker_error" not in first:
            first["worker_error"] = torch.zeros(padded, dtype=torch.float32, device=device)
            first["server_error"] = torch.zeros(padded // world, dtype=torch.float32, device=device)
        if first.get("momentum_pad") is None or first["momentum_pad"].numel() != padded - numel:
            first["momentum_pad"] = torch.zeros(padded - numel, dtype=torch.float32, device=device)  # new layout
        flat = torch.cat([self.state[p]["exp_avg"].reshape(-1) for p in params] + [first["momentum_pad"].reshape(-1)])
        compressed_all_reduce(flat, first["worker_error"], first["server_error"], self.group)
        offset = 0
        for p in params:
            m = self.state[p]["exp_avg"]
            m.view(-1).copy_(flat[offset:offset + m.numel()])
            offset += m.numel()
        first["momentum_pad"].view(-1).copy_(flat[offset:])

    def _compressed_update(self, params: list[torch.Tensor], last: dict) -> None:
        for group in self.param_groups:
            b1, b2 = group["betas"]
            eps, wd, lr = group["eps"], group["weight_decay"], group["lr"]
            for p in group["params"]:
                state = self.state[p]
                m, v, fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
                m.div_(state["scaling_coeff"])
                grad_reconstruct = (m - last[p] * b1) / (1 - b1)
                fresh.mul_(b2).addcmul_(grad_reconstruct, grad_reconstruct, value=1 - b2)
                target = p if p.dtype == torch.float32 else p.float()
                denom = v.sqrt() + eps
                update_prelim = m / denom
                update = update_prelim + wd * target if wd > 0.0 else update_prelim
                update_norm = update.pow(2).sum().sqrt()
                denom_real = fresh.sqrt() + eps
                factor = (denom / denom_real).max().item()
                if wd > 0.0:
                    ratio = min(1.0, (update_prelim.pow(2).sum().sqrt() / update_norm).item())
                    factor = factor * ratio + (1.0 - ratio)
                factor = min(max(factor, self.factor_min), self.factor_max)
                factor = min(factor, state["last_factor"] * (1.0 + self.factor_threshold))
                factor = max(factor, state["last_factor"] * (1.0 - self.factor_threshold))
                state["last_factor"] = factor
                coeff = state["lamb_coeff_freeze"] * factor
                self.lamb_coeffs.append(coeff)
                target.add_(-lr * coeff * update)
                if target is not p:
                    p.copy_(target)
