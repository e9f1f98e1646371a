"""Activation checkpointing: step time and activation memory on the GPT bench model at seq 512.

Model: ``examples/gpt_model.gpt_bench()`` dimensions (8 layers, d_model 384, 6 heads, byte
vocabulary, ~14M parameters) at sequence length 512, batch ``--batch``, fp32, one process, one
checkpoint per transformer block. Modes, all on the same model, weights and data in one run:

* ``none``: no checkpointing;
* ``zerospeed full``: ``zerospeed.checkpointing.checkpoint`` (torch's non-reentrant scheme);
* ``zerospeed selective``: ``selective_policy: save_matmuls`` (torch's selective API: matmul and
  attention outputs kept, the rest recomputed);
* ``zerospeed cpu-offload``: ``cpu_checkpointing`` (the reentrant Function holding the inputs in
  host memory; on a CPU-only machine the tensors already live there, so this measures its
  overhead, not a memory move);
* ``deepspeed full`` / ``deepspeed cpu-offload``: ``deepspeed.checkpointing.checkpoint`` after
  ``deepspeed.checkpointing.configure(None, ...)`` (cpu-offload with ``partition_activations`` and
  ``checkpoint_in_cpu``, as DeepSpeed requires); DeepSpeed has no selective policy.

Measured per mode: the median wall time and CPU time (one thread: the work itself, robust to
other jobs on a shared machine) of a forward + backward (``--steps`` after one warm-up,
modes interleaved over ``--rounds`` rounds so drift on a shared machine hits all alike); the peak
of bytes allocated above the start during one forward + backward
(:func:`zerospeed.checkpointing.peak_allocated_bytes`: CUDA's allocator peak on GPU, torch
profiler memory events on CPU); the bytes autograd saves for the backward
(:class:`zerospeed.checkpointing.SavedTensorBytes`: blind to what a selective policy caches and to
tensors DeepSpeed keeps as attributes, so the peak is the figure to compare); the loss and
gradient norm (every mode must give the same).

Usage (DeepSpeed rows need the bench venv)::

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$PWD/.venv-bench/torch_extensions OMP_NUM_THREADS=1 \\
        PYTHONPATH=$PWD/src .venv-bench/bin/python bench/activation_bench.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))


def _modes(no_deepspeed: bool) -> tuple[dict[str, Callable[[], Any]], str | None]:
    """mode name -> setup() returning the per-block checkpoint function (None: no checkpointing)."""
    import zerospeed.checkpointing as zck

    def zs(**kwargs: Any) -> Callable[[], Any]:
        def setup() -> Any:
            zck.reset()
            if kwargs:
                zck.configure(None, **kwargs)
            return zck.checkpoint
        return setup

    modes: dict[str, Callable[[], Any]] = {
        "none": lambda: (zck.reset(), None)[1],
        "zerospeed full": zs(),
        "zerospeed selective": zs(policy="save_matmuls"),
        "zerospeed cpu-offload": zs(checkpoint_in_cpu=True),
    }
    skipped = None
    if not no_deepspeed:
        try:
            import deepspeed

            dck = deepspeed.checkpointing  # an attribute alias of runtime.activation_checkpointing.checkpointing
            # DeepSpeed's configure() asks its comm backend for the rank: a world of one over gloo
            import socket

            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port))
            deepspeed.init_distributed(dist_backend="gloo")
        except Exception as exc:  # noqa: BLE001 - report why the rows are missing
            skipped = f"deepspeed rows skipped: {type(exc).__name__}: {exc}"
        else:
            def ds(**kwargs: Any) -> Callable[[], Any]:
                def setup() -> Any:
                    zck.reset()
                    dck.reset()
                    dck.configure(None, **kwargs)
                    return dck.checkpoint
                return setup

            modes["deepspeed full"] = ds(partition_activations=False, checkpoint_in_cpu=False)
            modes["deepspeed cpu-offload"] = ds(partition_activations=True, checkpoint_in_cpu=True)
            del deepspeed
    return modes, skipped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=2, help="timed steps per mode and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no_deepspeed", action="store_true")
    p.add_argument("--no_write", action="store_true")
    args = p.parse_args()

    from common import command_line, write_results
    from gpt_model import GPT, GPTConfig, gpt_bench

    import zerospeed.checkpointing as zck

    torch.set_num_threads(1)
    base = gpt_bench()
    cfg = GPTConfig(vocab_size=base.vocab_size, n_layer=base.n_layer, n_head=base.n_head, d_model=base.d_model,
                    seq_len=args.seq)
    torch.manual_seed(0)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    y = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    modes, skipped = _modes(args.no_deepspeed)
    if skipped:
        print(skipped, flush=True)

    def step() -> tuple[float, float]:
        model.zero_grad(set_to_none=False)  # gradients stay allocated: the peak is activations, not grads
        loss = model(x, y)
        loss.backward()
        norm = torch.sqrt(sum(p.grad.float().square().sum() for p in model.parameters() if p.grad is not None))
        return loss.item(), norm.item()

    times: dict[str, list[float]] = {m: [] for m in modes}
    cpu_times: dict[str, list[float]] = {m: [] for m in modes}
    results: dict[str, dict[str, Any]] = {}
    for rnd in range(args.rounds):
        for name, setup in modes.items():
            model.checkpoint_fn = setup()
            if rnd == 0:
                step()  # warm-up
                with zck.SavedTensorBytes(ignore=model.parameters()) as saved:
                    loss = model(x, y)
                del loss
                peak = zck.peak_allocated_bytes(step)
                loss_value, norm = step()
                results[name] = {"mode": name, "saved_bytes": saved.total, "peak_bytes": peak,
                                 "loss": loss_value, "grad_norm": norm}
            for _ in range(args.steps):
                t0, c0 = time.perf_counter(), time.process_time()
                step()
                times[name].append(time.perf_counter() - t0)
                cpu_times[name].append(time.process_time() - c0)
            print(f"round {rnd}: {name}: {statistics.median(times[name]):.3f} s", flush=True)

    none = results["none"]
    t_none = statistics.median(times["none"])
    c_none = statistics.median(cpu_times["none"])
    rows = []
    for name, r in results.items():
        t = statistics.median(times[name])
        c = statistics.median(cpu_times[name])
        rows.append({"mode": name, "step_s": round(t, 4), "time_vs_none": round(t / t_none, 3),
                     "step_cpu_s": round(c, 4), "cpu_vs_none": round(c / c_none, 3),
                     "peak_MiB": round(r["peak_bytes"] / 2**20, 2),
                     "peak_vs_none": round(r["peak_bytes"] / none["peak_bytes"], 3),
                     "saved_MiB": round(r["saved_bytes"] / 2**20, 2),
                     "loss": round(r["loss"], 6), "grad_norm": round(r["grad_norm"], 6)})
    for name in ("full", "cpu-offload"):
        z, d = f"zerospeed {name}", f"deepspeed {name}"
        if z in results and d in results:
            for row in rows:
                if row["mode"] == z:
                    med = statistics.median
                    row["time_vs_deepspeed"] = round(med(times[z]) / med(times[d]), 3)
                    row["cpu_vs_deepspeed"] = round(med(cpu_times[z]) / med(cpu_times[d]), 3)
                    row["peak_vs_deepspeed"] = round(results[z]["peak_bytes"] / results[d]["peak_bytes"], 3)
    for row in rows:
        print(row)
    notes = [f"GPT {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, seq {args.seq}, batch "
             f"{args.batch}, fp32, 1 process, 1 torch thread, one checkpoint per block",
             "step_s: median forward+backward wall time; step_cpu_s: its CPU time (one thread, so the compute "
             "itself, much less disturbed by other jobs than wall time); peak: bytes allocated above the start "
             "during one forward+backward (torch profiler memory events on CPU); saved: bytes autograd saved for the "
             "backward "
             "(blind to the selective cache and to tensors DeepSpeed keeps outside save_for_backward)",
             "the machine was shared with other jobs while this ran: times are noisy; modes were interleaved "
             f"over {args.rounds} rounds",
             "on a CPU-only machine cpu-offload cannot lower memory (activations already live in host memory); "
             "its rows measure the overhead of the offload machinery"]
    if skipped:
        notes.append(skipped)
    if not args.no_write:
        paths = write_results("activation_bench", rows, params=vars(args), notes=notes, command=command_line())
        print("results:", *paths)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
