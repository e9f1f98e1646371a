"""Worker of bench/bf16_master_bench.py: one DeepSpeed-style training run, zerospeed or DeepSpeed.

``python -m zerospeed.launcher.runner --num_procs 2 bench/bf16_master_worker.py LIB LOWPREC OUT``
with LIB ``zerospeed`` or ``deepspeed`` and LOWPREC ``0`` (fp32 masters) or ``1`` (bf16 masters and
optimizer states). Rank 0 writes OUT (JSON): losses, model-state bytes per rank as the library
reports them (zerospeed: ``engine.memory_breakdown()``; DeepSpeed: its master partitions and the
tensors in its optimizer state), and the peak RSS of the rank.
"""

import json
import resource
import sys
import time

import torch
from torch import nn

LIB, LOW, OUT = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
if LIB == "deepspeed":
    import deepspeed
else:
    import zerospeed as deepspeed

STEPS, DIM, LAYERS, BATCH = 20, 512, 8, 8


def tensor_bytes(obj) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o) for o in obj.values())
    return 0


def main() -> None:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(DIM, DIM), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(DIM, 16))
    bf16 = {"enabled": True}
    if LOW:
        bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
           "bf16": bf16, "zero_optimization": {"stage": 2}}
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(1)
    target = torch.randn(DIM, 16, generator=g) / DIM**0.5
    losses, times = [], []
    for step in range(STEPS):
        x = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(100 + 2 * step + rank))
        t0 = time.perf_counter()
        out = engine(x.to(torch.bfloat16))
        loss = nn.functional.mse_loss(out.float(), x @ target)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    numel = sum(p.numel() for p in model.parameters())
    if LIB == "zerospeed":
        mem = engine.memory_breakdown()
        master, states = mem["master_params"], mem["optimizer_states"]
    else:
        inner = engine.optimizer
        master = tensor_bytes(getattr(inner, "single_partition_of_fp32_groups", []))
        states = tensor_bytes(list(inner.optimizer.state.values()))
    if rank == 0:
        with open(OUT, "w") as f:
            json.dump({"losses": losses, "master_bytes": master, "optimizer_state_bytes": states, "numel": numel,
                       "median_step_s": sorted(times[2:])[len(times[2:]) // 2],
                       "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}, f)


if __name__ == "__main__":
    main()
