"""Per-rank bodies of tests/test_ds_param_view.py: DeepSpeed's ds_* attributes on ZeRO-3 parameters (issue 27)."""

from __future__ import annotations

import torch

from hf_cases import batch, ds_config, make_llama

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, lora_dropout=0.0)


def _gather_ds_tensors(model):
    """Every rank's ds_tensor of each parameter, in rank order."""
    from zerospeed import comm

    mine = {n: p.ds_tensor.detach().clone() for n, p in model.named_parameters()}
    return comm.all_gather_object(mine)


def _statuses(model):
    return {n: p.ds_status.name for n, p in model.named_parameters()}


def attributes_body():
    import zerospeed
    from zerospeed import comm, zero
    from zerospeed.zero import ZeroParamStatus

    plain = make_llama(0)
    with zero.Init(config_dict_or_path=ds_config(3)):
        model = make_llama(0)
    out = {"plain_has_ds_id": any(hasattr(p, "ds_id") for p in plain.parameters()),
           "class_names": sorted({type(p).__name__ for p in model.parameters()}),
           "is_parameter": all(isinstance(p, torch.nn.Parameter) for p in model.parameters())}
    plain_params = dict(plain.named_parameters())
    out["sizes"] = {n: (p.ds_numel, tuple(p.ds_shape), p.numel(), plain_params[n].numel(), tuple(plain_params[n].shape))
                    for n, p in model.named_parameters()}
    out["ids"] = [p.ds_id for p in model.parameters()]
    out["before"] = _statuses(model)
    pieces = _gather_ds_tensors(model)
    out["pieces_join"] = {n: torch.equal(torch.cat([r[n] for r in pieces]), plain_params[n].detach().reshape(-1))
                          for n in plain_params}
    with zero.GatheredParameters(list(model.parameters())):
        out["inside"] = _statuses(model)
        out["inside_shapes"] = {n: tuple(p.shape) for n, p in model.named_parameters()}
    out["after"] = _statuses(model)
    # under an engine: the same ids (re-bucketing keeps them), AVAILABLE inside a module's forward only (no
    # persistent parameters: a small one stays gathered, AVAILABLE, as in DeepSpeed)
    engine, *_ = zerospeed.initialize(model=model, config=ds_config(3, stage3_param_persistence_threshold=0))
    out["engine_ids"] = [p.ds_id for p in engine.module.parameters()]
    seen = {}
    q = engine.module.model.layers[0].self_attn.q_proj

    def hook(module, args):  # after zerospeed's own pre-forward hook (registered first) gathered the weight
        seen.setdefault("in_forward", module.weight.ds_status.name)

    handle = q.register_forward_pre_hook(hook)
    ids = batch(0, n=2).to(torch.long)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    handle.remove()
    out["in_forward"] = seen["in_forward"]
    out["after_step"] = set(_statuses(engine.module).values())
    out["enum"] = (ZeroParamStatus.AVAILABLE.value, ZeroParamStatus.NOT_AVAILABLE.value,
                   ZeroParamStatus.INFLIGHT.value)
    out["rank"] = comm.get_rank()
    return out


def peft_body():
    """PEFT on a zero.Init Llama: the parameter counts, and merge_and_unload under GatheredParameters."""
    from peft import LoraConfig, get_peft_model

    from zerospeed import zero

    plain = make_llama(0)
    with zero.Init(config_dict_or_path=ds_config(3)):
        model = make_llama(0)
    torch.manual_seed(5)
    plain = get_peft_model(plain, LoraConfig(**LORA))
    torch.manual_seed(5)
    model = get_peft_model(model, LoraConfig(**LORA))
    out = {"counts": model.get_nb_trainable_parameters(), "plain_counts": plain.get_nb_trainable_parameters()}
    ids = batch(1, n=2).to(torch.long)
    with torch.no_grad():
        ref_before = plain(input_ids=ids).logits
        with zero.GatheredParameters(list(model.parameters())):
            before = model(input_ids=ids).logits
            q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
            q_before = q.detach().clone()
        with zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            merged = model.merge_and_unload()
        plain_merged = plain.merge_and_unload()
        ref_after = plain_merged(input_ids=ids).logits
        with zero.GatheredParameters(list(merged.parameters())):
            after = merged(input_ids=ids).logits
            plain_weights = dict(plain_merged.named_parameters())
            out["weights_equal"] = {n: torch.equal(p, plain_weights[n]) for n, p in merged.named_parameters()}
    out["partitioned_after"] = all(hasattr(p, "ds_id") for p in merged.parameters())
    out["lora_left"] = [n for n, _ in merged.named_parameters() if "lora" in n]
    out["before_equal"] = torch.equal(before, ref_before)
    out["after_equal"] = torch.equal(after, ref_after)
    out["logit_change"] = (after - before).abs().max().item()
    out["scale"] = before.abs().max().item()
    with zero.GatheredParameters([q]):
        out["weight_change"] = (q - q_before).abs().max().item()
    return out


def body():
    return {"attributes": attributes_body(), "peft": peft_body()}


