"""Rank functions and one-process references of tests/test_onebit_family.py (0/1 Adam and 1-bit LAMB, issue #28).

The references are written from DeepSpeed 0.19.x's formulas (``runtime/fp16/onebit/{zoadam,lamb}.py``), for every
rank in one process, with :func:`zerospeed.comm.compressed.simulate_compressed_all_reduce` as the collective.
Gradients are multiples of 2^-10 below 8 (tests/onebit_cases.py), so their mean over 2 or 4 ranks is exact in any
order and the references can compare bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from onebit_cases import grads, initial
from zerospeed.comm.compressed import simulate_compressed_all_reduce
from zerospeed.ops.onebit_common import padded_numel

ZO = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "var_freeze_step": 6,
      "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 4}
LAMB = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "freeze_step": 4, "max_coeff": 0.3,
        "min_coeff": 0.01, "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1}


def build(kind: str, params: list, hp: dict):
    from zerospeed.ops.onebit_lamb import OneBitLamb
    from zerospeed.ops.zero_one_adam import ZeroOneAdam

    return (ZeroOneAdam if kind == "zoadam" else OneBitLamb)(params, **hp)


def train(kind: str, hp: dict, steps: int) -> dict:
    """The optimizer alone (it averages the gradients it needs itself): every step's parameters on this rank."""
    params = [torch.nn.Parameter(t.clone()) for t in initial()]
    opt = build(kind, params, hp)
    history = []
    for step in range(steps):
        for p, g in zip(params, grads(step, dist.get_rank())):
            p.grad = g.clone()
        opt.step()
        history.append([p.detach().clone() for p in params])
    return {"history": history, "rank_local": {k: v.clone() for k, v in opt.rank_local_state().items()}}


def _mean(ts: list[torch.Tensor]) -> torch.Tensor:
    total = ts[0].clone()
    for t in ts[1:]:
        total += t
    return total / len(ts)


def _compressed(xs: list[torch.Tensor], errors: tuple[list, list]) -> torch.Tensor:
    """The simulated compressed mean of the ranks' ``xs`` (same shape), DeepSpeed's padding."""
    n, world = xs[0].numel(), len(xs)
    bufs = []
    for x in xs:
        b = torch.zeros(padded_numel(n, world))
        b[:n] = x.reshape(-1)
        bufs.append(b)
    return simulate_compressed_all_reduce(bufs, *errors)[:n].view(xs[0].shape)


