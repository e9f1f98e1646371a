"""Rank functions and the one-process reference of tests/test_onebit_adam.py."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

SIZES = (13, 40)  # two parameters, neither a multiple of 8 x world
STEPS, FREEZE = 7, 3


def grads(step: int, rank: int) -> list[torch.Tensor]:
    """Local gradients, multiples of 2^-10 below 8: any sum of a few of them, and its division by 2 or 4, is exact."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randint(-8192, 8192, (n,), generator=g).float() / 1024 for n in SIZES]


def initial() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(n, generator=g) for n in SIZES]


def train(steps: int = STEPS, freeze: int = FREEZE, weight_decay: float = 0.0, resume_at: int | None = None,
          state: dict | None = None) -> dict:
    from zerospeed.ops.onebit_adam import OneBitAdam

    params = [torch.nn.Parameter(t.clone()) for t in initial()]
    opt = OneBitAdam(params, lr=0.01, freeze_step=freeze, weight_decay=weight_decay)
    start = 0
    if state is not None:
        opt.load_state_dict(state["opt"])
        for p, w in zip(params, state["params"]):
            p.data.copy_(w)
        start = state["step"]
    history, saved = [], None
    for step in range(start, steps):
        for p, g in zip(params, grads(step, dist.get_rank())):
            p.grad = g.clone()
        opt.step()
        history.append([p.detach().clone() for p in params])
        if resume_at is not None and step + 1 == resume_at:
            saved = {"opt": copy.deepcopy(opt.state_dict()), "params": [p.detach().clone() for p in params], "step": step + 1}
    return {"history": history, "saved": saved}


def reference(world: int, steps: int = STEPS, freeze: int = FREEZE) -> list[list[torch.Tensor]]:
    """One process: torch.optim.Adam on the averaged gradient during warm-up, then the 1-bit algorithm simulated
    for every rank (local momenta, simulate_compressed_all_reduce, frozen variance)."""
    from zerospeed.comm.compressed import simulate_compressed_all_reduce

    params = [torch.nn.Parameter(t.clone()) for t in initial()]
    adam = torch.optim.Adam(params, lr=0.01, foreach=False)
    history = []
    b1, b2 = 0.9, 0.999
    errors: dict = {}
    for step in range(steps):
        per_rank = [grads(step, r) for r in range(world)]
        if step < freeze:
            for i, p in enumerate(params):
                total = per_rank[0][i].clone()
                for r in range(1, world):
                    total += per_rank[r][i]
                p.grad = total / world
            adam.step()
        else:
            with torch.no_grad():
                for i, p in enumerate(params):
                    st = adam.state[p]
                    m = st["exp_avg"]
                    n = m.numel()
                    padded = -(-n // (8 * world)) * (8 * world)
                    werr, serr = errors.setdefault(i, ([torch.zeros(padded) for _ in range(world)],
                                                       [torch.zeros(padded // world) for _ in range(world)]))
                    bufs = []
                    for r in range(world):
                        local = m.clone().mul_(b1).add_(per_rank[r][i], alpha=1 - b1)
                        buf = torch.zeros(padded)
                        buf[:n] = local
                        bufs.append(buf)
                    m.copy_(simulate_compressed_all_reduce(bufs, werr, serr)[:n])
                    t = step + 1
                    step_size = 0.01 / (1 - b1 ** t)
                    denom = (st["exp_avg_sq"].sqrt() / (1 - b2 ** freeze) ** 0.5).add_(1e-8)
                    p.addcdiv_(m, denom, value=-step_size)
        history.append([p.detach().clone() for p in params])
    return history
