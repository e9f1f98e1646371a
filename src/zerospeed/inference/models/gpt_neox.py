"""GPT-NeoX (Pythia): LayerNorm, partial rotary embeddings (``rotary_pct``), parallel residual
(``h + attn(ln1(h)) + mlp(ln2(h))``) unless ``use_parallel_residual`` is false, exact GELU.

HF stores the fused QKV per head (``[heads, 3, head_dim]`` rows); we reorder it at load into
``[3, heads, head_dim]`` so Q, K and V are contiguous slices, as in our other families."""

from __future__ import annotations

import torch
import torch.nn as nn

from zerospeed.inference.models.layers import RotaryDecoderLM, RowLinear, TPInfo, activation, apply_rotary
from zerospeed.inference.models.spec import ModelSpec


class GPTNeoXBlock(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, tp: TPInfo) -> None:
        super().__init__()
        H = spec.hidden_size
        self.h = tp.split(spec.num_heads, "num_attention_heads")
        self.d = spec.head_dim
        self.inter = tp.split(spec.intermediate_size, "intermediate_size")
        self.ln_1 = nn.LayerNorm(H, eps=spec.norm_eps)
        self.ln_2 = nn.LayerNorm(H, eps=spec.norm_eps)
        self.qkv = nn.Linear(H, 3 * self.h * self.d, bias=spec.qkv_bias)
        self.o = RowLinear(self.h * self.d, H, spec.out_bias, tp)
        self.fc = nn.Linear(H, self.inter)
        self.proj = RowLinear(self.inter, H, True, tp)
        self.act = activation(spec.activation)
        self.rotary_dim = spec.rotary_dim
        self.parallel = spec.parallel_residual

    def _attn(self, x, meta, cos, sin, k_cache, v_cache):
        T = x.shape[0]
        q, k, v = self.qkv(x).view(T, 3, self.h, self.d).unbind(1)
        q = apply_rotary(q, cos, sin, self.rotary_dim)
        k = apply_rotary(k, cos, sin, self.rotary_dim)
        return self.o(meta.attend(q, k, v, k_cache, v_cache))

    def _mlp(self, x):
        return self.proj(self.act(self.fc(x)))

    def forward(self, h, meta, cos, sin, k_cache, v_cache):
        a = self._attn(self.ln_1(h), meta, cos, sin, k_cache, v_cache)
        if self.parallel:
            return self._mlp(self.ln_2(h)) + a + h
        h = a + h
        return self._mlp(self.ln_2(h)) + h


class GPTNeoXForCausalLM(RotaryDecoderLM):
    block_cls = GPTNeoXBlock

    def final_norm(self, spec: ModelSpec) -> nn.Module:
        return nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)


def _qkv(t: torch.Tensor, spec: ModelSpec, tp: TPInfo) -> torch.Tensor:
    """HF ``[heads*3*d, ...]`` (per head: q, k, v) -> ours ``[3*heads_local*d, ...]``."""
    rest = t.shape[1:]
    t = t.view(spec.num_heads, 3, spec.head_dim, *rest).transpose(0, 1)  # [3, heads, d, ...]
    t = tp.shard(t, 1)
    return t.reshape(-1, *rest).contiguous()


def load_weights(model: GPTNeoXForCausalLM, reader) -> None:
    spec, tp = model.spec, model.tp
    H, I = spec.hidden_size, spec.intermediate_size
    reader.put(model.embed.weight, "gpt_neox.embed_in.weight", (spec.vocab_size, H))
    reader.put(model.norm.weight, "gpt_neox.final_layer_norm.weight", (H,))
    reader.put(model.norm.bias, "gpt_neox.final_layer_norm.bias", (H,))
    if spec.tie_word_embeddings:
        reader.ignore("embed_out.weight")
    else:
        reader.put(model.lm_head.weight, "embed_out.weight", (spec.vocab_size, H))
    for i, b in enumerate(model.layers):
        p = f"gpt_neox.layers.{i}."
        for ln, name in ((b.ln_1, "input_layernorm"), (b.ln_2, "post_attention_layernorm")):
            reader.put(ln.weight, p + name + ".weight", (H,))
            reader.put(ln.bias, p + name + ".bias", (H,))
        w = reader.get(p + "attention.query_key_value.weight", (3 * H, H))
        reader.assign(b.qkv.weight, lambda w=w: _qkv(w(), spec, tp))
        if spec.qkv_bias:
            bb = reader.get(p + "attention.query_key_value.bias", (3 * H,))
            reader.assign(b.qkv.bias, lambda bb=bb: _qkv(bb(), spec, tp))
        w = reader.get(p + "attention.dense.weight", (H, H))
        reader.assign(b.o.weight, lambda w=w: tp.shard(w(), 1).contiguous())
        if spec.out_bias:
            reader.put(b.o.bias, p + "attention.dense.bias", (H,))
        w = reader.get(p + "mlp.dense_h_to_4h.weight", (I, H))
        reader.assign(b.fc.weight, lambda w=w: tp.shard(w(), 0).contiguous())
        bb = reader.get(p + "mlp.dense_h_to_4h.bias", (I,))
        reader.assign(b.fc.bias, lambda bb=bb: tp.shard(bb(), 0))
        w = reader.get(p + "mlp.dense_4h_to_h.weight", (H, I))
        reader.assign(b.proj.weight, lambda w=w: tp.shard(w(), 1).contiguous())
        reader.put(b.proj.bias, p + "mlp.dense_4h_to_h.bias", (H,))
