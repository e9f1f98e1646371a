"""One rank of bench/hf_bench.py (started by the zerospeed launcher). Prints ``RESULT {json}`` on rank 0.

``--what trainer``: the HF Trainer on a random Llama, ``--system plain`` (Trainer, DDP over gloo) or
``zs2`` / ``zs3`` (ZeroSpeedTrainer, ZeRO-2 / ZeRO-3): median seconds per optimizer step after the
warm-up steps, peak RSS per rank, and the engine's per-rank model-state bytes.
``--what init``: building the model plainly or under ``zero.Init`` (HF init applied on gathered
parameters): seconds and peak RSS growth.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import peak_rss_bytes  # noqa: E402

warnings.filterwarnings("ignore")


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256, pad_token_id=0)


def trainer_run(system: str, steps: int, warmup: int) -> dict:
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from zerospeed.integrations.transformers import ZeroSpeedTrainer

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config())
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": x, "labels": x.clone()} for x in torch.randint(3, 8000, (4 * 2 * (steps + warmup), 128),
                                                                         generator=g)]
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=steps + warmup,
                                 learning_rate=1e-4, logging_steps=1000, save_strategy="no", report_to=[],
                                 use_cpu=True, disable_tqdm=True, optim="adamw_torch")
        if system == "plain":
            trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Clock()])
        else:
            cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                   "gradient_clipping": "auto",
                   "zero_optimization": {"stage": int(system[-1]), "stage3_param_persistence_threshold": 0}}
            trainer = ZeroSpeedTrainer(model=model, args=args, train_dataset=data, callbacks=[Clock()], ds_config=cfg)
        trainer.train()
    out = {"step_s": statistics.median(times[warmup:]), "peak_rss_bytes": peak_rss_bytes()}
    if system != "plain":
        out["model_state_bytes"] = trainer.zerospeed_engine.memory_breakdown()["total"]
    return out


def init_run(system: str) -> dict:
    from transformers import LlamaForCausalLM

    from zerospeed import zero

    cfg = llama_config()
    LlamaForCausalLM(llama_config().__class__(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                              num_attention_heads=1))  # imports
    dist.barrier()
    base = peak_rss_bytes()
    t = time.perf_counter()
    if system == "zero_init":
        with zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
            model = LlamaForCausalLM(cfg)
    else:
        model = LlamaForCausalLM(cfg)
    seconds = time.perf_counter() - t
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"build_s": seconds, "peak_rss_growth_bytes": peak_rss_bytes() - base, "param_bytes_held": held}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--what", choices=("trainer", "init"), required=True)
    p.add_argument("--system", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    from zerospeed import comm

    comm.init_distributed()
    r = trainer_run(a.system, a.steps, a.warmup) if a.what == "trainer" else init_run(a.system)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, r)
    if dist.get_rank() == 0:
        row = {"what": a.what, "system": a.system, "world": dist.get_world_size()}
        for k in gathered[0]:
            row[k] = max(g[k] for g in gathered)  # the slowest / largest rank
        print("RESULT " + json.dumps(row), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
