"""A plain HuggingFace Trainer script: TrainingArguments from the command line (so `--deepspeed ds.json` switches it),
then `from_pretrained`, then `Trainer.train()`. Nothing in it knows about zerospeed.

argv: MODEL_DIR OUT_JSON then TrainingArguments flags. The main process writes the loss of every step, the model
class, whether ZeRO-3 partitioned the model while it was loaded, and this rank's peak RSS during from_pretrained
(every rank writes OUT_JSON.rank<N>).

Reference runs only: with REFERENCE_WARMUP_LR_STEPS=W in the environment the plain Trainer's scheduler is DeepSpeed's
WarmupLR (log warm-up from 0 over W steps, then constant: lr factor 0 at the first update, min(1, log k / log W) at
update k), which no HF scheduler type reproduces.
"""

import json
import math
import os
import resource
import sys

import torch
import zerospeed.comm.lifecycle  # noqa: F401 - its exit handler keeps torch 2.13's gloo exit abort off the plain
# reference runs too (they never import zerospeed otherwise; see settle_gloo_workers)
from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainerCallback, TrainingArguments

VOCAB, SEQ, N = 96, 8, 32


class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(3, VOCAB, (N, SEQ), generator=g)

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Losses(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


class WarmupLRTrainer(Trainer):
    def create_scheduler(self, num_training_steps, optimizer=None):
        if self.lr_scheduler is None:
            w = int(os.environ["REFERENCE_WARMUP_LR_STEPS"])
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer or self.optimizer, lambda k: 0.0 if k == 0 else min(1.0, math.log(k) / math.log(w)))
        return self.lr_scheduler


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(sys.argv[3:])
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
    losses = Losses()
    trainer_class = WarmupLRTrainer if os.environ.get("REFERENCE_WARMUP_LR_STEPS") else Trainer
    trainer = trainer_class(model=model, args=args, train_dataset=Data(), callbacks=[losses])
    trainer.train()
    record = {"losses": losses.losses, "partitioned_at_load": partitioned, "peak_rss_after_load_kib": peak_kib,
              "wrapped": type(trainer.model_wrapped).__name__, "world": args.world_size}
    with open(f"{out}.rank{args.process_index}", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
