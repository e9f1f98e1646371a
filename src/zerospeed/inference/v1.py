"""``zerospeed.init_inference(model, config=None, **kwargs)``: DeepSpeed's v1 inference entry point.

Config keys (``zerospeed.config.inference.InferenceConfig``): ``dtype``, ``tensor_parallel.tp_size``
(``mp_size``), ``injection_policy``, ``replace_with_kernel_inject``, ``checkpoint``,
``max_out_tokens``, ``keep_module_on_host``, ``return_tuple``, ``quant`` (or ``dtype=int8``: the Linear
layers' weights int8/int4, optionally int8 activations; :mod:`zerospeed.compression.inference`).

Two paths, as in DeepSpeed:

* ``replace_with_kernel_inject=False``: the HF model itself runs. It is cast to ``dtype``, loaded
  from ``checkpoint`` if given, and with ``tp_size > 1`` split over the ranks by AutoTP
  (:func:`zerospeed.module_inject.tp_model_init`, ``injection_policy`` naming the row-parallel
  layers). ``engine(...)`` is its forward; ``engine.module.generate`` is HF's.
* ``replace_with_kernel_inject=True`` (a supported family: Llama/Mistral/Qwen2, GPT-2, GPT-NeoX):
  the model is replaced by zerospeed's own implementation — fused QKV and gate/up projections,
  paged KV cache, ragged batches — with the HF weights copied in (and split over the ranks with
  ``tp_size > 1``). ``engine.module`` is then an :class:`InjectedCausalLM`: ``forward(input_ids,
  attention_mask)`` gives HF-shaped logits, ``generate(input_ids, attention_mask, max_new_tokens=,
  do_sample=, ...)`` runs the continuous-batching engine and returns HF-shaped ids (prompt as
  given, then the new tokens, ``pad_token_id`` after a row finished). ``max_out_tokens`` bounds
  prompt + new tokens (the KV cache holds ``max_out_tokens`` tokens per row of the largest batch
  seen, 8 rows by default). Every rank runs the same steps (SPMD), so all ranks return the
  same ids.

``keep_module_on_host``: on a GPU machine the module moves to the GPU unless this is set; on CPU
it changes nothing. ``return_tuple``: forward returns a tuple instead of an HF ModelOutput.

``greedy_head`` / ``cpu_kernels`` (zerospeed keys): the injected engine's fast-path switches
(:mod:`zerospeed.inference.fast_path_choice`). With ``tp_size > 1`` every rank samples (SPMD), so the
ranks must make the same choice, and timings differ per rank: there ``auto`` is not measured but
resolved to the rank-independent ``float32`` head and ``on`` for the kernels (``off`` where they do
not build); a forced value is used as given.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn

from zerospeed.config.inference import InferenceConfig, load_inference_config
from zerospeed.inference.api import SamplingParams

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _load_checkpoint(model: nn.Module, checkpoint: Any) -> None:
    """Load an HF folder / safetensors file(s) / DeepSpeed checkpoint-json into the HF model, strictly."""
    from safetensors.torch import load_file

    files: list[str] = []
    if isinstance(checkpoint, str) and checkpoint.endswith(".json") and os.path.isfile(checkpoint):
        import json

        with open(checkpoint) as f:
            spec = json.load(f)
        base = spec.get("base_dir", "")
        files = [os.path.join(base, c) for c in spec.get("checkpoints", [])]
    elif isinstance(checkpoint, str) and os.path.isdir(checkpoint):
        from zerospeed.inference.models.loader import _files

        files = _files(checkpoint)
    elif isinstance(checkpoint, str):
        files = [checkpoint]
    else:
        files = [os.path.join(checkpoint.base_dir, c) for c in checkpoint.checkpoints]
    if not files:
        raise ValueError(f"checkpoint: {checkpoint!r} names no weight files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if not os.path.isfile(f):
            raise ValueError(f"checkpoint: file {f!r} not found")
        state.update(load_file(f) if f.endswith(".safetensors") else torch.load(f, map_location="cpu",
                                                                                weights_only=True))
    result = model.load_state_dict(state, strict=False)
    tied = {k for k in result.missing_keys if k.endswith("lm_head.weight")}
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint: missing tensors {missing[:10]}, unexpected tensors {result.unexpected_keys[:10]}")


class InjectedCausalLM(nn.Module):
    """zerospeed's own model standing in for an HF causal LM (see the module docstring)."""

    def __init__(self, engine: Any, hf_config: Any, generation_config: Any, max_out_tokens: int,
                 return_tuple: bool) -> None:
        super().__init__()
        self.engine = engine
        self.model = engine.model
        self.config = hf_config
        self.generation_config = generation_config
        self.max_out_tokens = max_out_tokens
        self.return_tuple = return_tuple

    @staticmethod
    def _rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[tuple[int, list[int]]]:
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        rows = []
        for r in range(input_ids.shape[0]):
            if attention_mask is None:
                rows.append((0, input_ids[r].tolist()))
                continue
            keep = attention_mask[r].nonzero().flatten()
            if keep.numel() == 0:
                raise ValueError(f"attention_mask: row {r} masks every token")
            lo, hi = int(keep[0]), int(keep[-1]) + 1
            if hi - lo != keep.numel():
                raise ValueError(f"attention_mask: row {r} has holes; only left or right padding is supported")
            rows.append((lo, input_ids[r, lo:hi].tolist()))
        return rows

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """Logits ``[B, S, vocab]`` (zeros at padded positions), one ragged prefill per call."""
        squeeze = input_ids.dim() == 1
        ids2 = input_ids.unsqueeze(0) if squeeze else input_ids
        rows = self._rows(ids2, attention_mask)
        B, S = ids2.shape
        if S > self.max_out_tokens:
            raise ValueError(f"input_ids: {S} tokens exceed max_out_tokens ({self.max_out_tokens})")
        eng = self.engine
        logits = torch.zeros(B, S, self.engine.spec.vocab_size, dtype=torch.float32, device=eng.device)
        bs = eng.block_size
        for r, (lo, toks) in enumerate(rows):  # one row at a time: bounded cache use
            blocks = [eng.allocator.allocate() for _ in range(-(-len(toks) // bs))]
            try:
                out = eng.run_forward(toks, [(0, len(toks), blocks)], 0, [], list(range(len(toks))), all_ranks=True)
            finally:
                for b in blocks:
                    eng.allocator.free(b)
            logits[r, lo:lo + len(toks)] = out
        logits = logits[0] if squeeze else logits
        if self.return_tuple:
            return (logits,)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(logits=logits)

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        gc = self.generation_config
        max_new = kwargs.pop("max_new_tokens", None)
        max_length = kwargs.pop("max_length", None)
        squeeze = input_ids.dim() == 1
        ids2 = input_ids.unsqueeze(0) if squeeze else input_ids
        S = ids2.shape[1]
        if max_new is None:
            max_new = (max_length - S) if max_length else (getattr(gc, "max_new_tokens", None)
                                                           or max((getattr(gc, "max_length", 20) or 20) - S, 1))
        if S + max_new > self.max_out_tokens:
            raise ValueError(f"max_out_tokens: {S} prompt + {max_new} new tokens exceed max_out_tokens "
                             f"({self.max_out_tokens})")
        eos = kwargs.pop("eos_token_id", getattr(gc, "eos_token_id", None))
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        pad = kwargs.pop("pad_token_id", None)
        pad = pad if pad is not None else (getattr(gc, "pad_token_id", None) or (eos[0] if eos else 0))
        do_sample = kwargs.pop("do_sample", getattr(gc, "do_sample", False))
        params = SamplingParams(
            max_new_tokens=max_new, min_new_tokens=kwargs.pop("min_new_tokens", 0) or 0, do_sample=bool(do_sample),
            temperature=float(kwargs.pop("temperature", 1.0) or 0.0), top_k=int(kwargs.pop("top_k", 0) or 0),
            top_p=float(kwargs.pop("top_p", 1.0) or 1.0), stop_token_ids=tuple(eos), ignore_eos=True,
            seed=kwargs.pop("seed", None))
        for k in ("use_cache", "return_dict_in_generate", "output_scores", "streamer", "synced_gpus"):
            kwargs.pop(k, None)
        if kwargs:
            raise TypeError(f"generate: unsupported argument(s) {sorted(kwargs)} for the injected model")
        rows = self._rows(ids2, attention_mask)
        outs = self.engine.generate([toks for _, toks in rows], params)
        width = max(len(o) for o in outs)
        result = torch.full((ids2.shape[0], S + width), int(pad), dtype=ids2.dtype, device=ids2.device)
        result[:, :S] = ids2
        for r, o in enumerate(outs):
            result[r, S:S + len(o)] = torch.tensor(o, dtype=ids2.dtype)
        return result[0] if squeeze else result


class InferenceEngine(nn.Module):
    """What ``init_inference`` returns: ``engine(...)`` is the module's forward; ``engine.module``
    the (possibly split or injected) module."""

    def __init__(self, module: nn.Module, config: InferenceConfig) -> None:
        super().__init__()
        self.module = module
        self._config = config

    @property
    def config(self) -> InferenceConfig:
        return self._config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            out = self.module(*args, **kwargs)
        if self._config.return_tuple and hasattr(out, "to_tuple") and not isinstance(self.module, InjectedCausalLM):
            return out.to_tuple()
        return out

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.generate(*args, **kwargs)


def init_inference(model: nn.Module, config: Any = None, **kwargs: Any) -> InferenceEngine:
    if not isinstance(model, nn.Module):
        raise TypeError(f"init_inference: model must be a torch.nn.Module, got {type(model).__name__}")
    cfg = load_inference_config(config, **kwargs)
    dtype = _DTYPES[cfg.dtype]
    tp_size = cfg.tensor_parallel.tp_size if cfg.tensor_parallel.enabled else 1
    if cfg.checkpoint is not None:
        _load_checkpoint(model, cfg.checkpoint)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
        if torch.cuda.is_available() and not cfg.keep_module_on_host else torch.device("cpu")
    model.eval()
    if not cfg.replace_with_kernel_inject:
        model.to(dtype)
        if cfg.quant is not None and cfg.quant.enabled and tp_size > 1:
            raise ValueError("quant: int8 inference with tensor_parallel.tp_size > 1 needs replace_with_kernel_inject"
                             "=True (AutoTP's split layers are not quantized)")
        if cfg.quant is not None:
            from zerospeed.compression.inference import quantize_for_inference

            quantize_for_inference(model, cfg.quant)
        if tp_size > 1:
            from zerospeed.module_inject import tp_model_init

            model = tp_model_init(model, tp_size, dtype, injection_policy=cfg.injection_policy)
        return InferenceEngine(model.to(device), cfg)
    return InferenceEngine(_inject(model, cfg, dtype, device, tp_size), cfg)


def _inject(model: nn.Module, cfg: InferenceConfig, dtype: torch.dtype, device: torch.device,
            tp_size: int) -> InjectedCausalLM:
    from zerospeed.inference.engine import InferenceEngine as Ragged
    from zerospeed.inference.models import RowLinear, TPInfo, model_from_hf

    if not hasattr(model, "config"):
        raise ValueError("replace_with_kernel_inject: the model has no HF config; only HF causal LMs of a "
                         "supported family can be injected")
    tp = TPInfo()
    if tp_size > 1:
        from zerospeed.inference.tp_runtime import tp_info

        tp = tp_info(tp_size, cfg.tensor_parallel.tp_group)
    ours, spec = model_from_hf(model, dtype, device, cfg.max_out_tokens, tp)
    if cfg.quant is not None:
        from zerospeed.compression.inference import quantize_for_inference

        quantize_for_inference(ours, cfg.quant, row_parallel=(RowLinear,))
    block_size = 16
    num_blocks = 8 * -(-cfg.max_out_tokens // block_size)
    greedy, kernels = cfg.greedy_head, cfg.cpu_kernels
    if tp_size > 1:  # SPMD: every rank samples, so every rank must choose alike: nothing measured
        from zerospeed.inference import cpu_kernel
        from zerospeed.ops.fast_paths import resolve_setting

        if resolve_setting("greedy_head", greedy, "greedy_head") == "auto":
            greedy = "float32"
        if resolve_setting("cpu_kernels", kernels, "cpu_kernels") == "auto":
            kernels = "on" if cpu_kernel.available()[0] and dtype == torch.float32 and device.type == "cpu" else "off"
    engine = Ragged(ours, spec, None, dtype=dtype, device=device, block_size=block_size, num_blocks=num_blocks,
                    max_num_seqs=64, max_model_len=cfg.max_out_tokens, max_num_batched_tokens=512,
                    enable_prefix_caching=False, tp=tp, greedy_head=greedy, cpu_kernels=kernels)
    engine.spmd = True
    return InjectedCausalLM(engine, model.config, getattr(model, "generation_config", None), cfg.max_out_tokens,
                            cfg.return_tuple)
