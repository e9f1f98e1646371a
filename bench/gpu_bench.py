"""The short GPU benchmark of ``make gpu-check`` (``bench/gpu_check.py`` runs each part as its own process).

Each part writes one JSON object to ``--out`` (and prints it), so a crash of one system never loses
another's figures, and each system's peak memory is its own:

* ``offload --system zerospeed|deepspeed --size S``: ZeRO-Offload training (ZeRO stage 2, bf16,
  ``offload_optimizer: cpu`` with pinned memory, AdamW, clipping 1.0) of the GPT in examples/gpt_model.py
  at size ``S`` (see ``SIZES``; ``auto`` = :func:`choose_offload_size`), on one GPU, world size 1. The
  same seed, model, config and token batches for both systems; DeepSpeed then runs its own
  DeepSpeedCPUAdam (built on first use). Reports median step seconds after warm-up, tokens/s, model
  TFLOP/s (6 x params x tokens, attention not counted), peak GPU memory, peak host RSS, the losses.
* ``make-llama --out DIR``: a random-weight Llama (~1.1B parameters, TinyLlama's shape, bf16) built from
  a config and saved as an HF folder (no download; no tokenizer, prompts are token ids).
* ``inference --system zerospeed|hf|vllm --model-dir DIR``: greedy decoding of ``--num-prompts`` random
  prompts of ``--prompt-len`` tokens, ``--new-tokens`` each (no early stop), bf16, after a short warm-up:
  generated tokens/s over the whole batch (zerospeed's engine with continuous batching; HF ``generate``
  on the whole batch at once, static batching; vLLM's offline ``LLM.generate``). The first prompts'
  tokens are kept so the driver can report how often the systems agree (bf16: near-ties may differ).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for extra in (REPO / "bench", REPO / "examples"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))
if importlib.util.find_spec("zerospeed") is None:  # not installed (the GPU image): the working tree's
    sys.path.append(str(REPO / "src"))

#: GPT sizes (n_layer, d_model, n_head) at vocabulary 50304, sequence 1024, tied embeddings (GPT-2/3 shapes);
#: ``tiny`` is for the CPU test of this script, never chosen by ``auto``
SIZES = {
    "tiny": (2, 64, 4),
    "125m": (12, 768, 12),
    "350m": (24, 1024, 16),
    "760m": (24, 1536, 16),
    "1.3b": (24, 2048, 16),
    "2.7b": (32, 2560, 32),
    "6.7b": (32, 4096, 32),
    "13b": (40, 5120, 40),
}
VOCAB, SEQ = 50304, 1024
#: ZeRO-Offload, bf16, stage 2, one GPU: bytes per parameter in host memory (fp32 master, Adam m and v, the
#: fp32 gradient partition) and on the GPU (bf16 parameters and gradients), as both systems lay them out
HOST_BYTES_PER_PARAM, GPU_BYTES_PER_PARAM = 16, 4
HOST_FRACTION, GPU_FRACTION = 0.55, 0.6  # the rest: pinned staging buffers, activations, the CUDA context


def num_params(size: str, seq: int = SEQ) -> int:
    """Distinct parameters of the GPT at ``size`` (tied embedding counted once)."""
    n_layer, d, _ = SIZES[size]
    per_layer = 12 * d * d + 13 * d  # qkv, proj, fc, proj with biases, two LayerNorms
    return n_layer * per_layer + VOCAB * d + seq * d + 2 * d


def activation_bytes(size: str, micro_batch: int, seq: int = SEQ) -> int:
    """Saved activations of one micro-batch in bf16 without checkpointing (~34 x tokens x d per layer,
    flash attention keeps no T x T matrix), plus the fp32 logits and their gradient."""
    n_layer, d, _ = SIZES[size]
    tokens = micro_batch * seq
    return n_layer * 34 * tokens * d + 3 * 4 * tokens * VOCAB


def choose_offload_size(host_bytes: int, gpu_bytes: int, micro_batch: int = 4) -> str | None:
    """The largest of ``SIZES`` whose optimizer state fits ``HOST_FRACTION`` of host memory and whose
    parameters, gradients and activations fit ``GPU_FRACTION`` of the GPU; None if even the smallest does not."""
    best = None
    for size in SIZES:
        if size == "tiny":
            continue
        n = num_params(size)
        if (n * HOST_BYTES_PER_PARAM <= HOST_FRACTION * host_bytes
                and n * GPU_BYTES_PER_PARAM + activation_bytes(size, micro_batch) <= GPU_FRACTION * gpu_bytes):
            best = size
    return best


def host_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


# --------------------------------------------------------------------------- ZeRO-Offload training


def offload_config(micro_batch: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0, "steps_per_print": 100000, "wall_clock_breakdown": False,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "contiguous_gradients": True, "overlap_comm": True,
                              "reduce_bucket_size": 200_000_000, "allgather_bucket_size": 200_000_000},
    }


def _world_of_one_env() -> None:
    """torchrun's variables for one process, so both systems initialise the same way (env://)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        os.environ.setdefault(key, value)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _peak_device_bytes(device: str) -> int | None:
    import torch

    return torch.cuda.max_memory_allocated() if device == "cuda" else None


