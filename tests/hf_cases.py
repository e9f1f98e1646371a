"""Tiny random-init HuggingFace models and per-rank bodies for the tests/test_hf_*.py files.

Models come from configs only (random weights, never a download). Every body is a module-level
function so ``run_distributed`` can start it by name.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

VOCAB = 96
SEQ = 8


def llama_config(**over):
    from transformers import LlamaConfig

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(over)
    return LlamaConfig(**kw)


def gpt2_config(**over):
    from transformers import GPT2Config

    kw = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2)
    kw.update(over)
    return GPT2Config(**kw)


def make_llama(seed=0, **over):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(**over))


def make_gpt2(seed=0, **over):
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(gpt2_config(**over))


def batch(step=0, n=4, seq=SEQ):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(3, VOCAB, (n, seq), generator=g)


def ds_config(stage, precision="fp32", **zero_over):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
           "zero_optimization": {"stage": stage, **zero_over}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


# -- per-rank bodies ------------------------------------------------------------------------------
def passthrough_body(stage):
    import zerospeed

    model = make_llama()
    ids = batch(0, n=2)
    with torch.no_grad():
        ref_tokens = model.generate(ids, max_new_tokens=5, do_sample=False).clone()
    engine, *_ = zerospeed.initialize(model=model, config=ds_config(stage))
    out = {"generate": engine.generate(ids, max_new_tokens=5, do_sample=False), "ref_generate": ref_tokens}
    out["engine_config_type"] = type(engine.config).__name__
    out["model_config_vocab"] = engine.module.config.vocab_size
    out["device"] = str(engine.device)
    engine.gradient_checkpointing_enable()
    out["gc_on"] = bool(engine.module.is_gradient_checkpointing)
    out["own_names"] = (engine.forward.__self__ is engine, engine.module is model,
                        type(engine).step is type(engine).__dict__["step"])
    try:
        engine.no_such_attribute_xyz
        out["missing"] = None
    except AttributeError as exc:
        out["missing"] = str(exc)
    # a training step with gradient checkpointing on, through the engine
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    out["loss"] = float(loss)
    return out


def bf16_logits_body(save_dir):
    import zerospeed
    from transformers import LlamaForCausalLM

    ids = batch(0, n=2)
    rank = dist.get_rank()
    if rank == 0:
        make_llama().save_pretrained(save_dir)
    dist.barrier()
    hf_bf16 = LlamaForCausalLM.from_pretrained(save_dir, dtype=torch.bfloat16)
    model = LlamaForCausalLM.from_pretrained(save_dir)  # fp32, as users hand it to the engine
    engine, *_ = zerospeed.initialize(model=model, config=ds_config(0, "bf16"))
    with torch.no_grad():
        ref = hf_bf16(input_ids=ids).logits.float()
        got = engine(input_ids=ids).logits.float()
        naive = LlamaForCausalLM.from_pretrained(save_dir).to(torch.bfloat16)(input_ids=ids).logits.float()
    inv = {n: b.dtype for n, b in engine.module.named_buffers() if "inv_freq" in n}
    params = {p.dtype for p in engine.module.parameters()}
    return {"max_diff": (got - ref).abs().max().item(), "naive_diff": (naive - ref).abs().max().item(),
            "inv_freq": inv, "param_dtypes": params}


def save_body(stage, save_dir, precision="fp32", gather=True):
    import zerospeed
    from zerospeed.integrations.transformers import save_pretrained

    model = make_llama()
    zero = {"stage3_gather_16bit_weights_on_model_save": gather,
            "stage3_param_persistence_threshold": 0} if stage == 3 else {}
    engine, *_ = zerospeed.initialize(model=model, config=ds_config(stage, precision, **zero))
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(2):
        ids = batch(step).chunk(world)[rank]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    out = {}
    out["saved_bin"] = engine.save_16bit_model(save_dir)
    out["saved_st"] = engine.save_16bit_model(save_dir, "model16.safetensors")
    save_pretrained(engine, os.path.join(save_dir, "hf"))
    probe = batch(9, n=2)
    with torch.no_grad():
        out["logits"] = engine(input_ids=probe).logits.float()
    out["consolidated"] = engine.consolidated_state_dict()
    try:
        engine.module.save_pretrained(os.path.join(save_dir, "naive"))
        out["naive_error"] = None
    except RuntimeError as exc:
        out["naive_error"] = str(exc)
    try:
        engine.module.state_dict()
        out["state_dict_error"] = None
    except RuntimeError as exc:
        out["state_dict_error"] = str(exc)
    dist.barrier()
    return out