def zoadam_reference(world: int, steps: int, hp: dict = ZO) -> list[list[list[torch.Tensor]]]:
    """0/1 Adam for ``world`` ranks in one process: history[step][rank][param]."""
    b1, b2 = hp["betas"]
    lr, eps, wd = hp["lr"], hp["eps"], hp["weight_decay"]
    ranks = range(world)
    p = [[t.clone() for t in initial()] for _ in ranks]
    n = len(p[0])
    m = [[torch.zeros_like(t) for t in p[0]] for _ in ranks]
    v = [[torch.zeros_like(t) for t in p[0]] for _ in ranks]
    acc = [[torch.zeros_like(t) for t in p[0]] for _ in ranks]
    err = [([torch.zeros(padded_numel(t.numel(), world)) for _ in ranks],
            [torch.zeros(padded_numel(t.numel(), world) // world) for _ in ranks]) for t in p[0]]
    var_interval, var_counter, local_interval, local_counter, lrs = 1, 0, 1, 0, 0.0
    frozen = False
    history = []
    for step in range(steps):
        t = step + 1
        g = [grads(step, r) for r in ranks]
        if t > 1:
            for i in range(n):
                if not frozen:
                    if t % var_interval == 0:
                        avg = _mean([g[r][i] for r in ranks])
                        for r in ranks:
                            v[r][i].mul_(b2).addcmul_(avg, avg, value=1 - b2)
                            m[r][i].mul_(b1).add_(avg, alpha=1 - b1)
                    else:
                        onebit = _compressed([g[r][i] for r in ranks], err[i]) if world > 1 else g[0][i]
                        for r in ranks:
                            m[r][i].mul_(b1).add_(onebit, alpha=1 - b1)
                else:
                    for r in ranks:
                        m[r][i].mul_(b1).add_(g[r][i], alpha=1 - b1)
                updates = []
                for r in ranks:
                    u = m[r][i] / (v[r][i].sqrt() + eps)
                    u += wd * p[r][i]
                    p[r][i].add_(-lr * u)
                    updates.append(u)
                    if frozen:
                        acc[r][i].add_(-lr * u)
                if frozen and t % local_interval == 0:
                    lrs_i = lrs + lr
                    for r in ranks:
                        p[r][i].add_(-1 * acc[r][i])
                        acc[r][i].mul_(v[r][i].sqrt() + eps)
                    if world > 1:
                        mean = _compressed([acc[r][i] for r in ranks], err[i])
                        for r in ranks:
                            acc[r][i].copy_(mean)
                    for r in ranks:
                        m[r][i].zero_().add_(acc[r][i] / lrs_i, alpha=-1)
                        p[r][i].add_(acc[r][i] / (v[r][i].sqrt() + eps))
                        acc[r][i].zero_()
            if frozen:
                lrs = 0.0 if t % local_interval == 0 else lrs + lr
            if not frozen:
                if t % var_interval == 0:
                    var_counter += 1
                    if var_counter == hp["var_update_scaler"]:
                        var_counter, var_interval = 0, var_interval * 2
            else:
                local_counter += 1
                if local_counter == hp["local_step_scaler"]:
                    local_counter, local_interval = 0, min(hp["local_step_clipper"], local_interval * 2)
            if not frozen and t >= 2 and t > hp["var_freeze_step"]:
                frozen = True
                for we, se in err:
                    for e in we + se:
                        e.zero_()
        history.append([[x.clone() for x in p[r]] for r in ranks])
    return history


def adam_without_bias_correction(steps: int, world: int, hp: dict = ZO) -> list[list[torch.Tensor]]:
    """The uncompressed reference of 0/1 Adam's first steps (every step a variance step): Adam on the averaged
    gradient with DeepSpeed's form, u = m / (sqrt(v) + eps) + wd p, no bias correction, step 1 skipped."""
    b1, b2 = hp["betas"]
    p = [t.clone() for t in initial()]
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    out = []
    for step in range(steps):
        if step > 0:
            for i in range(len(p)):
                g = _mean([grads(step, r)[i] for r in range(world)])
                v[i].mul_(b2).addcmul_(g, g, value=1 - b2)
                m[i].mul_(b1).add_(g, alpha=1 - b1)
                u = m[i] / (v[i].sqrt() + hp["eps"])
                u += hp["weight_decay"] * p[i]
                p[i].add_(-hp["lr"] * u)
        out.append([x.clone() for x in p])
    return out


def _lamb_coeff(p: torch.Tensor, u: torch.Tensor, hp: dict) -> float:
    w_norm, u_norm = p.pow(2).sum().sqrt(), u.pow(2).sum().sqrt()
    if w_norm != 0 and u_norm != 0:
        return min(max((w_norm / u_norm).item(), hp["min_coeff"]), hp["max_coeff"])
    return 1.0


def lamb_reference(world: int, steps: int, hp: dict = LAMB) -> list[list[list[torch.Tensor]]]:
    """1-bit LAMB for ``world`` ranks in one process: history[step][rank][param] (every rank holds the same
    momenta and parameters, so one copy is kept and repeated)."""
    b1, b2 = hp["betas"]
    lr, eps, wd, cb = hp["lr"], hp["eps"], hp["weight_decay"], hp["coeff_beta"]
    p = [t.clone() for t in initial()]
    n = len(p)
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    fresh = [torch.zeros_like(t) for t in p]
    coeff_freeze = [0.0] * n
    last_factor = [1.0] * n
    scaling = None
    total = sum(t.numel() for t in p)
    padded = padded_numel(total, world)
    errors = ([torch.zeros(padded) for _ in range(world)], [torch.zeros(padded // world) for _ in range(world)])
    pad = torch.zeros(padded - total)
    compressing = False
    history = []
    for step in range(steps):
        t = step + 1
        g = [grads(step, r) for r in range(world)]
        if t > 1 and not compressing:
            for i in range(n):
                avg = _mean([g[r][i] for r in range(world)])
                m[i].mul_(b1).add_(avg, alpha=1 - b1)
                v[i].mul_(b2).addcmul_(avg, avg, value=1 - b2)
                if t == hp["freeze_step"]:
                    fresh[i] = v[i].clone()
                u = m[i] / (v[i].sqrt() + eps)
                u += wd * p[i]
                c = _lamb_coeff(p[i], u, hp)
                if c != 1.0:
                    coeff_freeze[i] = cb * coeff_freeze[i] + (1 - cb) * c
                p[i].add_(-lr * c * u)
        elif compressing:
            last = [x.clone() for x in m]
            if scaling is None:
                rms = [(torch.norm(x) / (x.numel() ** 0.5)).item() for x in m]
                scaling = [sum(rms) / len(rms) / s for s in rms]
            locals_ = []
            for r in range(world):
                local = [(m[i].clone().mul_(b1).add_(g[r][i], alpha=1 - b1)).mul_(scaling[i]) for i in range(n)]
                locals_.append(torch.cat([x.reshape(-1) for x in local] + [pad]))
            if world > 1:
                flat = simulate_compressed_all_reduce(locals_, *errors)
            else:
                flat = locals_[0]
            off = 0
            for i in range(n):
                m[i].view(-1).copy_(flat[off:off + m[i].numel()])
                off += m[i].numel()
            pad = flat[off:].clone()
            for i in range(n):
                m[i].div_(scaling[i])
                gr = (m[i] - last[i] * b1) / (1 - b1)
                fresh[i].mul_(b2).addcmul_(gr, gr, value=1 - b2)
                denom = v[i].sqrt() + eps
                prelim = m[i] / denom
                u = prelim + wd * p[i]
                u_norm = u.pow(2).sum().sqrt()
                factor = (denom / (fresh[i].sqrt() + eps)).max().item()
                ratio = min(1.0, (prelim.pow(2).sum().sqrt() / u_norm).item())
                factor = factor * ratio + (1.0 - ratio)
                factor = min(max(factor, hp["factor_min"]), hp["factor_max"])
                factor = min(factor, last_factor[i] * (1.0 + hp["factor_threshold"]))
                factor = max(factor, last_factor[i] * (1.0 - hp["factor_threshold"]))
                last_factor[i] = factor
                p[i].add_(-lr * (coeff_freeze[i] * factor) * u)
        if not compressing and t >= 2 and t >= hp["freeze_step"]:
            compressing = True
        history.append([[x.clone() for x in p] for _ in range(world)])
    return history


def plain_lamb(steps: int, world: int, hp: dict = LAMB) -> list[list[torch.Tensor]]:
    """The uncompressed reference of 1-bit LAMB's warm-up: LAMB on the averaged gradient, DeepSpeed's form (no bias
    correction, clamped coefficient), step 1 skipped."""
    b1, b2 = hp["betas"]
    p = [t.clone() for t in initial()]
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    out = []
    for step in range(steps):
        if step > 0:
            for i in range(len(p)):
                g = _mean([grads(step, r)[i] for r in range(world)])
                m[i].mul_(b1).add_(g, alpha=1 - b1)
                v[i].mul_(b2).addcmul_(g, g, value=1 - b2)
                u = m[i] / (v[i].sqrt() + hp["eps"])
                u += hp["weight_decay"] * p[i]
                p[i].add_(-hp["lr"] * _lamb_coeff(p[i], u, hp) * u)
        out.append([x.clone() for x in p])
    return out


# -- through zerospeed.initialize (ZeRO stage 0) ------------------------------------------------------------

ENGINE_PARAMS = {
    "ZeroOneAdam": {"lr": 1e-2, "weight_decay": 0.01, "bias_correction": False, "var_freeze_step": 4,
                    "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 4, "cuda_aware": False,
                    "comm_backend_name": "nccl"},
    "OneBitLamb": {"lr": 1e-2, "weight_decay": 0.01, "bias_correction": False, "max_coeff": 0.3, "min_coeff": 0.01,
                   "freeze_step": 3, "cuda_aware": False, "comm_backend_name": "mpi", "coeff_beta": 0.9,
                   "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1},
    "OneBitAdam": {"lr": 1e-2, "freeze_step": 3},
}


def engine_cfg(name: str, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0, "gradient_clipping": 0.0,
           "optimizer": {"type": name, "params": dict(ENGINE_PARAMS[name])}}
    cfg.update(extra)
    return cfg


def engine_run(name: str, steps: int) -> list[dict]:
    import zerospeed
    from torch import nn

    from onebit_engine_cases import batch, model

    engine, _, _, _ = zerospeed.initialize(model=model(), config=engine_cfg(name))
    out = []
    for step in range(steps):
        x, y = batch(step, dist.get_rank())
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        out.append({k: v.detach().clone() for k, v in engine.module.state_dict().items()})
    return out


def standalone_run(name: str, steps: int) -> list[dict]:
    from torch import nn

    from onebit_engine_cases import batch, model
    from zerospeed.ops.optimizers import build_optimizer

    net = model()
    opt = build_optimizer(name, dict(ENGINE_PARAMS[name]), net.parameters())
    out = []
    for step in range(steps):
        x, y = batch(step, dist.get_rank())
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        out.append({k: v.detach().clone() for k, v in net.state_dict().items()})
    return out


def checkpoint_run(name: str, ckpt: str, steps: range, save: bool, load: bool) -> dict:
    """Train ``steps`` (their batches), loading ``ckpt`` first and/or saving it after: final weights, the
    optimizer's rank-local tensors after the load (or at the save) and after training."""
    import zerospeed
    from torch import nn

    from onebit_engine_cases import batch, model

    bf16 = name.endswith("-bf16")  # fp32 masters behind bf16 parameters
    name = name.removesuffix("-bf16")
    engine, opt, _, _ = zerospeed.initialize(model=model(), config=engine_cfg(name, bf16={"enabled": bf16}))
    loaded = None
    if load:
        engine.load_checkpoint(ckpt)
        loaded = {k: v.clone() for k, v in opt.rank_local_state().items()}
    losses = []
    for step in steps:
        x, y = batch(step, dist.get_rank())
        loss = nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    saved = None
    if save:
        engine.save_checkpoint(ckpt, tag="t")
        saved = {k: v.clone() for k, v in opt.rank_local_state().items()}
    return {"weights": {k: v.clone() for k, v in engine.module.state_dict().items()}, "loaded": loaded,
            "saved": saved, "losses": losses, "error_lengths": {
                k: opt._error_length(opt._all_params()[int(k[1:].split(".")[0])]) for k in (saved or loaded or {})}}
