"""Train a small GPT with zerospeed: the script `make demo` runs on 2 local processes.

    zerospeed --num_procs 2 examples/train_gpt.py --config examples/configs/gpt_zero2.json

It is a DeepSpeed training script with the import changed: ``zerospeed.initialize`` reads the
DeepSpeed JSON config; the loop calls ``engine(x, y)``, ``engine.backward(loss)``,
``engine.step()``. The text is real: the Python standard library's own source files, one token
per byte (``--data synthetic`` uses the generated grammar instead); the last modules are held out.
Rank 0 shows a progress bar (tokens/s, loss, loss scale), evaluates the held-out loss every
``--eval_every`` steps, and ends with a summary (final and held-out loss, throughput, every rank's
bytes of parameters, gradients and optimizer states next to what the ZeRO formulas predict), a
short sample of generated code, and a PNG of the loss curves and tokens/s (``--plot``).
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

from data import ByteTextDataset, SyntheticTextDataset, decode, encode, stdlib_corpus  # noqa: E402
from gpt_model import GPT, gpt_small  # noqa: E402
from plot import plot_training  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "configs", "gpt_zero2.json"),
                   help="DeepSpeed-format JSON config")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps to train")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", choices=["stdlib", "synthetic"], default="stdlib",
                   help="stdlib: the Python standard library's source (real text); synthetic: generated grammar")
    p.add_argument("--eval_every", type=int, default=10, help="held-out loss every N steps (and at the end)")
    p.add_argument("--plot", default=os.path.join("runs", "train_gpt.png"), help="where to write the PNG")
    p.add_argument("--sample_bytes", type=int, default=0, help="bytes of code to generate at the end (0: none)")
    p.add_argument("--local_rank", type=int, default=None, help="accepted for DeepSpeed launchers; unused")
    return p.parse_args()


def mib(n: float) -> str:
    return f"{n / 2**20:7.2f} MiB"


@torch.no_grad()
def held_out_loss(engine: zerospeed.ZeroSpeedEngine, data: torch.utils.data.Dataset, batches: int = 4) -> float:
    """Mean loss over the first ``batches`` x 8 held-out windows (every rank runs the same batches:
    under ZeRO-3 every rank must take part in each forward)."""
    engine.eval()
    total = 0.0
    for i in range(batches):
        x = torch.stack([data[8 * i + j][0] for j in range(8)])
        y = torch.stack([data[8 * i + j][1] for j in range(8)])
        total += engine(x, y).item()
    engine.train()
    return total / batches


@torch.no_grad()
def generate(engine: zerospeed.ZeroSpeedEngine, prompt: str, num_bytes: int, seq_len: int) -> str:
    """Sample ``num_bytes`` bytes after ``prompt`` (temperature 0.8, same generator on every rank)."""
    engine.eval()
    g = torch.Generator().manual_seed(0)
    ids = encode(prompt).unsqueeze(0)
    for _ in range(num_bytes):
        logits = engine(ids[:, -seq_len:])[0, -1].float()
        nxt = torch.multinomial(torch.softmax(logits / 0.8, dim=-1).cpu(), 1, generator=g)
        ids = torch.cat([ids, nxt.view(1, 1).to(ids.device)], dim=1)
    engine.train()
    return decode(ids[0])


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
    if args.data == "stdlib":
        train_text, held_text = stdlib_corpus()
        dataset = ByteTextDataset(train_text, gpt_cfg.seq_len)
        held_out = ByteTextDataset(held_text, gpt_cfg.seq_len)
        source = f"Python {sys.version_info.major}.{sys.version_info.minor} stdlib source, " \
                 f"{len(train_text) / 1e6:.1f} MB train / {len(held_text) / 1e3:.0f} KB held out"
    else:
        dataset = SyntheticTextDataset(seq_len=gpt_cfg.seq_len, num_samples=4096, seed=0)
        held_out = SyntheticTextDataset(seq_len=gpt_cfg.seq_len, num_samples=32, seed=1)
        source = "synthetic grammar"
    engine, _, loader, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=dataset, config=config)
    gas = engine.gradient_accumulation_steps()
    tokens_per_step = engine.train_batch_size() * gpt_cfg.seq_len
    if rank == 0:
        print(f"zerospeed demo: GPT {num_params / 1e6:.2f}M parameters, ZeRO stage {engine.zero_stage}, "
              f"{engine.config.precision}, {world} processes, global batch {engine.train_batch_size()} "
              f"({engine.train_micro_batch_size_per_gpu()} per rank x {gas} accumulation); data: {source}",
              flush=True)
    bar = tqdm(total=args.steps, disable=rank != 0, unit="step", dynamic_ncols=True, file=sys.stdout)
    losses: list[float] = []
    speeds: list[float] = []
    evals: list[tuple[int, float]] = []
    start = time.perf_counter()
    epoch = 0
    data_iter = iter(loader)
    while engine.global_steps < args.steps:
        step_start = time.perf_counter()
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
        speeds.append(tokens_per_step / (time.perf_counter() - step_start))
        if args.eval_every and engine.global_steps % args.eval_every == 0 and engine.global_steps < args.steps:
            evals.append((engine.global_steps, held_out_loss(engine, held_out)))
        elapsed = time.perf_counter() - start
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_step * len(losses) / elapsed:,.0f}",
                        scale=f"{engine.loss_scale:g}", lr=f"{engine.get_lr()[0]:.2e}")
        bar.update(1)
    bar.close()
    elapsed = time.perf_counter() - start
    eval_loss = held_out_loss(engine, held_out)
    evals.append((engine.global_steps, eval_loss))
    sample = generate(engine, "def ", args.sample_bytes, gpt_cfg.seq_len) if args.sample_bytes else ""
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

    if rank == 0:
        if sample:
            print("\nsample (temperature 0.8, prompt 'def '):\n" + "-" * 60 + "\n" + sample + "\n" + "-" * 60)
        title = (f"GPT {num_params / 1e6:.2f}M on {source}\nZeRO-{engine.zero_stage}, {engine.config.precision}, "
                 f"{world} processes, global batch {engine.train_batch_size()} x {gpt_cfg.seq_len} tokens")
        path = plot_training(args.plot, losses, evals, speeds, title)
        print(f"plot: {path}", flush=True)


if __name__ == "__main__":
    main()
