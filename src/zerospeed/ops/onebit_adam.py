"""1-bit Adam (Tang et al. 2021, DeepSpeed's ``OneBitAdam``): Adam whose momentum is all-reduced at 1 bit per
element after a warm-up, with error feedback.

The optimizer owns the data-parallel communication of its parameters (call it on *local* gradients, with no
other gradient all-reduce):

* warm-up (steps ``1 .. freeze_step``): the gradients are averaged over ``group`` (one all-reduce per parameter)
  and the step is plain Adam, the very arithmetic of ``torch.optim.Adam(foreach=False)`` (``exp_avg.lerp_``,
  ``exp_avg_sq.mul_().addcmul_()``, ``addcdiv_`` with the bias corrections), so warm-up equals it exactly;
* after: the variance ``exp_avg_sq`` is frozen (and so is its bias correction, at ``freeze_step``); each rank
  updates its momentum with its local gradient, ``exp_avg = b1 exp_avg + (1 - b1) g``, and replaces it by the
  group's compressed mean (:func:`zerospeed.comm.compressed.compressed_all_reduce`: signs packed 8 per byte, one
  scale per rank and chunk, worker and server error feedback); the update is ``exp_avg / bc1 / (sqrt(v)/sqrt(bc2)
  + eps)``. Every rank then holds the same momentum, so parameters stay identical across ranks.

``weight_decay`` is added to the update (``update + weight_decay * p``, DeepSpeed's 1-bit Adam convention, not
L2 in the gradient). The error buffers are optimizer state (``worker_error`` the padded size of the parameter,
``server_error`` this rank's 1/world of it), padded as DeepSpeed pads (:func:`~zerospeed.ops.onebit_common.padded_numel`).
With ``optimizer.state_dict()`` a resume at the same world size continues bit for bit; at another world size they
restart from zero. Through the engine they are rank-local state (:mod:`zerospeed.ops.onebit_common`): each rank's
are written to its own file, and a load continues bit for bit at the same world size and reshards them by the
documented rule at another (DeepSpeed resets them on every load). ``cuda_aware`` and ``comm_backend_name``
("nccl", "mpi", "hccl") choose DeepSpeed's transport; here the group's own backend carries the messages (one log
line says so).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
import torch.distributed as dist

from zerospeed.comm import collectives
from zerospeed.comm.compressed import compressed_all_reduce
from zerospeed.ops.onebit_common import RankLocalState, padded_numel

__all__ = ["OneBitAdam"]

logger = logging.getLogger(__name__)

_BACKENDS = ("nccl", "mpi", "hccl")


class OneBitAdam(RankLocalState, torch.optim.Optimizer):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, freeze_step: int = 100000,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 bias_correction: bool = True, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", eps_inside_sqrt: bool = False, group: Any = None) -> None:
        if eps_inside_sqrt:
            raise ValueError("OneBitAdam: eps_inside_sqrt=True is not supported (eps is added after the square root)")
        if amsgrad:
            raise ValueError("OneBitAdam: amsgrad=True is not supported (nor by DeepSpeed's 1-bit Adam)")
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 0:
            raise ValueError(f"OneBitAdam: freeze_step must be an int >= 0, got {freeze_step!r}")
        if comm_backend_name not in _BACKENDS:
            raise ValueError(f"OneBitAdam: comm_backend_name {comm_backend_name!r} is not one of {list(_BACKENDS)}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"OneBitAdam: betas must be in [0, 1), got {betas!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction))
        self.freeze_step = freeze_step
        self.group = group
        self.engine_reduces_warmup = False  # standalone: the optimizer averages warm-up gradients itself
        if dist.is_initialized() and dist.get_rank() == 0:
            logger.info("OneBitAdam: comm_backend_name %r (cuda_aware=%s) maps to the data-parallel group's own "
                        "backend (%s)", comm_backend_name, cuda_aware, dist.get_backend(group))

    def bind_data_parallel_group(self, group: Any) -> None:
        """Engine mode (ZeRO stage 0): ``group`` is the data-parallel group; during warm-up the engine averages the
        gradients (its usual all-reduce), after it the engine skips that all-reduce
        (:meth:`communicates_gradients`) and this optimizer compresses the momentum."""
        self.group = group
        self.engine_reduces_warmup = True

    def communicates_gradients(self) -> bool:
        """Whether the next step exchanges the momentum itself (after warm-up): the engine then sends nothing."""
        return self.steps_taken() >= self.freeze_step

    def steps_taken(self) -> int:
        """Steps so far, read from the per-parameter state (so a checkpoint's state carries it)."""
        return max((int(st.get("step", 0)) for st in self.state.values()), default=0)

    def _world(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def _padded(self, numel: int) -> int:
        return padded_numel(numel, self._world())

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        world = self._world()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = state["step"]
                grad = p.grad.detach().float()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if t <= self.freeze_step:
                    if world > 1 and not self.engine_reduces_warmup:
                        grad = grad.clone()
                        collectives.all_reduce(grad, group=self.group)
                        grad.div_(world)
                    m.lerp_(grad, 1 - b1)
                    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                else:
                    m.mul_(b1).add_(grad, alpha=1 - b1)
                    self._compress(state, m, world)
                bc_t = t if t <= self.freeze_step else self.freeze_step
                bc1 = 1 - b1 ** t if group["bias_correction"] else 1.0
                bc2 = 1 - b2 ** max(bc_t, 1) if group["bias_correction"] else 1.0
                step_size = group["lr"] / bc1
                denom = (v.sqrt() / bc2 ** 0.5).add_(group["eps"])
                target = p if p.dtype == torch.float32 else p.float()
                if group["weight_decay"]:
                    target.add_(target, alpha=-group["lr"] * group["weight_decay"])
                target.addcdiv_(m, denom, value=-step_size)
                if target is not p:
                    p.copy_(target)
        return loss

    def _compress(self, state: dict, m: torch.Tensor, world: int) -> None:
        numel = m.numel()
        padded = self._padded(numel)
        if "worker_error" not in state or state["worker_error"].numel() != padded:
            state["worker_error"] = torch.zeros(padded, dtype=torch.float32, device=m.device)
            state["server_error"] = torch.zeros(padded // world, dtype=torch.float32, device=m.device)
        buf = torch.zeros(padded, dtype=torch.float32, device=m.device)
        buf[:numel] = m.reshape(-1)
        compressed_all_reduce(buf, state["worker_error"], state["server_error"], self.group)
        m.view(-1).copy_(buf[:numel])

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        world = self._world()
        for state in self.state.values():  # error buffers of another world size: restart them from zero
            err = state.get("server_error")
            if err is not None and err.numel() * world != state["worker_error"].numel():
                state.pop("worker_error")
                state.pop("server_error")
