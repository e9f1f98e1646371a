"""Top-1 and top-2 gating with capacity (GShard / Switch semantics, as DeepSpeed-MoE exposes them).

Given ``S`` local tokens and ``E`` experts, a gate returns:

* ``routes``: one :class:`Route` per choice (k of them): for every token its expert, its slot in
  that expert's capacity, its combine weight and whether it kept the slot (1.0) or was dropped
  (0.0). This sparse form is what the layer uses (see :mod:`zerospeed.moe.layer`);
* ``combine_weights`` ``[S, E, C]`` and ``dispatch_mask`` ``[S, E, C]`` (bool), DeepSpeed's dense
  form of the same routing, built from the routes on request (tests and callers that want it);
* ``l_aux``: the load-balancing loss ``E * sum_e mean_s(gates[s, e]) * mean_s(mask1[s, e])`` (top-1;
  top-2 uses ``E * E * mean_e(...)``, DeepSpeed's scaling of the same product), computed from the
  first choice before any token is dropped;
* ``exp_counts`` ``[E]``: tokens routed to each expert before capacity (first and second choices).

Capacity ``C = max(min_capacity, ceil(k * S / E * capacity_factor))``. With ``drop_tokens`` the
tokens past an expert's capacity are dropped (their output is 0, so a residual connection passes
them through); without it ``C`` grows to the largest expert's load, agreed over the expert-parallel
group (a MAX all-reduce) so every rank's all-to-all has the same shape.

Decisions:

* Which tokens keep their slot when an expert is over capacity: with ``use_rts`` (random token
  selection, DeepSpeed's default) a uniformly random subset; without it the first tokens in order.
* ``noisy_gate_policy``: ``"Jitter"`` multiplies the gate's input by U(1-0.01, 1+0.01) in
  training; ``"RSample"`` adds Gumbel noise to the logits used to choose the first expert (top-1).
  For top-2, ``top2_2nd_expert_sampling`` adds Gumbel noise to the logits used to choose the
  second expert. Noise and RTS draw from torch's generator, so seeding makes them reproducible.
* In top-2 (and top-k, ``k > 2``) the gate values are renormalised to sum to 1 over the experts that
  kept the token, as DeepSpeed does; ``renormalize`` forces it on or off (HF Qwen-MoE's
  ``norm_topk_prob=False`` keeps the raw softmax values; HF's top-1 renormalises to 1).
* Gating runs in fp32 whatever the model's dtype (the gate's weight is kept fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed import comm
from zerospeed.zero.init import register_external_parameter

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")


@dataclass
class Route:
    """One choice (first or second expert) of every token: ``expert``, ``slot`` (int64 ``[S]``),
    ``weight`` (the combine weight, differentiable, 0 where dropped) and ``kept`` (1.0 / 0.0)."""

    expert: torch.Tensor
    slot: torch.Tensor
    weight: torch.Tensor
    kept: torch.Tensor


@dataclass
class GateOutput:
    l_aux: torch.Tensor
    routes: tuple[Route, ...]
    exp_counts: torch.Tensor
    capacity: int
    num_experts: int

    def _dense(self, values: list[torch.Tensor]) -> torch.Tensor:
        num_tokens = self.routes[0].expert.shape[0]
        out = values[0].new_zeros(num_tokens, self.num_experts * self.capacity)
        for route, v in zip(self.routes, values):
            out = out.index_put((torch.arange(num_tokens), route.expert * self.capacity + route.slot), v,
                                accumulate=True)
        return out.reshape(num_tokens, self.num_experts, self.capacity)

    @property
    def combine_weights(self) -> torch.Tensor:
        """``[S, E, C]``: the weight of token ``s``'s output from slot ``c`` of expert ``e``."""
        return self._dense([r.weight * r.kept for r in self.routes])

    @property
    def dispatch_mask(self) -> torch.Tensor:
        """``[S, E, C]`` bool: where each token is sent."""
        return self._dense([r.kept for r in self.routes]).bool()


def capacity_of(num_tokens: int, num_experts: int, k: int, capacity_factor: float, min_capacity: int) -> int:
    return max(int(min_capacity), int(math.ceil(k * num_tokens / num_experts * capacity_factor)))


