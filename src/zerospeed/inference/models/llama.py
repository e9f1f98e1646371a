"""The Llama family (Llama 2/3 with rope scaling, Mistral, Qwen2 with QKV bias), with GQA.

Our own modules, not HF's: Q, K and V are one fused matmul (``qkv``), gate and up one (``gate_up``);
each layer attends through :class:`~zerospeed.inference.attention.AttentionMetadata` into the paged
cache. Tensor parallel: heads and MLP columns are split across ranks; the output projections are
row-parallel (their bias, if any, is added once after the all-reduce).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerospeed.inference import cpu_kernel
from zerospeed.inference.models.layers import (RMSNorm, RotaryDecoderLM, RowLinear, TPInfo, activation, apply_rotary,
                                               cpu_linear)
from zerospeed.inference.models.spec import ModelSpec


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, tp: TPInfo) -> None:
        super().__init__()
        self.hq = tp.split(spec.num_heads, "num_attention_heads")
        self.hkv = tp.split(spec.num_kv_heads, "num_key_value_heads")
        self.d = spec.head_dim
        self.qkv = nn.Linear(spec.hidden_size, (self.hq + 2 * self.hkv) * self.d, bias=spec.qkv_bias)
        self.o = RowLinear(self.hq * self.d, spec.hidden_size, spec.out_bias, tp)
        self.rotary_dim = spec.rotary_dim
        self.window = spec.sliding_windows[layer_idx] if spec.sliding_windows else None

    def forward(self, x, meta, cos, sin, k_cache, v_cache):
        T = x.shape[0]
        qkv = self.qkv(x)
        if meta.cpu_fused:  # rotary, cache writes and decode attention in one C call
            return self.o(meta.attend_qkv(qkv, self.hq, self.hkv, self.d, cos, sin, k_cache, v_cache, None,
                                          self.window))
        q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q = apply_rotary(q.view(T, self.hq, self.d), cos, sin, self.rotary_dim)
        k = apply_rotary(k.view(T, self.hkv, self.d), cos, sin, self.rotary_dim)
        return self.o(meta.attend(q, k, v.view(T, self.hkv, self.d), k_cache, v_cache, None, self.window))


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPInfo) -> None:
        super().__init__()
        self.inter = tp.split(spec.intermediate_size, "intermediate_size")
        self.gate_up = nn.Linear(spec.hidden_size, 2 * self.inter, bias=spec.mlp_bias)
        self.down = RowLinear(self.inter, spec.hidden_size, spec.mlp_bias, tp)
        self.act = activation(spec.activation)

    def forward(self, x):
        gate, up = self.gate_up(x).split(self.inter, dim=-1)
        return self.down(self.act(gate) * up)


class LlamaBlock(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, tp: TPInfo) -> None:
        super().__init__()
        self.input_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.attn = LlamaAttention(spec, layer_idx, tp)
        self.post_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.mlp = LlamaMLP(spec, tp)

    def forward(self, h, meta, cos, sin, k_cache, v_cache):
        if meta.kernels.any:
            return self._forward_cpu(h, meta, cos, sin, k_cache, v_cache)
        h = h + self.attn(self.input_norm(h), meta, cos, sin, k_cache, v_cache)
        return h + self.mlp(self.post_norm(h))

    def _forward_cpu(self, h, meta, cos, sin, k_cache, v_cache):
        """The same on CPU in float32 with the C kernels the forward's plan (``meta.kernels``, chosen by
        the engine per kernel family and shape class, see fast_path_choice) puts on, in fewer ops: the
        norms and SwiGLU's gate in C, the linears through :func:`cpu_linear` (a C GEMM for few rows, each
        residual add folded into its output projection), the attention glue in one call; each family
        the plan leaves off runs its torch twin."""
        a, m, plan = self.attn, self.mlp, meta.kernels
        x = cpu_kernel.rms_norm(h, self.input_norm.weight, self.input_norm.eps) if plan.rms_norm \
            else self.input_norm(h)
        qkv = cpu_linear(x, a.qkv, plan=plan)
        if meta.cpu_fused:
            o = meta.attend_qkv(qkv, a.hq, a.hkv, a.d, cos, sin, k_cache, v_cache, None, a.window)
        else:
            T = qkv.shape[0]
            q, k, v = qkv.split([a.hq * a.d, a.hkv * a.d, a.hkv * a.d], dim=-1)
            q = apply_rotary(q.view(T, a.hq, a.d), cos, sin, a.rotary_dim)
            k = apply_rotary(k.view(T, a.hkv, a.d), cos, sin, a.rotary_dim)
            o = meta.attend(q, k, v.view(T, a.hkv, a.d), k_cache, v_cache, None, a.window)
        h = cpu_linear(o, a.o, residual=h, plan=plan)
        x = cpu_kernel.rms_norm(h, self.post_norm.weight, self.post_norm.eps) if plan.rms_norm \
            else self.post_norm(h)
        gu = cpu_linear(x, m.gate_up, plan=plan)
        if plan.silu_mul and m.act is F.silu and gu.is_contiguous():  # SwiGLU's gate, one C pass
            act = cpu_kernel.silu_mul(gu, m.inter)
        else:
            gate, up = gu.split(m.inter, dim=-1)
            act = m.act(gate) * up
        return cpu_linear(act, m.down, residual=h, plan=plan)


class LlamaForCausalLM(RotaryDecoderLM):
    #: the decoder block; a family that only swaps the FFN (Mixtral) subclasses with its own
    block_cls: type[nn.Module] = LlamaBlock

    def final_norm(self, spec: ModelSpec) -> nn.Module:
        return RMSNorm(spec.hidden_size, spec.norm_eps)


def load_weights(model: LlamaForCausalLM, reader) -> None:
    spec, tp = model.spec, model.tp
    d = spec.head_dim
    H = spec.hidden_size
    reader.put(model.embed.weight, "model.embed_tokens.weight", (spec.vocab_size, H))
    reader.put(model.norm.weight, "model.norm.weight", (H,))
    if spec.tie_word_embeddings:
        reader.ignore("lm_head.weight")  # tied: HF also uses the embedding, whatever the file holds
    else:
        reader.put(model.lm_head.weight, "lm_head.weight", (spec.vocab_size, H))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a, m = layer.attn, layer.mlp
        reader.put(layer.input_norm.weight, p + "input_layernorm.weight", (H,))
        reader.put(layer.post_norm.weight, p + "post_attention_layernorm.weight", (H,))
        q = reader.get(p + "self_attn.q_proj.weight", (spec.num_heads * d, H))
        k = reader.get(p + "self_attn.k_proj.weight", (spec.num_kv_heads * d, H))
        v = reader.get(p + "self_attn.v_proj.weight", (spec.num_kv_heads * d, H))
        reader.assign(a.qkv.weight, lambda q=q, k=k, v=v: torch.cat([tp.shard(q(), 0), tp.shard(k(), 0),
                                                                     tp.shard(v(), 0)]))
        if spec.qkv_bias:
            qb = reader.get(p + "self_attn.q_proj.bias", (spec.num_heads * d,))
            kb = reader.get(p + "self_attn.k_proj.bias", (spec.num_kv_heads * d,))
            vb = reader.get(p + "self_attn.v_proj.bias", (spec.num_kv_heads * d,))
            reader.assign(a.qkv.bias, lambda q=qb, k=kb, v=vb: torch.cat([tp.shard(q(), 0), tp.shard(k(), 0),
                                                                          tp.shard(v(), 0)]))
        o = reader.get(p + "self_attn.o_proj.weight", (H, spec.num_heads * d))
        reader.assign(a.o.weight, lambda o=o: tp.shard(o(), 1))
        if spec.out_bias:
            reader.put(a.o.bias, p + "self_attn.o_proj.bias", (H,))
        I = spec.intermediate_size
        g = reader.get(p + "mlp.gate_proj.weight", (I, H))
        u = reader.get(p + "mlp.up_proj.weight", (I, H))
        reader.assign(m.gate_up.weight, lambda g=g, u=u: torch.cat([tp.shard(g(), 0), tp.shard(u(), 0)]))
        dn = reader.get(p + "mlp.down_proj.weight", (H, I))
        reader.assign(m.down.weight, lambda dn=dn: tp.shard(dn(), 1))
        if spec.mlp_bias:
            gb = reader.get(p + "mlp.gate_proj.bias", (I,))
            ub = reader.get(p + "mlp.up_proj.bias", (I,))
            reader.assign(m.gate_up.bias, lambda g=gb, u=ub: torch.cat([tp.shard(g(), 0), tp.shard(u(), 0)]))
            reader.put(m.down.bias, p + "mlp.down_proj.bias", (H,))
