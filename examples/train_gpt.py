"""Train a small GPT with zerospeed: the script `make demo` runs on 2 local processes.

    zerospeed --num_procs 2 examples/train_gpt.py --config examples/configs/gpt_zero2.json

It is a DeepSpeed training script with the import changed: ``zerospeed.initialize`` reads the
DeepSpeed JSON config; the loop calls ``engine(x, y)``, ``engine.backward(loss)``,
``engine.step()``. Rank 0 shows a progress bar (tokens/s, loss, loss scale) and ends with a
summary: final and held-out loss, throughput, and every rank's bytes of parameters, gradients and
optimizer states next to what the ZeRO formulas predict.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zerospeed  # noqa: E402
from zerospeed import comm  # noqa: E402
from zerospeed.zero.memory import estimate_model_state_bytes  # noqa: E402

from data import SyntheticTextDataset  # noqa: E402
from gpt_model import GPT, gpt_small  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "configs", "gpt_zero2.json"),
                   help="DeepSpeed-format JSON config")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps to train")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local_rank", type=int, default=None, help="accepted for DeepSpeed launchers; unused")
    return p.parse_args()


def mib(n: float) -> str:
    return f"{n / 2**20:7.2f} MiB"


@torch.no_grad()
def held_out_loss(engine: zerospeed.ZeroSpeedEngine, seq_len: int, batches: int = 4) -> float:
    engine.eval()
    data = SyntheticTextDataset(seq_len=seq_len, num_samples=batches * 8, seed=1)
    total = 0.0
    for i in range(batches):
        x = torch.stack([data[8 * i + j][0] for j in range(8)])
        y = torch.stack([data[8 * i + j][1] for j in range(8)])
        total += engine(x, y).item()
    engine.train()
    return total / batches


def main() -> None:
    args = parse_args()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    zerospeed.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    torch.manual_seed(args.seed)
    gpt_cfg = gpt_small()
    model = GPT(gpt_cfg)
    num_params = sum(p.numel() for p in model.parameters())  # before initialize: stage 3 partitions them
    with open(args.config) as f:
        config = json.load(f)
    dataset = SyntheticTextDataset(seq_len=gpt_cfg.seq_len, num_samples=4096, seed=0)
    engine, _, loader, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=dataset, config=config)
    gas = engine.gradient_accumulation_steps()
    tokens_per_step = engine.train_batch_size() * gpt_cfg.seq_len
    if rank == 0:
        print(f"zerospeed demo: GPT {num_params / 1e6:.2f}M parameters, ZeRO stage {engine.zero_stage}, "
              f"{engine.config.precision}, {world} processes, global batch {engine.train_batch_size()} "
              f"({engine.train_micro_batch_size_per_gpu()} per rank x {gas} accumulation)", flush=True)
    bar = tqdm(total=args.steps, disable=rank != 0, unit="step", dynamic_ncols=True, file=sys.stdout)
    losses: list[float] = []
    start = time.perf_counter()
    epoch = 0
    data_iter = iter(loader)
    while engine.global_steps < args.steps:
        step_loss = torch.zeros(())
        for _ in range(gas):
            try:
                x, y = next(data_iter)
            except StopIteration:
                epoch += 1
                loader.sampler.set_epoch(epoch)
                data_iter = iter(loader)
                x, y = next(data_iter)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().float() / gas
        comm.all_reduce(step_loss)
        losses.append(step_loss.item() / world)
        elapsed = time.perf_counter() - start
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_step * len(losses) / elapsed:,.0f}",
                        scale=f"{engine.loss_scale:g}", lr=f"{engine.get_lr()[0]:.2e}")
        bar.update(1)
    bar.close()
    elapsed = time.perf_counter() - start
    eval_loss = held_out_loss(engine, gpt_cfg.seq_len)
    memories = comm.all_gather_object(engine.memory_breakdown())
    if rank == 0:
        final = sum(losses[-5:]) / min(5, len(losses))
        print("\n== summary ==")
        print(f"loss: first {losses[0]:.3f} -> final {final:.3f} (mean of last 5 steps); held-out {eval_loss:.3f}")
        print(f"throughput: {tokens_per_step * len(losses) / elapsed:,.0f} tokens/s over {len(losses)} steps "
              f"({elapsed:.1f} s); skipped steps: {engine.skipped_steps}")
        predicted = estimate_model_state_bytes(num_params, world, engine.zero_stage, engine.config.precision, "adamw")
        print(f"model state per rank (ZeRO-{engine.zero_stage}, {engine.config.precision}, Adam):")
        print(f"  {'rank':>4}  {'params':>11}  {'grads':>11}  {'optim+master':>12}  {'total':>11}")
        for r, m in enumerate(memories):
            print(f"  {r:>4}  {mib(m['params'])}  {mib(m['grads'])}  {mib(m['optimizer_states'] + m['master_params']):>12}"
                  f"  {mib(m['total'])}")
        print(f"  {'ZeRO':>4}  {mib(predicted.params)}  {mib(predicted.grads)}  {mib(predicted.optimizer_states):>12}"
              f"  {mib(predicted.total)}   (formula, unpadded)")
        if any(m.get("optimizer_states_nvme") for m in memories):
            print("  offloaded optimizer states on NVMe, per rank: "
                  + ", ".join(f"rank {r}: {mib(m['optimizer_states_nvme']).strip()} on disk, "
                              f"{mib(m['offload_buffers']).strip()} of swap buffers in memory"
                              for r, m in enumerate(memories)))


if __name__ == "__main__":
    main()