def _gumbel(shape: torch.Size, device: torch.device) -> torch.Tensor:
    u = torch.rand(shape, device=device).clamp_(1e-10, 1.0 - 1e-7)
    return -torch.log(-torch.log(u))


def _keep_within_capacity(mask: torch.Tensor, capacity: int, use_rts: bool) -> torch.Tensor:
    """``mask`` [S, E] with at most ``capacity`` ones per expert (column)."""
    if use_rts:
        score = mask * torch.rand(mask.shape, device=mask.device)
        k = min(capacity, mask.shape[0])
        top = torch.topk(score, k=k, dim=0).indices
        keep = torch.zeros_like(mask).scatter_(0, top, 1.0)
        return mask * keep
    return mask * (torch.cumsum(mask, dim=0) <= capacity).to(mask.dtype)


def _agreed_capacity(needed: int, ep_group: object) -> int:
    t = torch.tensor([needed], dtype=torch.int64)
    comm.all_reduce(t, op=comm.ReduceOp.MAX, group=ep_group)
    return int(t.item())


def top1gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, noisy_gate_policy: str | None = None,
               drop_tokens: bool = True, use_rts: bool = True, ep_group: object = None,
               renormalize: bool = False, used_token: torch.Tensor | None = None) -> GateOutput:
    """``used_token`` ``[S]`` (1 / 0): tokens with 0 go to no expert (padding; DeepSpeed's mask)."""
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    choose = logits + _gumbel(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    indices1 = torch.argmax(choose, dim=1)
    mask1 = F.one_hot(indices1, num_experts).to(gates.dtype)
    if used_token is not None:
        mask1 = mask1 * used_token.to(mask1.dtype)[:, None]
    exp_counts = mask1.sum(dim=0).detach().to(torch.int64)
    l_aux = torch.sum(gates.mean(dim=0) * mask1.mean(dim=0)) * num_experts
    if drop_tokens:
        capacity = capacity_of(num_tokens, num_experts, 1, capacity_factor, min_capacity)
        mask1 = _keep_within_capacity(mask1, capacity, use_rts)
    else:
        capacity = _agreed_capacity(max(1, int(exp_counts.max().item())), ep_group)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    loc1 = (locations1 * mask1).sum(dim=1).to(torch.int64)
    kept1 = mask1.sum(dim=1)
    gate1 = (gates * mask1).sum(dim=1)
    if renormalize:  # the one kept expert gets weight 1 (HF's top-1 with normalised top-k weights)
        gate1 = gate1 / gate1.clamp(min=torch.finfo(gates.dtype).eps)
    return GateOutput(l_aux, (Route(indices1, loc1, gate1, kept1),), exp_counts, capacity, num_experts)


def top2gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               top2_2nd_expert_sampling: bool = True, ep_group: object = None, renormalize: bool = True) -> GateOutput:
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    indices1 = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(indices1, num_experts).to(gates.dtype)
    second = logits + _gumbel(logits.shape, logits.device) if top2_2nd_expert_sampling else logits
    indices2 = torch.argmax(second.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(indices2, num_experts).to(gates.dtype)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    l_aux = torch.mean(gates.mean(dim=0) * mask1.mean(dim=0)) * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach().to(torch.int64)
    if drop_tokens:
        capacity = capacity_of(num_tokens, num_experts, 2, capacity_factor, min_capacity)
        mask1 = mask1 * (locations1 < capacity).to(mask1.dtype)
        mask2 = mask2 * (locations2 < capacity).to(mask2.dtype)
    else:
        capacity = _agreed_capacity(max(1, int(exp_counts.max().item())), ep_group)
    loc1 = (locations1 * mask1).sum(dim=1).to(torch.int64)
    loc2 = (locations2 * mask2).sum(dim=1).to(torch.int64)
    gate1 = (gates * mask1).sum(dim=1)
    gate2 = (gates * mask2).sum(dim=1)
    if renormalize:
        denom = (gate1 + gate2).clamp(min=torch.finfo(gates.dtype).eps)
        gate1, gate2 = gate1 / denom, gate2 / denom
    routes = (Route(indices1, loc1, gate1, mask1.sum(dim=1)), Route(indices2, loc2, gate2, mask2.sum(dim=1)))
    return GateOutput(l_aux, routes, exp_counts, capacity, num_experts)


def topkgating(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: object = None, renormalize: bool = True) -> GateOutput:
    """Top-k gating for any ``k`` (DeepSpeed uses it above 2): each token goes to the ``k`` experts of
    highest gate value. With ``drop_tokens`` an over-full expert keeps the tokens that want it most
    (highest gate value: DeepSpeed's ``drop_policy="probs"``); slots are then numbered in token order.
    ``l_aux = E * E / k * mean_e(mean_s(gates) * mean_s(mask))`` over all ``k`` choices."""
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates).scatter_(1, top_idx, 1.0)
    exp_counts = mask.sum(dim=0).detach().to(torch.int64)
    l_aux = torch.mean(gates.mean(dim=0) * mask.mean(dim=0)) * num_experts * num_experts / k
    if drop_tokens:
        capacity = capacity_of(num_tokens, num_experts, k, capacity_factor, min_capacity)
        wanted = torch.zeros_like(gates).scatter(1, top_idx, top_gate.detach())
        keep_rows = torch.topk(wanted, k=min(capacity, num_tokens), dim=0).indices
        mask = mask * torch.zeros_like(mask).scatter_(0, keep_rows, 1.0)
    else:
        capacity = _agreed_capacity(max(1, int(exp_counts.max().item())), ep_group)
    locations = torch.cumsum(mask, dim=0) - 1
    weights = gates * mask
    if renormalize:
        weights = weights / weights.sum(dim=1, keepdim=True).clamp(min=torch.finfo(gates.dtype).eps)
    routes = []
    for j in range(k):
        expert = top_idx[:, j]
        kept = mask.gather(1, expert[:, None]).squeeze(1)
        slot = (locations.gather(1, expert[:, None]).squeeze(1) * kept).to(torch.int64)
        routes.append(Route(expert, slot, weights.gather(1, expert[:, None]).squeeze(1), kept))
    return GateOutput(l_aux, tuple(routes), exp_counts, capacity, num_experts)


