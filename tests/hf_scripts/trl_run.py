"""A plain TRL script: SFTTrainer with a PEFT LoRA config, DPOTrainer with its own reference model, or GRPOTrainer
(a toy reward, no vLLM) on the full model or with a PEFT LoRA config. The trainer's config is parsed from the
command line, so ``--deepspeed ds.json`` switches DeepSpeed on; nothing in it knows about zerospeed.

argv: MODE (sft | dpo | grpo | grpo_lora) MODEL_DIR OUT then SFTConfig / DPOConfig / GRPOConfig flags. GRPO records
every logged metric (loss, reward, kl, entropy, completion lengths...) of every step. MODEL_DIR holds a saved causal
LM and a tokenizer. Every rank writes OUT.rank<N> (JSON): the loss of every logged step, the wrapped model's class,
whether the model (and the DPO reference model) were partitioned, and, for SFT, the logits of the LoRA-merged model
(``merge_and_unload`` on the live model, under ``deepspeed.zero.GatheredParameters`` when ZeRO-3 partitioned it, as
PEFT's documentation says) on a fixed batch. The adapter is saved with ``trainer.save_model(OUT_adapter)``."""

import contextlib
import json
import sys

import torch
import zerospeed.comm.lifecycle  # noqa: F401 - its exit handler keeps torch 2.13's gloo exit abort off the plain
# reference runs too (they never import zerospeed otherwise; see settle_gloo_workers)
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, TrainerCallback

WORDS = 60  # the word-level tokenizer's words are w0 .. w59


class Losses(TrainerCallback):
    def __init__(self):
        self.losses = []
        self.metrics = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            self.metrics.append({k: float(v) for k, v in logs.items() if isinstance(v, (int, float))})


def _sentence(g, n):
    return " ".join(f"w{int(i)}" for i in torch.randint(0, WORDS, (n,), generator=g))


def sft_data():
    g = torch.Generator().manual_seed(7)
    return Dataset.from_dict({"text": [_sentence(g, 7) for _ in range(16)]})


def dpo_data():
    g = torch.Generator().manual_seed(11)
    rows = [(_sentence(g, 3), _sentence(g, 4), _sentence(g, 4)) for _ in range(16)]
    return Dataset.from_dict({"prompt": [r[0] for r in rows], "chosen": [r[1] for r in rows],
                              "rejected": [r[2] for r in rows]})


def grpo_data():
    g = torch.Generator().manual_seed(13)
    return Dataset.from_dict({"prompt": [_sentence(g, 3) for _ in range(16)]})


def count_low_words(completions, **kwargs):
    """A toy reward: the share of words w0 .. w29 in each completion."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(w.startswith("w") and w[1:].isdigit() and int(w[1:]) < 30 for w in words) / max(1, len(words)))
    return out


def _partitioned(model):
    return model is not None and any(hasattr(p, "ds_id") for p in model.parameters())


def _merged_logits(model, ids):
    """Merge the LoRA adapter into the live model and run it (every rank; ZeRO-3: inside GatheredParameters)."""
    params = list(model.parameters())
    gather = contextlib.nullcontext()
    if _partitioned(model):
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    with gather, torch.no_grad():
        merged = model.merge_and_unload()
        merged.eval()
        return merged(input_ids=ids).logits.tolist()


def main():
    mode, model_dir, out = sys.argv[1:4]
    torch.set_num_threads(1)
    if mode == "sft":
        from trl import SFTConfig as Config, SFTTrainer as TrainerClass
    elif mode == "dpo":
        from trl import DPOConfig as Config, DPOTrainer as TrainerClass
    else:
        from trl import GRPOConfig as Config, GRPOTrainer as TrainerClass
    from peft import LoraConfig
    (args,) = HfArgumentParser(Config).parse_args_into_dataclasses(sys.argv[4:])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    losses = Losses()
    kwargs = {"model": model, "args": args, "processing_class": tokenizer, "callbacks": [losses]}
    if mode == "sft":
        kwargs.update(train_dataset=sft_data(), peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                                       target_modules=["q_proj", "v_proj"]))
    elif mode == "dpo":
        kwargs.update(train_dataset=dpo_data())
    else:
        kwargs.update(train_dataset=grpo_data(), reward_funcs=count_low_words)
        if mode == "grpo_lora":
            kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    trainer = TrainerClass(**kwargs)
    trainer.train()
    trainer.save_model(out + "_adapter" if mode in ("sft", "grpo_lora") else out + "_model")
    record = {"losses": losses.losses, "wrapped": type(trainer.model_wrapped).__name__,
              "partitioned": _partitioned(trainer.model), "world": args.world_size}
    if mode.startswith("grpo"):
        record["metrics"] = losses.metrics
        ref = getattr(trainer, "ref_model", None)
        record["ref_wrapped"] = type(ref).__name__
        record["ref_partitioned"] = _partitioned(getattr(ref, "module", ref))
    elif mode == "dpo":
        ref = getattr(trainer, "ref_model", None)
        record["ref_wrapped"] = type(ref).__name__
        record["ref_partitioned"] = _partitioned(getattr(ref, "module", ref))
    else:
        ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
        record["merged_logits"] = _merged_logits(trainer.model, ids)
    with open(f"{out}.rank{args.process_index}", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