def run_offload(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from common import peak_rss_bytes, time_steps
    from gpt_model import GPT, GPTConfig

    _world_of_one_env()
    size, device = args.size, args.device
    if size == "auto":
        size = choose_offload_size(host_memory_bytes(), torch.cuda.get_device_properties(0).total_memory,
                                   args.micro_batch)
        if size is None:
            raise RuntimeError("no GPT size fits this machine's host and GPU memory")
    n_layer, d_model, n_head = SIZES[size]
    cfg = GPTConfig(vocab_size=VOCAB, n_layer=n_layer, n_head=n_head, d_model=d_model, seq_len=args.seq)
    if args.system == "deepspeed":
        import deepspeed as system
    else:
        import zerospeed as system
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):  # initialised where it trains: no host copy of a multi-GB model
        model = GPT(cfg)
    params = model.num_parameters()
    engine, _, _, _ = system.initialize(model=model, model_parameters=model.parameters(),
                                        config=offload_config(args.micro_batch))
    _sync(device)
    init_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1)
    total = args.warmup + args.steps
    data = torch.randint(0, VOCAB, (total, args.micro_batch, args.seq + 1), generator=g).to(device)
    losses: list[float] = []

    def step(i: int) -> None:
        x, y = data[i, :, :-1], data[i, :, 1:]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        _sync(device)

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timing = time_steps(step, args.steps, args.warmup)
    tokens = args.micro_batch * args.seq
    return {
        "bench": "offload", "system": args.system, "device": device, "size": size, "params": params,
        "micro_batch": args.micro_batch, "seq_len": args.seq, "init_s": init_s, "step_s": timing.median_s,
        "steps_s": list(timing.steps_s), "tokens_per_s": tokens / timing.median_s,
        "model_tflops": 6 * params * tokens / timing.median_s / 1e12,
        "peak_gpu_bytes": _peak_device_bytes(device), "peak_host_rss_bytes": peak_rss_bytes(), "losses": losses,
    }


# --------------------------------------------------------------------------- inference

#: (hidden, intermediate, layers, heads, kv heads, vocabulary): TinyLlama-1.1B's shape; ``tiny`` for tests
LLAMA_SHAPES = {"1.1b": (2048, 5632, 22, 32, 4, 32000), "tiny": (64, 128, 2, 4, 2, 320)}


