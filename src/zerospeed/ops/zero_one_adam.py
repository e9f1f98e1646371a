"""0/1 Adam (Lu et al. 2022, DeepSpeed's ``ZeroOneAdam``): Adam whose variance is updated on an exponentially
sparser schedule and frozen after ``var_freeze_step``, with 1-bit compressed communication in between and, once
frozen, local steps synchronised on an exponentially longer schedule.

DeepSpeed 0.19.x's algorithm (``runtime/fp16/onebit/zoadam.py``), per parameter, step ``t`` (one per call):

* step 1 only creates the state (DeepSpeed's initialisation step: the parameters do not move);
* before the freeze, when ``t % var_interval == 0`` the gradient is the group's average (the engine all-reduces
  it, or this optimizer does when used alone): ``v = b2 v + (1-b2) g^2``, ``m = b1 m + (1-b1) g``; on the other
  steps the local gradient goes through the 1-bit compressed all-reduce (:mod:`zerospeed.comm.compressed`, error
  feedback on both sides) and only ``m`` is updated. ``var_interval`` starts at 1 and doubles every
  ``var_update_scaler`` variance updates;
* the update is ``u = m / (sqrt(v) + eps)`` (no bias correction: ``bias_correction`` is accepted and unused, as
  in DeepSpeed), plus ``weight_decay * p``; ``p -= lr * u``;
* frozen (after step ``max(2, var_freeze_step + 1)``; the error buffers are zeroed then): ``m`` takes the local
  gradient, the applied updates accumulate in ``momentum_accumulator`` (``lrs`` sums the learning rates), and
  every ``local_step_interval`` steps the ranks synchronise: undo the local updates, all-reduce the accumulated
  update scaled by ``sqrt(v) + eps`` through the compressed collective, set ``m = -acc / lrs`` and apply
  ``acc / (sqrt(v) + eps)``. The interval doubles every ``local_step_scaler`` steps up to ``local_step_clipper``.

Between two synchronisations parameters and momenta differ per rank (local steps): they, the accumulator and
the error buffers are rank-local state (:mod:`zerospeed.ops.onebit_common`), so an engine checkpoint resumes
bit for bit at the same world size and by the documented rule at another. Differences from DeepSpeed: at world
size 1 the compressed all-reduce is the identity (DeepSpeed skips the momentum update on those steps there), and
a checkpoint keeps the error buffers and the interval counters (DeepSpeed resets both on load).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

from zerospeed.comm import collectives
from zerospeed.comm.compressed import compressed_all_reduce
from zerospeed.ops.onebit_common import RankLocalState, check_common, log_backend, padded_numel

__all__ = ["ZeroOneAdam", "compressed_mean"]


def compressed_mean(t: torch.Tensor, state: dict, world: int, group: Any) -> torch.Tensor:
    """The group's 1-bit compressed mean of ``t`` (fp32, ``t``'s shape) with ``state``'s error buffers (created
    at DeepSpeed's padded size when missing); ``t`` itself is not changed."""
    numel = t.numel()
    padded = padded_numel(numel, world)
    if "worker_error" not in state:
        state["worker_error"] = torch.zeros(padded, dtype=torch.float32, device=t.device)
        state["server_error"] = torch.zeros(padded // world, dtype=torch.float32, device=t.device)
    buf = torch.zeros(padded, dtype=torch.float32, device=t.device)
    buf[:numel] = t.reshape(-1)
    compressed_all_reduce(buf, state["worker_error"], state["server_error"], group)
    return buf[:numel].view(t.shape)


class ZeroOneAdam(RankLocalState, torch.optim.Optimizer):
    rank_local_keys = ("worker_error", "server_error", "momentum_accumulator")

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, var_freeze_step: int = 100000,
                 var_update_scaler: int = 16, local_step_scaler: int = 32678, local_step_clipper: int = 16,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl",
                 group: Any = None) -> None:
        check_common("ZeroOneAdam", betas, amsgrad, eps_inside_sqrt, comm_backend_name,
                     {"var_freeze_step": (var_freeze_step, 0), "var_update_scaler": (var_update_scaler, 1),
                      "local_step_scaler": (local_step_scaler, 1), "local_step_clipper": (local_step_clipper, 1)})
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction, max_grad_norm=max_grad_norm))
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.group = group
        self.engine_reduces = False  # standalone: the optimizer averages the variance steps' gradients itself
        log_backend("ZeroOneAdam", comm_backend_name, cuda_aware, group)

    # -- the engine's view ------------------------------------------------------------------------------

    def bind_data_parallel_group(self, group: Any) -> None:
        """Engine mode (ZeRO stage 0): the engine all-reduces the gradients of the steps that need the average
        (:meth:`communicates_gradients` is False then) and leaves them local otherwise."""
        self.group = group
        self.engine_reduces = True

    def steps_taken(self) -> int:
        return max((int(st.get("step", 0)) for st in self.state.values()), default=0)

    def _first_state(self) -> dict:
        for p in self._all_params():
            if self.state.get(p):
                return self.state[p]
        return {}

    def _frozen_after(self, t: int) -> bool:
        return t >= 2 and t > self.var_freeze_step

    def _next_step_averaged(self) -> bool:
        """DeepSpeed's ``enable_backward_allreduce`` for the next step."""
        t = self.steps_taken()
        if t <= 1:
            return True
        if self._frozen_after(t):
            return False
        return (t + 1) % int(self._first_state().get("var_interval", 1)) == 0

    def communicates_gradients(self) -> bool:
        """True when the next step uses local gradients (the engine then skips its all-reduce)."""
        return not self._next_step_averaged()

    def _world(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def _extra_rank_local(self, i: int, p: torch.Tensor) -> dict[str, torch.Tensor]:
        st = self.state.get(p, {})
        if not self._frozen_after(self.steps_taken()) or "exp_avg" not in st:
            return {}
        return {"exp_avg": st["exp_avg"], "param": p.detach()}  # local steps: they differ per rank

    # -- the step ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        world = self._world()
        t_before = self.steps_taken()
        frozen = self._frozen_after(t_before)
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, var_interval=1, var_counter=0, local_step_interval=1,
                                 local_step_counter=0, lrs=0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    state["momentum_accumulator"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = state["step"]
                if t == 1:  # DeepSpeed's initialisation step
                    continue
                grad = p.grad.detach().float()
                m, v, acc = state["exp_avg"], state["exp_avg_sq"], state["momentum_accumulator"]
                if not frozen:
                    if t % state["var_interval"] == 0:
                        if world > 1 and not self.engine_reduces:
                            grad = grad.clone()
                            collectives.all_reduce(grad, group=self.group)
                            grad.div_(world)
                        v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                        m.mul_(b1).add_(grad, alpha=1 - b1)
                    else:
                        onebit = compressed_mean(grad, state, world, self.group) if world > 1 else grad
                        m.mul_(b1).add_(onebit, alpha=1 - b1)
                else:
                    m.mul_(b1).add_(grad, alpha=1 - b1)
                    state["lrs"] += lr
                target = p if p.dtype == torch.float32 else p.float()
                update = m / (v.sqrt() + eps)
                if wd > 0.0:
                    update += wd * target
                target.add_(-lr * update)
                if frozen:
                    acc.add_(-lr * update)
                if frozen and t % state["local_step_interval"] == 0:
                    target.add_(-1 * acc)
                    acc.mul_(v.sqrt() + eps)
                    if world > 1:
                        acc.copy_(compressed_mean(acc, state, world, self.group))
                    m.zero_().add_(acc / state["lrs"], alpha=-1)
                    target.add_(acc / (v.sqrt() + eps))
                    acc.zero_()
                    state["lrs"] = 0.0
                if target is not p:
                    p.copy_(target)
                if not frozen:
                    if t % state["var_interval"] == 0:
                        state["var_counter"] += 1
                        if state["var_counter"] == self.var_update_scaler:
                            state["var_counter"] = 0
                            state["var_interval"] *= 2
                else:
                    state["local_step_counter"] += 1
                    if state["local_step_counter"] == self.local_step_scaler:
                        state["local_step_counter"] = 0
                        state["local_step_interval"] = min(self.local_step_clipper, state["local_step_interval"] * 2)
        t_after = self.steps_taken()
        if not frozen and self._frozen_after(t_after):  # errors logged so far are of gradients, not momenta
            for st in self.state.values():
                for key in ("worker_error", "server_error"):
                    if key in st:
                        st[key].zero_()
        return loss
