"""Building an :class:`~zerospeed.inference.engine.InferenceEngine` from an HF folder: ``build_engine``.

Validates every argument before anything loads (each error names the argument), resolves the dtype,
picks the device, sizes the paged KV cache (``num_blocks``, else ``kv_cache_memory`` bytes, else
enough for ``max_num_seqs`` full-length sequences capped by free memory), loads zerospeed's own
implementation of the folder's model family and its tokenizer, and attaches the tensor-parallel
runtime on rank 0. The engine's behaviour is described in :mod:`zerospeed.inference.engine`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from zerospeed.inference.engine import ATTENTION_BACKENDS, InferenceEngine
from zerospeed.inference.kv_cache import kv_cache_bytes
from zerospeed.inference.models import ModelSpec, TPInfo, load_model
from zerospeed.inference.tokenizer import load_tokenizer
from zerospeed.ops.fast_paths import resolve_setting

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}


# Prompt tokens fused into a forward that also decodes (None: up to max_num_batched_tokens; see the
# scheduler). With prefill first (the scheduler's default), a burst of requests on an idle engine is
# prefilled before anything decodes, so the cap only matters for requests arriving while others
# decode. Measured with bench/inference_bench.py's online mode (Poisson arrivals at 4 req/s, one
# thread, p95 inter-token latency in CPU time, 2026-11-24 sweeps on the shared 2-core machine): a
# cap of 128 gave 16.6 ms, 64: 12.1, 32: 10.8 then (after the greedy LM head) 8.8, 16: 7.2, 8: 7.0,
# against 7.0 for HF generate at batch 1 in the same sweep, at about the same tokens per CPU-second
# (arrival-bound), while a prompt arriving mid-decode needs prompt_len / cap forwards to its first
# token (time to first token 43 ms at 32, 63 ms at 16, 155 ms at 8). Serving latency-sensitive
# traffic, lower it; for offline batch jobs, pass None.
DEFAULT_PREFILL_WITH_DECODES: int | None = 16



def resolve_dtype(dtype: Any, spec: ModelSpec | None = None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype: {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    if dtype == "auto":
        return DTYPES.get(str((spec and spec.torch_dtype) or "float32"), torch.float32)
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}, auto")
    return DTYPES[dtype]


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _default_kv_memory(device: torch.device, want: int) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return min(want, int(free * 0.9))
    try:
        import psutil

        avail = psutil.virtual_memory().available
    except Exception:  # pragma: no cover
        avail = 8 << 30
    return min(want, int(avail * 0.25))


def build_engine(model_dir: str, *, dtype: Any = "fp32", block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory: int | None = None, max_num_seqs: int = 256, max_model_len: int | None = None,
                 max_num_batched_tokens: int = 512, tensor_parallel: int = 1, device: str | torch.device | None = None,
                 enable_prefix_caching: bool = True, tp_group: Any = None,
                 max_prefill_tokens_with_decodes: int | None = DEFAULT_PREFILL_WITH_DECODES,
                 attention_backend: str = "auto", prefill_first: bool = True,
                 max_decode_kv_bytes: int | str | None = "auto", greedy_head: str = "auto",
                 cpu_kernels: str = "auto", packed_linear: str = "auto") -> InferenceEngine:
    """Load ``model_dir`` (an HF folder) into an :class:`InferenceEngine`. Errors name the argument.

    ``greedy_head`` (auto|float32|bf16|int8), ``cpu_kernels`` and ``packed_linear`` (auto|on|off): the fast-path switches
    (see the module docstring); ``auto`` measures, and ``ZEROSPEED_FAST_PATHS`` may set them per process.

    ``max_decode_kv_bytes``: admission bound on the K/V the running sequences hold at their longest
    (``prompt + max_new_tokens`` tokens each), i.e. on the K/V bytes any decode step reads: ``"auto"``
    (``DECODE_KV_RATIO`` of the weight bytes a step reads), a number of bytes, or None (only
    ``max_num_seqs`` and the cache bound the batch)."""
    from zerospeed.inference.models.spec import load_spec

    spec = load_spec(model_dir)
    torch_dtype = resolve_dtype(dtype, spec)
    for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens), ("tensor_parallel", tensor_parallel)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
    if max_prefill_tokens_with_decodes is not None and (not isinstance(max_prefill_tokens_with_decodes, int)
                                                        or max_prefill_tokens_with_decodes < 1):
        raise ValueError("max_prefill_tokens_with_decodes: must be an integer >= 1 or None, got "
                         f"{max_prefill_tokens_with_decodes!r}")
    if max_decode_kv_bytes is not None and max_decode_kv_bytes != "auto" and (
            isinstance(max_decode_kv_bytes, bool) or not isinstance(max_decode_kv_bytes, int) or max_decode_kv_bytes < 1):
        raise ValueError("max_decode_kv_bytes: must be 'auto', None or a positive integer number of bytes, got "
                         f"{max_decode_kv_bytes!r}")
    if not isinstance(prefill_first, bool):
        raise ValueError(f"prefill_first: must be True or False, got {prefill_first!r}")
    resolve_setting("greedy_head", greedy_head, "greedy_head")  # bad values fail before the model loads
    resolve_setting("cpu_kernels", cpu_kernels, "cpu_kernels")
    resolve_setting("packed_linear", packed_linear, "packed_linear")
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: {attention_backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if num_blocks is not None and (not isinstance(num_blocks, int) or num_blocks < 1):
        raise ValueError(f"num_blocks: must be an integer >= 1, got {num_blocks!r}")
    if kv_cache_memory is not None and (not isinstance(kv_cache_memory, (int, float)) or kv_cache_memory <= 0):
        raise ValueError(f"kv_cache_memory: must be a positive number of bytes, got {kv_cache_memory!r}")
    model_len = max_model_len or spec.max_position_embeddings
    if not isinstance(model_len, int) or model_len < 2:
        raise ValueError(f"max_model_len: must be an integer >= 2, got {max_model_len!r}")
    if spec.rotary_dim == 0 and model_len > spec.max_position_embeddings:
        raise ValueError(f"max_model_len: {model_len} exceeds the model's {spec.max_position_embeddings} "
                         "learned positions")
    tp = TPInfo()
    if tensor_parallel > 1:
        from zerospeed.inference.tp_runtime import tp_info

        tp = tp_info(tensor_parallel, tp_group)
    dev = torch.device(device) if device is not None else _default_device()
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    kv_heads = spec.num_kv_heads // tp.size if spec.num_kv_heads % tp.size == 0 else spec.num_kv_heads
    block_bytes = kv_cache_bytes(spec.num_layers, 1, block_size, kv_heads, spec.head_dim, torch_dtype)
    if num_blocks is None:
        memory = int(kv_cache_memory) if kv_cache_memory is not None else \
            _default_kv_memory(dev, max_num_seqs * model_len * block_bytes // block_size)
        num_blocks = memory // block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory: {memory} bytes hold no block of {block_bytes} bytes")
    model, spec = load_model(model_dir, torch_dtype, dev, model_len, tp)
    tokenizer = load_tokenizer(model_dir)
    name = os.path.basename(os.path.normpath(model_dir))
    engine = InferenceEngine(model, spec, tokenizer, dtype=torch_dtype, device=dev, block_size=block_size,
                             num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_model_len=model_len,
                             max_num_batched_tokens=max_num_batched_tokens, model_name=name,
                             enable_prefix_caching=enable_prefix_caching, tp=tp,
                             kv_cache_memory=None if kv_cache_memory is None else int(kv_cache_memory),
                             max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes,
                             attention_backend=attention_backend, prefill_first=prefill_first,
                             max_decode_kv_bytes=max_decode_kv_bytes, greedy_head=greedy_head,
                             cpu_kernels=cpu_kernels, packed_linear=packed_linear)
    if tp.size > 1 and tp.rank == 0:
        from zerospeed.inference.tp_runtime import attach_rank0

        attach_rank0(engine)
    return engine
