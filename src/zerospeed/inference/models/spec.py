"""One normalised description of a decoder-only model, read from an HF ``config.json``.

Every family we implement (Llama / Mistral / Qwen2, GPT-2, GPT-NeoX) is described by the same
:class:`ModelSpec`, so the engine, the KV cache and tensor-parallel splitting never read raw HF
config dicts. Both the transformers-4 layout (``rope_theta`` / ``rope_scaling`` at the top level)
and the transformers-5 layout (``rope_parameters``) are accepted.

Decisions:
* an architecture we do not implement is an error listing the supported ones (no silent fallback
  to HF modules: the engine's modules are our own);
* rope types implemented: ``default``, ``linear``, ``llama3``; others (``dynamic``, ``yarn``...) are a
  clear error rather than silently wrong positions;
* a sliding window narrower than the context is applied in the attention mask (Mistral, Qwen2 with
  ``use_sliding_window``); Qwen2's per-layer window (``max_window_layers``) is honoured.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

# model_type -> family implemented in zerospeed.inference.models.<family>
FAMILIES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "gpt2": "gpt2",
    "gpt_neox": "gpt_neox",
    "mixtral": "mixtral",
}
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "GPT2LMHeadModel": "gpt2",
    "GPTNeoXForCausalLM": "gpt_neox",
    "MixtralForCausalLM": "mixtral",
}
SUPPORTED_ROPE = ("default", "linear", "llama3")


class ModelLoadError(ValueError):
    """A model folder we cannot load; the message names the file, key or tensor."""


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    activation: str
    tie_word_embeddings: bool
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_params: dict[str, Any] = field(default_factory=dict)
    rotary_dim: int = 0  # 0 when positions are learned embeddings (GPT-2)
    parallel_residual: bool = False
    attn_scale: float | None = None
    scale_by_inverse_layer_idx: bool = False
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    num_experts: int = 0  # mixture-of-experts FFN (Mixtral): experts per layer, and experts per token
    experts_per_token: int = 0

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token in every layer: 2 * layers * kv_heads * head_dim * element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()

    def inv_freq(self) -> torch.Tensor:
        """Rotary inverse frequencies (float64 then float32, as HF computes them in float)."""
        dim = self.rotary_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        p = self.rope_params
        if self.rope_type == "linear":
            inv = inv / float(p["factor"])
        elif self.rope_type == "llama3":
            factor = float(p["factor"])
            low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
            old_ctx = float(p.get("original_max_position_embeddings", self.max_position_embeddings))
            low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_ctx / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            inv = torch.where(medium, smoothed, scaled)
        return inv


def _need(cfg: dict, key: str, where: str) -> Any:
    if key not in cfg:
        raise ModelLoadError(f"{where}: missing key {key!r}")
    return cfg[key]


def _eos(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(cfg: dict, where: str) -> tuple[float, str, dict, float]:
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE:
        raise ModelLoadError(f"{where}: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE)}")
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", cfg.get("rotary_pct", 1.0))))
    return theta, rope_type, params, partial


def spec_from_config(cfg: dict, where: str = "config.json") -> ModelSpec:
    """Normalise an HF config dict into a :class:`ModelSpec` (errors name the key)."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        archs = cfg.get("architectures") or []
        supported = ", ".join(f"{a} ({t})" for a, t in ARCHITECTURES.items())
        raise ModelLoadError(f"{where}: architecture {archs or model_type!r} (model_type {model_type!r}) is not "
                             f"supported by zerospeed inference; supported: {supported}")
    family = FAMILIES[model_type]
    if family == "mixtral":  # Mistral's attention and norms, a sparse mixture-of-experts FFN
        import dataclasses

        base = spec_from_config({**cfg, "model_type": "mistral"}, where)
        return dataclasses.replace(base, model_type=model_type, family=family,
                                   num_experts=int(_need(cfg, "num_local_experts", where)),
                                   experts_per_token=int(_need(cfg, "num_experts_per_tok", where)))
    eos = _eos(cfg.get("eos_token_id"))
    bos = cfg.get("bos_token_id")
    dtype = cfg.get("torch_dtype", cfg.get("dtype"))
    if family == "llama":
        hidden = int(_need(cfg, "hidden_size", where))
        heads = int(_need(cfg, "num_attention_heads", where))
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        theta, rope_type, params, partial = _rope(cfg, where)
        layers = int(_need(cfg, "num_hidden_layers", where))
        window = cfg.get("sliding_window")
        if model_type == "qwen2":
            if not cfg.get("use_sliding_window", False):
                window = None
            first = int(cfg.get("max_window_layers", layers))
            windows = tuple(window if (window and i >= first) else None for i in range(layers))
        else:
            windows = tuple(window for _ in range(layers))
        return ModelSpec(
            model_type=model_type, family=family, vocab_size=int(_need(cfg, "vocab_size", where)),
            hidden_size=hidden, num_layers=layers, num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
            intermediate_size=int(_need(cfg, "intermediate_size", where)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), activation=cfg.get("hidden_act", "silu"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)) or model_type == "qwen2",
            out_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope_theta=theta, rope_type=rope_type, rope_params=params, rotary_dim=int(head_dim * partial),
            sliding_windows=windows, bos_token_id=bos, eos_token_ids=eos, torch_dtype=dtype)
    if family == "gpt2":
        hidden = int(_need(cfg, "n_embd", where))
        heads = int(_need(cfg, "n_head", where))
        if cfg.get("reorder_and_upcast_attn"):
            raise ModelLoadError(f"{where}: reorder_and_upcast_attn=true is not supported")
        layers = int(_need(cfg, "n_layer", where))
        return ModelSpec(
            model_type=model_type, family=family, vocab_size=int(_need(cfg, "vocab_size", where)),
            hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=heads,
            head_dim=hidden // heads, intermediate_size=int(cfg.get("n_inner") or 4 * hidden),
            max_position_embeddings=int(cfg.get("n_positions", 1024)),
            norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
            activation=cfg.get("activation_function", "gelu_new"), tie_word_embeddings=True,
            qkv_bias=True, out_bias=True, mlp_bias=True,
            attn_scale=None if cfg.get("scale_attn_weights", True) else 1.0,
            scale_by_inverse_layer_idx=bool(cfg.get("scale_attn_by_inverse_layer_idx", False)),
            sliding_windows=(None,) * layers, bos_token_id=bos, eos_token_ids=eos, torch_dtype=dtype)
    # gpt_neox
    hidden = int(_need(cfg, "hidden_size", where))
    heads = int(_need(cfg, "num_attention_heads", where))
    head_dim = hidden // heads
    theta, rope_type, params, partial = _rope(cfg, where)
    layers = int(_need(cfg, "num_hidden_layers", where))
    bias = bool(cfg.get("attention_bias", True))
    return ModelSpec(
        model_type=model_type, family=family, vocab_size=int(_need(cfg, "vocab_size", where)),
        hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
        intermediate_size=int(_need(cfg, "intermediate_size", where)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        norm_eps=float(cfg.get("layer_norm_eps", 1e-5)), activation=cfg.get("hidden_act", "gelu"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=bias, out_bias=bias,
        mlp_bias=True, rope_theta=theta, rope_type=rope_type, rope_params=params,
        rotary_dim=int(head_dim * partial), parallel_residual=bool(cfg.get("use_parallel_residual", True)),
        sliding_windows=(None,) * layers, bos_token_id=bos, eos_token_ids=eos, torch_dtype=dtype)


def read_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isdir(model_dir):
        raise ModelLoadError(f"model path {model_dir!r} is not a directory")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: not found (an HF model folder needs config.json)")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: invalid JSON ({exc})") from None


def load_spec(model_dir: str) -> ModelSpec:
    cfg = read_config(model_dir)
    spec = spec_from_config(cfg, os.path.join(model_dir, "config.json"))
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            gen = json.load(f)
        if gen.get("eos_token_id") is not None:
            import dataclasses
            spec = dataclasses.replace(spec, eos_token_ids=_eos(gen["eos_token_id"]))
    return spec
