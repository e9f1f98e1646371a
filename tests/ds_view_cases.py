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