# -- a parameter gathered by the user inside the model's forward (TRL's fused LM head) -------------------------
class _HeadLogProb(torch.autograd.Function):
    """log_softmax(h @ w.T) at the targets, with the weight gathered again in backward (as TRL's
    ChunkedLogProbFunction does through maybe_gather_lm_head_ctx)."""

    @staticmethod
    def forward(ctx, h, w, targets):
        ctx.save_for_backward(h, w, targets)
        return torch.log_softmax(h @ w.t(), -1).gather(1, targets[:, None])[:, 0]

    @staticmethod
    def backward(ctx, grad):
        h, w, targets = ctx.saved_tensors
        with _maybe_gather(w):
            p = torch.softmax(h @ w.t(), -1)
            dlogits = -p * grad[:, None]
            dlogits[torch.arange(len(targets)), targets] += grad
            return dlogits @ w, dlogits.t() @ h, None


def _maybe_gather(*params):
    """TRL's maybe_gather_lm_head_ctx: gather only what is not AVAILABLE already."""
    import contextlib

    from zerospeed import zero
    from zerospeed.zero import ZeroParamStatus

    todo = [p for p in params if hasattr(p, "ds_status") and p.ds_status != ZeroParamStatus.AVAILABLE]
    return zero.GatheredParameters(todo) if todo else contextlib.nullcontext()


class FusedHeadModel(torch.nn.Module):
    """The model's forward runs the backbone, then reads ``head.weight`` directly (``head`` is never called)."""

    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32))
        self.head = torch.nn.Linear(32, 24, bias=False)

    def forward(self, x, targets):
        h = self.backbone(x)
        with _maybe_gather(self.head.weight):
            return -_HeadLogProb.apply(h, self.head.weight, targets).mean()


def _fused_head_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=g), torch.randint(0, 24, (8,), generator=g)


def fused_head_body(steps=3):
    """ZeRO-3 on every rank's half of the batch against plain torch on the whole batch (each rank computes the
    reference itself): losses and final weights."""
    import torch.distributed as dist

    import zerospeed
    from zerospeed import zero

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = FusedHeadModel()
    model = FusedHeadModel()
    model.load_state_dict(ref.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    cfg = {"train_micro_batch_size_per_gpu": 8 // world, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    out = {"losses": [], "ref_losses": [], "status_after_forward": None}
    for step in range(steps):
        x, t = _fused_head_batch(step)
        ref_loss = ref(x, t)
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        out["ref_losses"].append(ref_loss.item())
        loss = engine(x.chunk(world)[rank], t.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        losses = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(losses, loss.detach())
        out["losses"].append(sum(v.item() for v in losses) / world)
    out["status_after_step"] = model.head.weight.ds_status.name
    with zero.GatheredParameters(list(model.parameters())):
        out["max_weight_err"] = max(((p - q).abs().max() / q.abs().max()).item()
                                    for p, q in zip(model.parameters(), ref.parameters()))
    return out


# -- a parameter gathered by the user around the engine call, read by the forward without its module -------------
class OutsideReadModel(torch.nn.Module):
    """The forward reads ``head.weight`` without calling ``head`` and without gathering it itself."""

    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh())
        self.head = torch.nn.Linear(32, 24, bias=False)

    def forward(self, x, targets):
        logits = self.backbone(x) @ self.head.weight.t()
        return torch.nn.functional.cross_entropy(logits, targets)


def outside_gather_body(steps=3):
    """First engine: GatheredParameters([head.weight]) around the engine call, nothing registered: the backward's
    error (the context released the weight before it). Second engine: the fix the error names,
    register_external_parameter(model, head.weight): trains as plain torch on the whole batch."""
    import torch.distributed as dist

    import zerospeed
    from zerospeed import zero

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = {"train_micro_batch_size_per_gpu": 8 // world, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    out = {"error": None, "losses": [], "ref_losses": []}
    torch.manual_seed(0)
    model = OutsideReadModel()
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x, t = _fused_head_batch(0)
    with zero.GatheredParameters([model.head.weight]):
        loss = engine(x.chunk(world)[rank], t.chunk(world)[rank])
    try:
        engine.backward(loss)
    except RuntimeError as e:
        out["error"] = str(e)
    torch.manual_seed(0)
    ref, model = OutsideReadModel(), OutsideReadModel()
    model.load_state_dict(ref.state_dict())
    zero.register_external_parameter(model, model.head.weight)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for step in range(steps):
        x, t = _fused_head_batch(step)
        ref_loss = ref(x, t)
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        out["ref_losses"].append(ref_loss.item())
        with zero.GatheredParameters([model.head.weight]):
            loss = engine(x.chunk(world)[rank], t.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        losses = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(losses, loss.detach())
        out["losses"].append(sum(v.item() for v in losses) / world)
    with zero.GatheredParameters(list(model.parameters())):
        out["max_weight_err"] = max(((p - q).abs().max() / q.abs().max()).item()
                                    for p, q in zip(model.parameters(), ref.parameters()))
    return out