class TopKGate(nn.Module):
    """The router: a bias-free fp32 linear layer to ``num_experts`` logits, then top-k gating.

    ``wg`` is DeepSpeed's parameter name (``deepspeed_moe.gate.wg.weight`` in checkpoints).
    """

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 4, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, top2_2nd_expert_sampling: bool = True,
                 renormalize: bool | None = None) -> None:
        super().__init__()
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
            raise ValueError(f"MoE: k={k!r} must be an integer between 1 and num_experts={num_experts}")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"MoE: noisy_gate_policy={noisy_gate_policy!r} is not one of None, 'Jitter', 'RSample'")
        self.wg = nn.Linear(model_dim, num_experts, bias=False).float()
        # the forward reads wg.weight without calling wg: tell ZeRO-3 to gather it around this forward
        register_external_parameter(self, self.wg.weight)
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        #: the kept experts' weights divided by their sum; None: DeepSpeed's choice (top-1 no, top-k>1 yes)
        self.renormalize = renormalize
        self.ep_group: object = None  # set by the MoE layer (capacity agreement without dropping)

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None = None) -> GateOutput:
        """``x`` [S, M] tokens -> :class:`GateOutput`; ``used_token`` [S] masks tokens out (top-1 only)."""
        if used_token is not None and self.k != 1:
            raise ValueError(f"MoE: used_token masks apply to top-1 gating only (as in DeepSpeed); k={self.k}")
        x = x.float()
        if self.training and self.noisy_gate_policy == "Jitter":
            x = x * torch.empty_like(x).uniform_(1.0 - 1e-2, 1.0 + 1e-2)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        renormalize = self.k > 1 if self.renormalize is None else self.renormalize
        if self.k == 1:
            return top1gating(logits, factor, self.min_capacity,
                              self.noisy_gate_policy if self.training else None, self.drop_tokens,
                              self.use_rts, self.ep_group, renormalize, used_token)
        if self.k == 2:
            return top2gating(logits, factor, self.min_capacity, self.drop_tokens,
                              self.top2_2nd_expert_sampling and self.training, self.ep_group, renormalize)
        return topkgating(logits, self.k, factor, self.min_capacity, self.drop_tokens, self.ep_group, renormalize)
