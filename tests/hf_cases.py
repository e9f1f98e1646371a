"""Tiny random-init HuggingFace models and per-rank bodies for the tests/test_hf_*.py files.

Models come from configs only (random weights, never a download). Every body is a module-level
function so ``run_distributed`` can start it by name.
"""

from __future__ import annotations

import math
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

    kw = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2,
              embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
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
def passthrough_body(stages):
    return {stage: _passthrough(stage) for stage in stages}


def _passthrough(stage):
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
    engine.destroy()
    return out


def world1_body(save_dir, bad_dir):
    return {"bf16": bf16_logits_body(save_dir), "bad_input": bad_save_args(bad_dir)}


def bad_save_args(save_dir):
    import zerospeed
    from zerospeed.integrations.transformers import save_pretrained

    engine, *_ = zerospeed.initialize(model=make_llama(), config=ds_config(0))
    errors = []
    for call in (lambda: engine.save_16bit_model(save_dir, "a/b.bin"),
                 lambda: engine.save_16bit_model(os.path.join(save_dir, "file")),
                 lambda: save_pretrained(engine, save_dir, state_dict={}),
                 lambda: save_pretrained(object(), save_dir)):
        try:
            call()
            errors.append(None)
        except (ValueError, TypeError) as exc:
            errors.append(str(exc))
    return errors


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


def save_body(save_root, cases):
    out = {}
    for stage, precision in cases:
        folder = os.path.join(save_root, f"{stage}-{precision}")
        out[(stage, precision)] = _save_case(stage, folder, precision)
    out["no_gather"] = _no_gather(os.path.join(save_root, "no_gather"))
    return out


def _no_gather(save_dir):
    import zerospeed

    engine, *_ = zerospeed.initialize(model=make_llama(), config=ds_config(3))
    saved = engine.save_16bit_model(save_dir)
    engine.destroy()
    return saved


def _save_case(stage, save_dir, precision="fp32", gather=True):
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
    engine.destroy()
    return out


# -- zero.Init initialisation ---------------------------------------------------------------------
class ParentInits(torch.nn.Module):
    """Initialises its children's weights in its own __init__, after creating them."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16, padding_idx=0)
        self.lin = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, VOCAB)
        torch.nn.init.normal_(self.lin.weight, std=0.5)
        torch.nn.init.zeros_(self.lin.bias)
        torch.nn.init.xavier_uniform_(self.head.weight)

    def forward(self, ids):
        return self.head(torch.relu(self.lin(self.embed(ids))))


class Block(torch.nn.Module):
    """Its ``_reset_parameters`` initialises its child's parameters and reads their shapes."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.gain = torch.nn.Parameter(torch.empty(16))

    def _reset_parameters(self):
        bound = 1.0 / math.sqrt(self.proj.weight.shape[1])
        torch.nn.init.uniform_(self.proj.weight, -bound, bound)
        torch.nn.init.constant_(self.proj.bias, 0.1)
        with torch.no_grad():
            self.gain.copy_(torch.linspace(0.5, 1.5, 16))

    def forward(self, x):
        return self.proj(x) * self.gain


