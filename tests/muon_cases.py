"""Shared model, data and runs for the Muon tests (imported by the test modules and by the ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

GLOBAL_BATCH = 8
SEQ = 6
VOCAB = 11
STEPS = 4
MUON_PARAMS = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.05, "muon_lr": 0.03, "adam_lr": 0.01,
               "betas": [0.9, 0.95], "eps": 1e-8}


class TinyLM(nn.Module):
    """Embedding, two hidden matrices of odd shapes (Muon), a norm and biases and an LM head (Adam)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.up = nn.Linear(8, 13)
        self.down = nn.Linear(13, 8, bias=False)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(torch.tanh(self.up(h)))
        logits = self.lm_head(self.norm(h))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


MUON_NAMES = ("up.weight", "down.weight")


def make_model() -> TinyLM:
    torch.manual_seed(4321)
    return TinyLM()


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(77 + step)
    t = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def config(stage: int, params: dict | None = None, bucket: int = 100, **extra) -> dict:
    cfg = {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Muon", "params": dict(MUON_PARAMS if params is None else params)},
           "gradient_clipping": 0.0, "steps_per_print": 0,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}}
    cfg.update(extra)
    return cfg


def reference_run(params: dict | None = None, steps: int = STEPS,
                  ranks: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single process, plain PyTorch with zerospeed's Muon optimizer built from the same params.

    ``ranks`` > 1: the same algorithm as data parallelism on that many ranks, in one process: the batch is
    split as the ranks split it, each part's mean-loss gradient is accumulated by autograd in rank order
    (((g0 + g1) + g2) + g3, the order of comm's ordered reduce-scatter) and the sum is multiplied by 1/ranks
    as the engine's step does. With ``ranks`` = 1 the gradient of the whole batch's mean loss is taken at
    once, which differs from any split in rounding.
    """
    from zerospeed.ops.optimizers import build_optimizer

    model = make_model()
    names = {id(p): n for n, p in model.named_parameters()}
    opt = build_optimizer("Muon", dict(MUON_PARAMS if params is None else params), model.parameters(), names=names)
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        opt.zero_grad()
        if ranks == 1:
            loss = model(x, y)
            loss.backward()
            losses.append(loss.item())
        else:
            parts = []
            for xr, yr in zip(x.chunk(ranks), y.chunk(ranks)):
                part = model(xr, yr)
                part.backward()
                parts.append(part.detach())
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(1.0 / ranks)
            losses.append(float(sum(parts)) / ranks)
        opt.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_run(cfg: dict, steps: int = STEPS) -> dict:
    import zerospeed

    model = make_model()
    engine, opt, _, _ = zerospeed.initialize(model=model, config=cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    gas = engine.gradient_accumulation_steps()
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        total = torch.zeros(())
        for xm, ym in zip(x.chunk(world)[rank].chunk(gas), y.chunk(world)[rank].chunk(gas)):
            loss = engine(xm, ym)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / gas
        dist.all_reduce(total)
        losses.append(total.item() / world)
    with _gathered(engine):
        weights = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    plan = getattr(opt, "shard_plan", None)
    muon_groups = [g for g in opt.param_groups if g.get("use_muon")]
    return {"losses": losses, "weights": weights,
            "ns_flops_done": None if plan is None else plan.ns_flops_done,
            "ns_flops_total": None if plan is None else plan.ns_flops_total,
            "owned": None if plan is None else plan.owned(),
            "num_muon_tensors": sum(len(g["params"]) for g in muon_groups),
            "memory": engine.memory_breakdown()}


def _gathered(engine):
    from zerospeed.zero import GatheredParameters

    return GatheredParameters(list(engine.module.parameters()))


def max_rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max()).item() for k in b)


def checkpoint_run(cfg: dict, save_dir: str, steps: range, save_after: bool, load: bool,
                   zero_init: bool = False) -> dict:
    """Train ``steps`` (their global batches), loading a checkpoint first and/or saving one after."""
    import zerospeed
    from zerospeed import zero

    if zero_init:
        with zero.Init(config_dict_or_path=cfg):
            model = make_model()
    else:
        model = make_model()
    engine, opt, _, _ = zerospeed.initialize(model=model, config=cfg)
    if load:
        engine.load_checkpoint(save_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        x, y = global_batch(step)
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    if save_after:
        engine.save_checkpoint(save_dir, tag="t")
    with _gathered(engine):
        weights = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    muon_groups = [g for g in opt.param_groups if g.get("use_muon")]
    return {"losses": losses, "weights": weights, "owned": [] if opt.shard_plan is None else opt.shard_plan.owned(),
            "num_muon_groups": len(muon_groups)}


def moe_parity(stage: int, ep_size: int, steps: int = 3) -> dict:
    """Muon on tests/moe_cases.py's expert-parallel Net vs the one-process reference with the same Muon:
    expert matrices are orthogonalised within their expert-data-parallel group."""
    import contextlib

    import zerospeed
    from moe_cases import Net, copy_from_reference, global_name, loss_of, tokens
    from zerospeed import comm
    from zerospeed.moe.groups import reset_expert_groups
    from zerospeed.ops.optimizers import build_optimizer

    params = {"lr": 0.02, "adam_lr": 0.01, "momentum": 0.9}
    reset_expert_groups()
    rank, world = comm.get_rank(), comm.get_world_size()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "optimizer": {"type": "Muon", "params": params},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 200}}
    torch.manual_seed(0)
    ref = Net(1, 1, True)
    torch.manual_seed(0)
    model = Net(ep_size, 1, True)
    copy_from_reference(model, ref)
    engine, opt, _, _ = zerospeed.initialize(model=model, config=cfg)
    ref_opt = build_optimizer("Muon", params, ref.parameters(), names={id(p): n for n, p in ref.named_parameters()})
    for _ in range(steps):
        ref_opt.zero_grad()
        total = sum(loss_of(*ref(tokens(r)[0]), tokens(r)[1]) / world for r in range(world))
        total.backward()
        ref_opt.step()
        x, y = tokens(rank)
        out, l_aux = engine(x)
        engine.backward(loss_of(out, l_aux, y))
        engine.step()
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    gathered = zerospeed.zero.GatheredParameters(list(engine.module.parameters())) if stage == 3 \
        else contextlib.nullcontext()
    with gathered:
        for name, p in engine.module.named_parameters():
            r = ref_params[global_name(model, name)]
            worst = max(worst, ((p.detach() - r).abs().max() / r.abs().max()).item())
    return {"worst": worst, "num_muon_groups": sum(1 for g in opt.param_groups if g["use_muon"])}
