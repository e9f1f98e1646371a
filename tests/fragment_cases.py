"""Per-rank bodies for DeepSpeed's tensor-fragment API and ZeRO-3 leaf modules (tests/test_as_deepspeed_fragments.py).

``Net`` has a frozen bias (its fragment reads as None) and sizes that are not multiples of 2 or 4, so parameters
straddle the ranks' shards; ``Routed`` is a mixture-of-experts block whose experts run in a data-dependent order that
differs between ranks (what ``set_z3_leaf_modules`` is for). The reference is computed in the same process on plain
copies of the model: rank r's micro-batch on its own, the gradients of all ranks' micro-batches averaged as the
engine averages them ((g0 + g1) / 2: a sum of two and a halving, both exact), so gradients must be equal bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

D_IN, D_HID, D_OUT, MICRO = 5, 7, 3, 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(D_IN, D_HID)
        self.l2 = nn.Linear(D_HID, D_OUT)
        self.l1.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.l2(torch.tanh(self.l1(x))), y)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(D_HID, D_HID)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.w(h))


class MoE(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(D_HID, n)
        self.experts = nn.ModuleList([Expert() for _ in range(n)])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(h), -1)
        choice = probs.argmax(-1)
        out = torch.zeros_like(h)
        for e in dict.fromkeys(choice.tolist()):  # only the chosen experts run, in the order the rows choose them
            rows = choice == e
            out[rows] = self.experts[e](h[rows]) * probs[rows, e:e + 1]
        return h + out


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D_HID)
        self.moe = MoE()
        self.out = nn.Linear(D_HID, D_OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.out(self.moe(self.inp(x))), y)


def make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return Net() if kind == "net" else Routed()


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(MICRO, D_IN, generator=g) * 2, torch.randn(MICRO, D_OUT, generator=g)


def reference_grads(kind: str, world: int) -> dict[str, torch.Tensor]:
    grads = []
    for r in range(world):
        m = make(kind)
        m(*batch(r)).backward()
        grads.append({n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)  # an expert no row chose
                      for n, p in m.named_parameters() if p.requires_grad})
    total = grads[0]
    for g in grads[1:]:
        total = {n: total[n] + g[n] for n in total}
    return {n: t / world for n, t in total.items()}


def config(stage: int, gas: int = 1, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 20, "allgather_bucket_size": 20, **zero}}


def _engine(kind: str, cfg: dict, leaf: bool = False):
    import zerospeed
    from zerospeed.utils import set_z3_leaf_modules

    model = make(kind)
    if leaf:
        set_z3_leaf_modules(model, [MoE])
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = zerospeed.initialize(model=model, model_parameters=params, config=cfg)
    return engine


def _gathered(engine) -> dict[str, torch.Tensor]:
    from zerospeed import zero

    params = list(engine.module.parameters())
    with zero.GatheredParameters(params) if any(hasattr(p, "ds_id") for p in params) else _null():
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def fragments_body(stage: int) -> dict:
    """Getters against the reference, setters round-trip, local fragments at ZeRO-3, errors elsewhere."""
    from zerospeed import utils

    rank, world = dist.get_rank(), dist.get_world_size()
    engine = _engine("net", config(stage))
    named = dict(engine.module.named_parameters())
    init = {n: p.detach().clone() for n, p in make("net").named_parameters()}
    out: dict = {"stage": stage}
    engine.backward(engine(*batch(rank)))
    want = reference_grads("net", world)
    out["frozen"] = [utils.safe_get_full_grad(named["l1.bias"]) is None,
                     utils.safe_get_full_fp32_param(named["l1.bias"]) is None,
                     utils.safe_get_full_optimizer_state(named["l1.bias"], "exp_avg") is None]
    out["grad_equal"] = {n: torch.equal(utils.safe_get_full_grad(named[n]), want[n]) for n in want}
    out["param_equal"] = {n: torch.equal(utils.safe_get_full_fp32_param(named[n]), init[n]) for n in want}
    try:
        utils.safe_get_full_optimizer_state(named["l2.weight"], "exp_avg")
        out["state_before_step"] = "no error"
    except ValueError as e:
        out["state_before_step"] = str(e)
    # grad setters: a doubled gradient reads back exactly (before the step that would apply it)
    g = utils.safe_get_full_grad(named["l2.weight"])
    utils.safe_set_full_grad(named["l2.weight"], g * 2)
    out["grad_set"] = torch.equal(utils.safe_get_full_grad(named["l2.weight"]), g * 2)
    utils.safe_set_full_grad(named["l2.weight"], g)
    try:
        utils.safe_set_full_grad(named["l2.weight"], torch.zeros(3))
        out["bad_size"] = "no error"
    except AssertionError as e:  # TensorFragmentError is both ValueError and AssertionError
        out["bad_size"] = f"{type(e).__name__}: {e}"
    engine.step()
    # after one AdamW step from zero moments: exp_avg = (1 - b1) g, exp_avg_sq = (1 - b2) g^2 (one rounding each)
    out["exp_avg_close"] = {n: torch.allclose(utils.safe_get_full_optimizer_state(named[n], "exp_avg"), 0.1 * want[n],
                                              rtol=2.5e-7, atol=0) for n in want}
    out["exp_avg_sq_close"] = {n: torch.allclose(utils.safe_get_full_optimizer_state(named[n], "exp_avg_sq"),
                                                 0.001 * want[n] ** 2, rtol=5e-7, atol=0) for n in want}
    live = _gathered(engine)
    out["param_after_step"] = {n: torch.equal(utils.safe_get_full_fp32_param(named[n]), live[n]) for n in want}
    # setters: state and master read back exactly; a master set takes effect at the next step (lr 0 keeps it)
    values = {n: torch.arange(live[n].numel(), dtype=torch.float32).reshape(live[n].shape) / 7 - 1 for n in want}
    for n, v in values.items():
        utils.safe_set_full_optimizer_state(named[n], v * 3, "exp_avg")
        utils.safe_set_full_fp32_param(named[n], v)
    out["state_set"] = all(torch.equal(utils.safe_get_full_optimizer_state(named[n], "exp_avg"), v * 3)
                           for n, v in values.items())
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    engine.backward(engine(*batch(rank)))
    engine.step()
    live = _gathered(engine)
    out["master_set_applied"] = {n: torch.equal(live[n], v) for n, v in values.items()}
    out["local"] = _local_api(engine, named, want, stage)
    return out


def _local_api(engine, named, want, stage) -> dict:
    from zerospeed import utils

    p = named["l2.weight"]
    if stage != 3:
        try:
            utils.safe_get_local_fp32_param(p)
            return {"error": "no error"}
        except AssertionError as e:
            return {"error": str(e)}
    out = {}
    full = utils.safe_get_full_fp32_param(p)
    local = utils.safe_get_local_fp32_param(p)
    out["numel_is_ds_tensor"] = local.numel() == p.ds_tensor.numel()
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    out["parts_join"] = torch.equal(torch.cat(parts), full.reshape(-1))
    utils.safe_set_local_fp32_param(p, local + 1)
    out["local_set"] = torch.equal(utils.safe_get_full_fp32_param(p), full + 1)
    utils.safe_set_local_optimizer_state(p, local * 0 + dist.get_rank(), "exp_avg_sq")
    joined = utils.safe_get_full_optimizer_state(p, "exp_avg_sq").reshape(-1)
    out["local_state_set"] = torch.equal(joined, torch.cat([torch.full((x.numel(),), float(r))
                                                            for r, x in enumerate(parts)]))
    out["local_grad_is_fragment"] = torch.equal(torch.cat(_all(utils.safe_get_local_grad(p))),
                                                utils.safe_get_full_grad(p).reshape(-1))
    return out


def _all(t: torch.Tensor) -> list:
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, t)
    return parts


def not_at_boundary_body() -> str:
    """gradient_accumulation_steps 2 at ZeRO-1: after the first micro-batch nothing is reduced yet."""
    from zerospeed import utils

    engine = _engine("net", config(1, gas=2))
    engine.backward(engine(*batch(dist.get_rank())))
    try:
        utils.safe_get_full_grad(engine.module.l2.weight)
        return "no error"
    except RuntimeError as e:
        return str(e)


def leaf_body(leaf: bool) -> dict:
    """ZeRO-3, the MoE block flagged as a leaf: no hooks below it, gradients equal the reference bit for bit."""
    from zerospeed import utils

    rank, world = dist.get_rank(), dist.get_world_size()
    engine = _engine("routed", config(3, stage3_param_persistence_threshold=0), leaf=leaf)
    runtime = engine.strategy.runtime
    moe = engine.module.moe
    hooked = {id(m) for m in engine.module.modules()} & set(runtime._handles)
    out = {"moe_hooked": id(moe) in hooked,
           "below_hooked": any(id(m) in hooked for m in moe.modules() if m is not moe),
           "leaves": [type(m).__name__ for m in utils.get_z3_leaf_modules(engine.module)]}
    engine.backward(engine(*batch(rank)))
    want = reference_grads("routed", world)
    named = dict(engine.module.named_parameters())
    out["grad_equal"] = all(torch.equal(utils.safe_get_full_grad(named[n]), want[n]) for n in want)
    plain = make("routed")
    with torch.no_grad():
        out["expert_order"] = list(dict.fromkeys(plain.moe.gate(plain.inp(batch(rank)[0])).argmax(-1).tolist()))
    engine.step()
    out["trained"] = True
    utils.unset_z3_leaf_modules(engine.module, [MoE])
    out["leaves_after_unset"] = len(utils.get_z3_leaf_modules(engine.module))
    return out


def generation_hooks_body() -> dict:
    """TRL's generation path at ZeRO-3: gather everything, remove the hooks (through DeepSpeed's
    ``optimizer.parameter_offload``), run a rank-dependent number of forwards, add the hooks back; training then goes
    on exactly as without the interlude."""
    from trl.models.utils import add_hooks, remove_hooks

    from zerospeed import zero

    rank = dist.get_rank()
    runs = {}
    for interlude in (False, True):
        engine = _engine("net", config(3, stage3_param_persistence_threshold=0))
        losses = []
        for step in range(3):
            if interlude and step == 1:
                with zero.GatheredParameters(list(engine.parameters())):
                    remove_hooks(engine)
                    runs["removed"] = not engine.strategy.runtime.hooks_installed
                    with torch.no_grad():
                        for _ in range(rank + 2):  # ranks generate different lengths
                            engine.module(*batch(rank + 10))
                    add_hooks(engine)
                runs["reinstalled"] = engine.strategy.runtime.hooks_installed
            loss = engine(*batch(rank + step))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        runs[interlude] = (losses, {n: t for n, t in _gathered(engine).items()})
    runs["same"] = runs[False][0] == runs[True][0] and all(torch.equal(runs[False][1][n], runs[True][1][n])
                                                          for n in runs[False][1])
    runs["optimizer_class"] = type(engine.optimizer).__name__
    return {k: v for k, v in runs.items() if isinstance(k, str)}


def nested_init_body() -> list:
    """Nested ``zero.Init``: what was built inside the inner context is partitioned when it exits, while the outer is
    still active (DeepSpeed's tests/unit/runtime/zero/test_zero_nesting_init.py::TestShutdownInNestingInit)."""
    from zerospeed import zero

    cfg = {"train_batch_size": dist.get_world_size(), "zero_optimization": {"stage": 3}}
    with zero.Init(config_dict_or_path=cfg):
        with zero.Init(config_dict_or_path=cfg):
            first = nn.Linear(4, 4)
        seen = [hasattr(first.weight, "ds_id")]
        with zero.Init(config_dict_or_path=cfg):
            second = nn.Linear(4, 4)
        seen.append(hasattr(second.weight, "ds_id"))
    return seen + [hasattr(second.weight, "ds_id")]