class ResetPass(torch.nn.Module):
    """Builds everything, then runs a reset_parameters pass over its modules."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.attn = Block()
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, VOCAB)
        self.apply(self._reset)

    @staticmethod
    def _reset(m):
        if isinstance(m, torch.nn.Embedding):
            m.reset_parameters()
            torch.nn.init.uniform_(m.weight, -0.1, 0.1)
        elif isinstance(m, Block):
            m._reset_parameters()
        elif isinstance(m, torch.nn.Linear):
            m.reset_parameters()

    def forward(self, ids):
        x = self.embed(ids)
        return self.head(self.norm(self.attn(x)))


def _build(kind):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    return {"gpt2": lambda: GPT2LMHeadModel(gpt2_config()), "llama": lambda: LlamaForCausalLM(llama_config()),
            "parent_inits": ParentInits, "reset_pass": ResetPass}[kind]()


def _first_loss(model, kind):
    import zerospeed

    engine, *_ = zerospeed.initialize(model=model, config=ds_config(3, stage3_param_persistence_threshold=0))
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = batch(0).chunk(world)[rank]
    if kind in ("gpt2", "llama"):
        loss = engine(input_ids=ids, labels=ids).loss
    else:
        loss = torch.nn.functional.cross_entropy(engine(ids).flatten(0, 1), ids.flatten())
    total = loss.detach().clone()
    dist.all_reduce(total)
    engine.destroy()
    return total.item() / world


def zero_init_body(kinds):
    from zerospeed import zero

    out = {}
    for kind in kinds:
        torch.manual_seed(11)
        plain = _build(kind)
        torch.manual_seed(11)
        with zero.Init(config_dict_or_path=ds_config(3)):
            built = _build(kind)
        rec = {"partitioned": all(p.numel() == 0 for p in built.parameters())}
        with zero.GatheredParameters(list(built.parameters())):
            rec["params"] = {n: (p.detach().clone(), q.detach().clone())
                             for (n, p), (_, q) in zip(built.named_parameters(), plain.named_parameters())}
        rec["loss_init"], rec["loss_plain"] = _first_loss(built, kind), _first_loss(plain, kind)
        out[kind] = rec
    return out


# -- the HF Trainer -------------------------------------------------------------------------------
TRAIN_STEPS = 4


def trainer_dataset(n=32):
    ids = batch(77, n=n)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def trainer_ds_config(stage, with_sections=False):
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto",
                                 "stage3_gather_16bit_weights_on_model_save": True}}
    if with_sections:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto"}}
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                           "warmup_num_steps": "auto"}}
    return cfg


def _trainer(kind, out_dir, stage=None, sections=False):
    from transformers import Trainer, TrainingArguments

    from zerospeed.integrations.transformers import ZeroSpeedTrainer

    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=TRAIN_STEPS, learning_rate=2e-3, weight_decay=0.01, max_grad_norm=1.0,
                             warmup_steps=1, lr_scheduler_type="constant_with_warmup", logging_steps=1,
                             save_strategy="steps", save_steps=2, report_to=[], use_cpu=True, seed=0,
                             data_seed=0, disable_tqdm=True, optim="adamw_torch", save_only_model=False)
    if kind == "zs_init":  # built under zero.Init: HF's init on gathered parameters, same weights
        from zerospeed import zero

        torch.manual_seed(0)
        with zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
            model = make_llama(seed=0)
    else:
        model = make_llama(seed=0)
    if kind == "plain":
        return Trainer(model=model, args=args, train_dataset=trainer_dataset())
    return ZeroSpeedTrainer(model=model, args=args, train_dataset=trainer_dataset(),
                            ds_config=trainer_ds_config(stage, sections))


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _probe_logits(model):
    with torch.no_grad():
        return model(input_ids=batch(9, n=2)).logits.float()


def trainer_body(root, runs):
    """Each run: (name, kind, stage, sections). Trains, saves the final model, then resumes a fresh
    trainer from checkpoint-2 of the run and trains to the end again."""
    out = {}
    for name, kind, stage, sections in runs:
        folder = os.path.join(root, name)
        trainer = _trainer(kind, folder, stage, sections)
        trainer.train()
        rec = {"losses": _losses(trainer), "grad_norms": [h["grad_norm"] for h in trainer.state.log_history
                                                          if "grad_norm" in h]}
        rec["logits"] = _probe_logits(trainer.model_wrapped)
        rec["eval_loss"] = trainer.evaluate(eval_dataset=trainer_dataset(8))["eval_loss"]
        if kind != "plain":
            trainer.save_model(os.path.join(folder, "final"))
            rec["engine_stage"] = trainer.zerospeed_engine.zero_stage
            rec["lr"] = trainer.zerospeed_engine.get_lr()
        if kind == "zs" and stage == 3:
            resumed = _trainer(kind, folder, stage, sections)
            resumed.train(resume_from_checkpoint=os.path.join(folder, "checkpoint-2"))
            rec["resumed_losses"] = _losses(resumed)
            rec["resumed_logits"] = _probe_logits(resumed.model_wrapped)
            rec["resumed_step"] = resumed.state.global_step
        out[name] = rec
        dist.barrier()
    out["misaligned"] = _misaligned(os.path.join(root, "misaligned"))
    return out


def _misaligned(folder):
    """3 micro-batches per rank per epoch with accumulation 2: refused, not silently shifted."""
    from transformers import TrainingArguments

    from zerospeed.integrations.transformers import ZeroSpeedTrainer

    args = TrainingArguments(output_dir=folder, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=3, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no")
    trainer = ZeroSpeedTrainer(model=make_llama(), args=args, train_dataset=trainer_dataset(12),
                               ds_config=trainer_ds_config(2))
    try:
        trainer.train()
    except RuntimeError as exc:
        return str(exc)
    return None


# -- resize_token_embeddings under ZeRO-3 ---------------------------------------------------------
def resize_body(new_vocab):
    import zerospeed
    from zerospeed import zero
    from zerospeed.integrations.transformers import resize_token_embeddings

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(5)
    plain = make_llama(seed=5)
    torch.manual_seed(9)
    plain.resize_token_embeddings(new_vocab, mean_resizing=False)
    torch.manual_seed(5)
    with zero.Init(config_dict_or_path=ds_config(3)):
        model = make_llama(seed=5)
    torch.manual_seed(9)
    resize_token_embeddings(model, new_vocab, mean_resizing=False)
    out = {"vocab": model.config.vocab_size, "partitioned": all(p.numel() == 0 for p in model.parameters())}
    with zero.GatheredParameters(list(model.parameters())):
        out["equal"] = {n: torch.equal(p, q) for (n, p), (_, q) in zip(model.named_parameters(),
                                                                       plain.named_parameters())}
        out["shapes"] = {n: tuple(p.shape) for n, p in model.named_parameters() if "embed" in n or "lm_head" in n}
    ids = torch.randint(3, new_vocab, (4, SEQ), generator=torch.Generator().manual_seed(3))
    losses = {}
    for name, m in (("zero3", model), ("plain", plain)):
        cfg = ds_config(3 if name == "zero3" else 0, stage3_param_persistence_threshold=0) if name == "zero3" \
            else ds_config(0)
        engine, *_ = zerospeed.initialize(model=m, config=cfg)
        run = []
        for _ in range(2):
            x = ids.chunk(world)[rank]
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            run.append(total.item() / world)
        losses[name] = run
        if name == "zero3":
            try:
                resize_token_embeddings(engine, new_vocab + 8)
                out["engine_error"] = None
            except ValueError as exc:
                out["engine_error"] = str(exc)
            try:
                with zero.GatheredParameters([m.lm_head.weight], modifier_rank=0):
                    m.lm_head.weight.data = torch.zeros(new_vocab + 8, 32)
                out["gathered_error"] = None
            except ValueError as exc:
                out["gathered_error"] = str(exc)
        engine.destroy()
    out["losses"] = losses
    return out


def zero_init_and_resize_body(kinds, new_vocab):
    return {"init": zero_init_body(kinds), "resize": resize_body(new_vocab)}
