"""Worker of bench/optim_bench.py's DeepSpeed comparison: one Muon (or AdamW) training run, zerospeed or DeepSpeed.

``python -m zerospeed.launcher.runner --num_procs 2 bench/optim_worker.py LIB OPT STAGE STEPS OUT``
with LIB ``zerospeed`` or ``deepspeed``. The same script, model (the example GPT, small), seed, batches and
config run under both libraries; parameters are tagged by DeepSpeed's rule in both (no parameter groups:
DeepSpeed sets ``use_muon`` from the names itself, so the example GPT's ``tok_emb`` / ``pos_emb`` are on
Muon in both). Rank 0 writes OUT (JSON): the losses, the median ``engine.step()`` and whole-step times
(2 warm-up steps excluded).
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt_model import GPT, gpt_small  # noqa: E402

LIB, OPT, STAGE, STEPS, OUT = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
if LIB == "deepspeed":
    import deepspeed
else:
    import zerospeed as deepspeed

MICRO_BATCH, WARMUP = 4, 2
OPTIMIZERS = {
    "Muon": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-3, "momentum": 0.95, "weight_decay": 0.0}},
    "AdamW": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8}},
}


def main() -> None:
    torch.set_num_threads(1)
    cfg_model = gpt_small()
    torch.manual_seed(0)
    model = GPT(cfg_model)
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
           "gradient_clipping": 1.0, "optimizer": OPTIMIZERS[OPT], "zero_optimization": {"stage": STAGE}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1)
    losses, step_s, total_s = [], [], []
    for i in range(WARMUP + STEPS):
        batch = torch.randint(0, cfg_model.vocab_size, (MICRO_BATCH * world, cfg_model.seq_len + 1), generator=gen)
        mine = batch.chunk(world)[rank]
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(mine[:, :-1], mine[:, 1:])
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        if i >= WARMUP:
            step_s.append(t2 - t1)
            total_s.append(t2 - t0)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    if rank == 0:
        Path(OUT).write_text(json.dumps({"losses": losses, "opt_step_s": statistics.median(step_s),
                                         "train_step_s": statistics.median(total_s)}))


if __name__ == "__main__":
    main()
