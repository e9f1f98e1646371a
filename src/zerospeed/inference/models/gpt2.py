"""GPT-2: learned absolute positions, LayerNorm, fused Conv1D attention (stored ``[in, out]`` in HF
checkpoints, transposed into our Linear layers at load), tanh GELU MLP, LM head tied to ``wte``."""

from __future__ import annotations

import torch
import torch.nn as nn

from zerospeed.inference.models.layers import CausalLM, RowLinear, TPInfo, activation
from zerospeed.inference.models.spec import ModelSpec


class GPT2Block(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, tp: TPInfo) -> None:
        super().__init__()
        H = spec.hidden_size
        self.h = tp.split(spec.num_heads, "n_head")
        self.d = spec.head_dim
        self.inter = tp.split(spec.intermediate_size, "n_inner")
        self.ln_1 = nn.LayerNorm(H, eps=spec.norm_eps)
        self.qkv = nn.Linear(H, 3 * self.h * self.d)
        self.o = RowLinear(self.h * self.d, H, True, tp)
        self.ln_2 = nn.LayerNorm(H, eps=spec.norm_eps)
        self.fc = nn.Linear(H, self.inter)
        self.proj = RowLinear(self.inter, H, True, tp)
        self.act = activation(spec.activation)
        scale = spec.attn_scale if spec.attn_scale is not None else self.d ** -0.5
        self.scale = scale / (layer_idx + 1) if spec.scale_by_inverse_layer_idx else scale

    def forward(self, h, meta, k_cache, v_cache):
        T = h.shape[0]
        q, k, v = self.qkv(self.ln_1(h)).view(T, 3, self.h, self.d).unbind(1)
        h = h + self.o(meta.attend(q, k, v, k_cache, v_cache, self.scale))
        return h + self.proj(self.act(self.fc(self.ln_2(h))))


class GPT2LMHeadModel(CausalLM):
    def __init__(self, spec: ModelSpec, max_positions: int, tp: TPInfo = TPInfo()) -> None:
        super().__init__()
        self.spec, self.tp = spec, tp
        self.wte = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.wpe = nn.Embedding(spec.max_position_embeddings, spec.hidden_size)
        self.layers = nn.ModuleList(GPT2Block(spec, i, tp) for i in range(spec.num_layers))
        self.ln_f = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def input_embedding(self) -> nn.Embedding:
        return self.wte

    def forward(self, input_ids, meta, kv):
        h = self.wte(input_ids) + self.wpe(meta.positions)
        for i, layer in enumerate(self.layers):
            h = layer(h, meta, kv.k[i], kv.v[i])
        return self.ln_f(h)


def _heads(t: torch.Tensor, tp: TPInfo, spec: ModelSpec) -> torch.Tensor:
    """Fused ``[3*H, ...]`` q/k/v rows -> this rank's heads of each, still fused."""
    return torch.cat([tp.shard(part, 0) for part in t.chunk(3, dim=0)])


def load_weights(model: GPT2LMHeadModel, reader) -> None:
    spec, tp = model.spec, model.tp
    H, I = spec.hidden_size, spec.intermediate_size
    pre = "transformer." if reader.has("transformer.wte.weight") else ""
    reader.ignore("lm_head.weight")
    reader.put(model.wte.weight, pre + "wte.weight", (spec.vocab_size, H))
    reader.put(model.wpe.weight, pre + "wpe.weight", (spec.max_position_embeddings, H))
    reader.put(model.ln_f.weight, pre + "ln_f.weight", (H,))
    reader.put(model.ln_f.bias, pre + "ln_f.bias", (H,))
    for i, b in enumerate(model.layers):
        p = f"{pre}h.{i}."
        for ln, name in ((b.ln_1, "ln_1"), (b.ln_2, "ln_2")):
            reader.put(ln.weight, p + name + ".weight", (H,))
            reader.put(ln.bias, p + name + ".bias", (H,))
        w = reader.get(p + "attn.c_attn.weight", (H, 3 * H))
        reader.assign(b.qkv.weight, lambda w=w: _heads(w().t(), tp, spec).contiguous())
        bb = reader.get(p + "attn.c_attn.bias", (3 * H,))
        reader.assign(b.qkv.bias, lambda bb=bb: _heads(bb(), tp, spec))
        w = reader.get(p + "attn.c_proj.weight", (H, H))
        reader.assign(b.o.weight, lambda w=w: tp.shard(w().t(), 1).contiguous())
        reader.put(b.o.bias, p + "attn.c_proj.bias", (H,))
        w = reader.get(p + "mlp.c_fc.weight", (H, I))
        reader.assign(b.fc.weight, lambda w=w: tp.shard(w().t(), 0).contiguous())
        bb = reader.get(p + "mlp.c_fc.bias", (I,))
        reader.assign(b.fc.bias, lambda bb=bb: tp.shard(bb(), 0))
        w = reader.get(p + "mlp.c_proj.weight", (I, H))
        reader.assign(b.proj.weight, lambda w=w: tp.shard(w().t(), 1).contiguous())
        reader.put(b.proj.bias, p + "mlp.c_proj.bias", (H,))
