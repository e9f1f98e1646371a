"""``zerospeed.moe.layer.MoE``: DeepSpeed's mixture-of-experts layer, with expert parallelism.

``MoE(hidden_size, expert, num_experts, ep_size, k, ...)`` replaces a dense FFN: its forward takes
``[..., hidden_size]`` and returns ``(output, l_aux, exp_counts)`` as DeepSpeed's does. Add
``l_aux`` (times a coefficient such as 0.01) to the loss to balance the experts' load.

Data flow (``S`` local tokens, ``E`` experts, ``ep`` expert-parallel ranks, capacity ``C``):
gate -> dispatch ``[E, C, M]`` (tokens added into their slots) -> all-to-all over the
expert-parallel group (rank ``j`` receives every rank's slots for its experts
``j*E/ep .. (j+1)*E/ep - 1``) -> local experts on ``[E/ep, ep*C, M]`` -> all-to-all back ->
combine (each token gathers its k slots, weighted by its gates). Both all-to-alls go through :mod:`zerospeed.comm`, so
they are counted: ``E*C*M`` elements each way per forward (``k*S*M`` with capacity factor 1 when
``S*k`` divides evenly), and the same again in backward.

Decisions:

* Expert ``g`` lives on expert-parallel rank ``g // (E/ep)`` as its local expert ``g % (E/ep)``:
  DeepSpeed's placement. Parameter names carry the global index (``deepspeed_experts.<g>.``), so
  checkpoints, addressed by name, load at any expert-parallel degree (see
  :mod:`zerospeed.moe.experts`).
* Expert parameters are marked in :mod:`zerospeed.moe.registry` with the group name
  ``ep_size_<ep>``; their gradients are reduced over the expert-data-parallel group only (see
  :mod:`zerospeed.moe.groups`).
* Dispatch and combine are index operations over the gate's sparse routes (``index_add`` of the
  ``S*k`` routed tokens into their slots, ``index_select`` of the ``S*k`` slots back; DeepSpeed
  0.19.8 routes sparsely too), not GShard's einsums with dense ``[S, E, C]`` masks (earlier
  DeepSpeed versions): those are matmuls of ``S*E*C*M``
  multiply-adds each (as many as the experts' own compute at top-2, capacity 1.25), these move
  ``S*k*M`` elements. The results are the same sums; dropped tokens add zeros.
* ``use_residual`` (Residual-MoE): a dense copy of the expert runs on every token and the two
  outputs are mixed by a learned 2-way softmax coefficient, DeepSpeed's formulation.
* ``k`` may be any number of experts up to ``num_experts`` (DeepSpeed's top-k gating above 2).
  Two arguments are zerospeed's own: ``grouped_experts`` (see :mod:`zerospeed.moe.experts`) and
  ``renormalize_topk`` (None: DeepSpeed's weights; True / False: the kept experts' gate values are /
  are not divided by their sum, for HF routers that say so).
* With the current mesh's tensor-parallel degree ``tp > 1`` every tp rank holds the same tokens.
  With ``ep_size > 1`` each tp rank sends only its ``1/tp`` of the capacity slots through the
  all-to-all and the slices are all-gathered over tp right after it, before the experts and again
  before the combine (:mod:`zerospeed.moe.tp_tokens`; DeepSpeed's drop / gather of the tp ranks'
  duplicate tokens). All-to-all: ``E*C'*M/tp`` elements each way per forward, ``C'`` the capacity
  rounded up to a multiple of tp (the extra slots stay empty), instead of ``E*C*M``.
* ``enable_expert_tensor_parallelism`` (with ``tp > 1``): each expert's FFN is split over the
  mesh's tp group (:func:`zerospeed.module_inject.split_expert_ffn`: column-parallel input layers,
  row-parallel output layer all-reduced over tp); each tp rank holds its own piece of every local
  expert. Without it the experts are replicated over the tp group and every tp rank runs them on
  the gathered slots: DeepSpeed runs each tp rank's experts on its slice only, with the experts
  spread over the whole world; here the expert-parallel and expert-data-parallel groups stay those
  of the tp rank's data-parallel slice of the mesh (either way), so replicated experts get the
  same gradient on every tp rank and checkpoints, norms and ZeRO see plain replicas. With tp 1 (or
  no mesh) the flag changes nothing.
* ``use_tutel`` is accepted and ignored (a CUDA kernel library; the grouped path below is
  zerospeed's fast path).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed import comm
from zerospeed.moe.experts import Experts, whole_copy
from zerospeed.moe.gating import TopKGate
from zerospeed.moe.groups import ExpertGroups, expert_groups
from zerospeed.moe.tp_tokens import drop_tokens, gather_tokens


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all over a group, whose backward is the same exchange of gradients."""

    @staticmethod
    def forward(ctx: Any, group: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        comm.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # type: ignore[override]
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        comm.all_to_all_single(out, grad, group=ctx.group)
        return None, out


class MOELayer(nn.Module):
    """Gate + dispatch + all-to-all + experts + combine (``deepspeed_moe`` inside :class:`MoE`)."""

    def __init__(self, gate: TopKGate, experts: Experts, groups: ExpertGroups, num_local_experts: int,
                 tp: tuple[Any, int, int] | None = None) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.groups = groups
        self.num_local_experts = num_local_experts
        self.ep_size = groups.ep_size
        gate.ep_group = groups.ep_group
        #: (tp group, size, rank) over which the capacity slots are split around the all-to-all
        self.token_split = tp if tp is not None and tp[1] > 1 and groups.ep_size > 1 else None

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.token_split is None else drop_tokens(x, 1, *self.token_split)

    def _join(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.token_split is None else gather_tokens(x, 1, *self.token_split)

    def forward(self, hidden: torch.Tensor, used_token: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        model_dim = hidden.shape[-1]
        tokens = hidden.reshape(-1, model_dim)
        routed = self.gate(tokens, None if used_token is None else used_token.reshape(-1))
        capacity = routed.capacity
        if self.token_split is not None:  # slots laid out rounded up to a multiple of tp (extra ones stay empty)
            capacity = -(-capacity // self.token_split[1]) * self.token_split[1]
        num_experts = self.ep_size * self.num_local_experts
        dispatched = tokens.new_zeros(num_experts * capacity, model_dim)
        for route in routed.routes:
            dispatched = dispatched.index_add(0, route.expert * capacity + route.slot,
                                              tokens * route.kept.to(tokens.dtype)[:, None])
        dispatched = dispatched.reshape(num_experts, capacity, model_dim)
        ep, local = self.ep_size, self.num_local_experts
        if ep > 1:
            dispatched = self._join(_AllToAll.apply(self.groups.ep_group, self._split(dispatched)))
        # [ep (source rank), local experts, C, M] -> [local experts, ep * C, M]
        expert_in = dispatched.reshape(ep, local, capacity, model_dim).transpose(0, 1).reshape(
            local, ep * capacity, model_dim)
        expert_out = self.experts(expert_in)
        out_dim = expert_out.shape[-1]
        expert_out = expert_out.reshape(local, ep, capacity, out_dim).transpose(0, 1).reshape(
            ep * local, capacity, out_dim)
        if ep > 1:
            expert_out = self._join(_AllToAll.apply(self.groups.ep_group, self._split(expert_out)))
        flat_out = expert_out.reshape(num_experts * capacity, out_dim)
        combined = None
        for route in routed.routes:
            part = flat_out.index_select(0, route.expert * capacity + route.slot) \
                * (route.weight * route.kept).to(flat_out.dtype)[:, None]
            combined = part if combined is None else combined + part
        assert combined is not None
        return combined.reshape(*hidden.shape[:-1], out_dim), routed.l_aux, routed.exp_counts


class MoE(nn.Module):
    """DeepSpeed's ``deepspeed.moe.layer.MoE`` (see the module docstring)."""

    #: AutoTP leaves this layer alone: the router stays replicated, the experts are split by the layer
    #: itself (``enable_expert_tensor_parallelism``) or replicated over the tp group
    tp_managed = True

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True, grouped_experts: bool = True,
                 renormalize_topk: bool | None = None) -> None:
        super().__init__()
        del use_tutel
        if not isinstance(expert, nn.Module):
            raise TypeError(f"MoE: expert must be a torch.nn.Module, got {type(expert).__name__}")
        for name, value in (("hidden_size", hidden_size), ("num_experts", num_experts), ("ep_size", ep_size),
                            ("min_capacity", min_capacity)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoE: {name} must be a positive integer, got {value!r}")
        if num_experts % ep_size:
            raise ValueError(f"MoE: num_experts={num_experts} is not divisible by ep_size={ep_size}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"MoE: k must be a positive integer, got {k!r}")
        if k > num_experts:
            raise ValueError(f"MoE: k={k} is larger than num_experts={num_experts}")
        for name, value in (("capacity_factor", capacity_factor), ("eval_capacity_factor", eval_capacity_factor)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MoE: {name} must be a positive number, got {value!r}")
        from zerospeed.comm.mesh import get_mesh

        mesh = get_mesh()
        tp = (mesh.tp_group, mesh.tp_size, mesh.tp_rank) if mesh is not None and mesh.tp_size > 1 else None
        if ep_size > 1 and not comm.is_initialized():
            raise RuntimeError(f"MoE: ep_size={ep_size} needs torch.distributed: call zerospeed.init_distributed() "
                               "before building the model")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.k = k
        self.num_local_experts = num_experts // ep_size
        self.use_residual = use_residual
        groups = expert_groups(ep_size)
        self.expert_group_name = groups.name
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling, renormalize_topk)
        experts = Experts(expert, self.num_local_experts, groups.name, grouped=grouped_experts,
                          first_expert=groups.ep_rank * self.num_local_experts,
                          tp=tp if enable_expert_tensor_parallelism else None, num_experts=num_experts)
        self.enable_expert_tensor_parallelism = bool(enable_expert_tensor_parallelism) and tp is not None
        self.deepspeed_moe = MOELayer(gate, experts, groups, self.num_local_experts, tp)
        if use_residual:
            self.mlp = whole_copy(expert)
            self.coefficient = nn.Linear(hidden_size, 2)

    @property
    def expert_groups(self) -> ExpertGroups:
        return self.deepspeed_moe.groups

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE: input's last dimension is {hidden_states.shape[-1]}, expected hidden_size="
                             f"{self.hidden_size}")
        if used_token is not None:
            if self.k != 1:
                raise ValueError(f"MoE: used_token masks apply to top-1 gating only (as in DeepSpeed); this layer "
                                 f"has k={self.k}")
            if used_token.numel() != hidden_states.numel() // self.hidden_size:
                raise ValueError(f"MoE: used_token has {used_token.numel()} entries for "
                                 f"{hidden_states.numel() // self.hidden_size} tokens")
        output, l_aux, exp_counts = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:2]
        return output, l_aux, exp_counts
