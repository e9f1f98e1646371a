"""Worker functions for the MoE tests (importable by name for run_distributed)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerospeed import comm
from zerospeed.moe.groups import expert_groups, reset_expert_groups
from zerospeed.moe.layer import MoE

HIDDEN, EXPERTS, TOKENS = 8, 4, 6


def expert() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, 16), nn.GELU(), nn.Linear(16, HIDDEN))


class Net(nn.Module):
    """dense -> MoE -> dense, returning (output, l_aux)."""

    def __init__(self, ep_size: int, k: int, drop: bool, grouped: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        self.moe = MoE(HIDDEN, expert(), num_experts=EXPERTS, ep_size=ep_size, k=k, capacity_factor=1.0,
                       min_capacity=1, drop_tokens=drop, use_rts=False, top2_2nd_expert_sampling=False,
                       grouped_experts=grouped)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return self.out(h), l_aux


def tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(2, TOKENS // 2, HIDDEN, generator=g), torch.randn(2, TOKENS // 2, HIDDEN, generator=g)


def loss_of(out: torch.Tensor, l_aux: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target) + 0.01 * l_aux


def copy_from_reference(model: Net, ref: Net) -> None:
    """Dense and gate weights as the reference's; local expert i = global expert ep_rank * E_local + i."""
    groups = model.moe.expert_groups
    local = model.moe.num_local_experts
    ref_state = ref.state_dict()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".deepspeed_experts." in name:
                head, rest = name.split(".deepspeed_experts.", 1)
                i, tail = rest.split(".", 1)
                g = groups.ep_rank * local + int(i)
                p.copy_(ref_state[f"{head}.deepspeed_experts.{g}.{tail}"])
            else:
                p.copy_(ref_state[name])


def global_name(model: Net, name: str) -> str:
    if ".deepspeed_experts." not in name:
        return name
    head, rest = name.split(".deepspeed_experts.", 1)
    i, tail = rest.split(".", 1)
    g = model.moe.expert_groups.ep_rank * model.moe.num_local_experts + int(i)
    return f"{head}.deepspeed_experts.{g}.{tail}"


def reduce_gradients(model: nn.Module, world: int) -> None:
    """Data-parallel averaging by hand: dense over the world, experts over their expert-dp group."""
    from zerospeed.moe.registry import is_expert_param

    groups = None
    for m in model.modules():
        if isinstance(m, MoE):
            groups = m.expert_groups
    for p in model.parameters():
        if p.grad is None:
            continue
        comm.all_reduce(p.grad, group=groups.edp_group if is_expert_param(p) else None)
        p.grad.div_(world)


def ep_parity(ep_size: int, k: int, drop: bool, steps: int = 2) -> dict[str, Any]:
    """Outputs, l_aux, gradients and weights after SGD steps: expert-parallel vs one-process reference."""
    reset_expert_groups()
    rank, world = comm.get_rank(), comm.get_world_size()
    torch.manual_seed(0)
    ref = Net(1, k, drop)
    model = Net(ep_size, k, drop)
    copy_from_reference(model, ref)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    comm.COUNTER.reset()
    worst: dict[str, float] = {"out": 0.0, "l_aux": 0.0, "grad": 0.0, "weight": 0.0}
    for _ in range(steps):
        # reference: every rank's shard through the one-process model, loss = mean over shards
        ref_opt.zero_grad()
        ref_outs = []
        total = 0.0
        for r in range(world):
            x, y = tokens(r)
            out, l_aux = ref(x)
            ref_outs.append((out.detach(), l_aux.detach()))
            total = total + loss_of(out, l_aux, y) / world
        total.backward()
        # expert-parallel model on this rank's shard
        opt.zero_grad()
        x, y = tokens(rank)
        out, l_aux = model(x)
        worst["out"] = max(worst["out"], (out - ref_outs[rank][0]).abs().max().item())
        worst["l_aux"] = max(worst["l_aux"], (l_aux - ref_outs[rank][1]).abs().item())
        loss_of(out, l_aux, y).backward()
        reduce_gradients(model, world)
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            worst["grad"] = max(worst["grad"], (p.grad - ref_params[global_name(model, name)].grad).abs().max().item())
        opt.step()
        ref_opt.step()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        worst["weight"] = max(worst["weight"], (p.detach() - ref_params[global_name(model, name)]).abs().max().item())
    worst["all_to_all_elements"] = comm.COUNTER.elements("all_to_all")
    worst["all_to_all_count"] = comm.COUNTER.count("all_to_all")
    worst["capacity_slots"] = EXPERTS * (max(1, -(-k * TOKENS // EXPERTS)) if drop else 0)
    return worst