def make_llama(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers as tf

    hidden, inter, layers, heads, kv_heads, vocab = LLAMA_SHAPES[args.shape]
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(args.device):
        model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(args.out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    return {"bench": "make-llama", "shape": args.shape, "params": params, "dir": args.out,
            "seconds": time.perf_counter() - t0}


def _prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(7)
    return torch.randint(3, vocab, (args.num_prompts, args.prompt_len), generator=g).tolist()


def run_inference(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    with open(os.path.join(args.model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts, new, device = _prompts(args, vocab), args.new_tokens, args.device
    t0 = time.perf_counter()
    if args.system == "zerospeed":
        from zerospeed.inference import SamplingParams, build_engine

        engine = build_engine(args.model_dir, dtype="bf16", device=device, max_num_seqs=args.num_prompts,
                              max_num_batched_tokens=args.max_batched_tokens)

        def generate(ps: list[list[int]], n: int) -> list[list[int]]:
            return engine.generate(ps, SamplingParams(max_new_tokens=n, ignore_eos=True))
    elif args.system == "hf":
        import transformers as tf

        model = tf.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16,
                                                        attn_implementation="sdpa").to(device).eval()

        def generate(ps: list[list[int]], n: int) -> list[list[int]]:
            ids = torch.tensor(ps, device=device)  # equal lengths: one batch, no padding
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
            return out[:, ids.shape[1]:].tolist()
    elif args.system == "vllm":
        from vllm import LLM, SamplingParams as VSamplingParams

        llm = LLM(model=args.model_dir, dtype="bfloat16", skip_tokenizer_init=True, gpu_memory_utilization=0.6,
                  max_num_seqs=args.num_prompts, seed=0)

        def generate(ps: list[list[int]], n: int) -> list[list[int]]:
            outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                                VSamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))
            return [list(o.outputs[0].token_ids) for o in outs]
    else:
        raise ValueError(args.system)
    load_s = time.perf_counter() - t0
    generate(prompts[:2], 4)  # warm-up: kernels, allocator, graphs
    _sync(device)
    t1 = time.perf_counter()
    tokens = generate(prompts, new)
    _sync(device)
    wall = time.perf_counter() - t1
    generated = sum(len(t) for t in tokens)
    return {"bench": "inference", "system": args.system, "device": device, "num_prompts": len(prompts),
            "prompt_len": args.prompt_len, "new_tokens": new, "load_s": load_s, "wall_s": wall,
            "generated_tokens": generated, "tokens_per_s": generated / wall,
            "peak_gpu_bytes": _peak_device_bytes(device), "first_tokens": [t[:16] for t in tokens[:8]]}


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="part", required=True)
    off = sub.add_parser("offload", help="ZeRO-Offload training step")
    off.add_argument("--system", choices=("zerospeed", "deepspeed"), required=True)
    off.add_argument("--size", choices=("auto", *SIZES), default="auto")
    off.add_argument("--micro-batch", type=int, default=4)
    off.add_argument("--steps", type=int, default=5)
    off.add_argument("--warmup", type=int, default=2)
    off.add_argument("--seq", type=int, default=SEQ)
    mk = sub.add_parser("make-llama", help="a random ~1.1B Llama saved as an HF folder")
    mk.add_argument("--out", required=True)
    mk.add_argument("--shape", choices=tuple(LLAMA_SHAPES), default="1.1b")
    inf = sub.add_parser("inference", help="greedy decoding throughput")
    inf.add_argument("--system", choices=("zerospeed", "hf", "vllm"), required=True)
    inf.add_argument("--model-dir", required=True)
    inf.add_argument("--num-prompts", type=int, default=64)
    inf.add_argument("--prompt-len", type=int, default=256)
    inf.add_argument("--new-tokens", type=int, default=128)
    inf.add_argument("--max-batched-tokens", type=int, default=2048)
    for q in (off, mk, inf):
        q.add_argument("--result", default=None, help="also write the JSON result here")
        q.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                       help="cpu: only for the CPU test of this script (bench/gpu_check.py always runs cuda)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = {"offload": run_offload, "make-llama": make_llama, "inference": run_inference}[args.part]
    result = run(args)
    text = json.dumps(result)
    if args.result:
        Path(args.result).write_text(text + "\n")
    print("RESULT " + text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
