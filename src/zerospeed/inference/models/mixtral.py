"""The Mixtral family: Llama attention (GQA, rotary, sliding window) with a sparse mixture-of-experts
FFN in every layer, top-k routing (Mixtral: 2 of 8 experts per token).

Our own modules, not HF's. Attention and norms are the Llama family's
(:mod:`zerospeed.inference.models.llama`); the FFN is :class:`MixtralMoE`:

* router: a bias-free linear layer to ``E`` logits, softmax in float32 over all experts, the top
  ``k`` kept and renormalised to sum to 1 (HF's Mixtral routing, operation by operation);
* experts: the weights of all experts stacked, ``gate_up`` ``[E, 2I, H]`` and ``down`` ``[E, H, I]``
  (the transformers-5 checkpoint layout, so loading is a copy). The forward is grouped, not a
  Python loop per expert: the ``T*k`` (token, expert) pairs are placed into an ``[E, C, H]`` batch
  (``C`` = the busiest expert's pair count this forward: nothing is dropped, padding rows are
  zeros), two batched matmuls run every expert at once, and each token sums its ``k`` rows
  weighted by its routing weights. One forward is a fixed number of kernels whatever ``E`` is.
  When at most half the experts have tokens (decoding one or a few sequences), the batch would
  mostly multiply unused experts' weights: then only the experts in use run, one after the other
  (measured at H 1024, I 2816, 8 experts, one token, one thread: 4x faster than the batch over
  all 8). Both paths combine each token's ``k`` rows in the same order.

Decisions:

* Tensor parallelism is refused for this family for now (the MoE FFN would need its experts'
  columns split, or experts spread over ranks); one rank serves the whole model.
* Checkpoints saved by transformers 4 (per-expert ``block_sparse_moe.experts.<e>.w1/w2/w3``) are
  read too: the per-expert matrices are stacked on load.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerospeed.inference.models.layers import RMSNorm, TPInfo, activation
from zerospeed.inference.models.llama import LlamaAttention, LlamaForCausalLM
from zerospeed.inference.models.spec import ModelLoadError, ModelSpec


class MixtralMoE(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
        if E < 1 or not 1 <= spec.experts_per_token <= E:
            raise ModelLoadError(f"num_experts_per_tok ({spec.experts_per_token}) must be between 1 and "
                                 f"num_local_experts ({E})")
        self.num_experts, self.k, self.inter = E, spec.experts_per_token, I
        self.router = nn.Linear(H, E, bias=False)
        self.gate_up = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down = nn.Parameter(torch.empty(E, H, I))
        self.act = activation(spec.activation)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> (weights ``[T, k]`` float32, expert indices ``[T, k]``)."""
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), experts

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up[e]).split(self.inter, dim=-1)
        return F.linear(self.act(gate) * up, self.down[e])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, H = x.shape
        weights, experts = self.route(x)
        flat = experts.reshape(-1)  # pair p = token p // k, its (p % k)-th choice
        token = torch.arange(T, device=x.device).repeat_interleave(self.k)
        onehot = F.one_hot(flat, self.num_experts)
        counts = onehot.sum(0)
        hit = torch.nonzero(counts).flatten().tolist()
        if 2 * len(hit) <= self.num_experts:
            # few experts in use (decoding a small batch): only their weights are read, one at a time
            pair_out = x.new_empty(T * self.k, H)
            for e in hit:
                rows = torch.nonzero(flat == e).flatten()
                pair_out[rows] = self._expert(e, x.index_select(0, token.index_select(0, rows)))
        else:
            # grouped: every pair in its expert's slot of an [E, C, H] batch, two batched matmuls
            slot = ((onehot.cumsum(0) - 1) * onehot).sum(-1)  # pairs of one expert numbered in token order
            capacity = int(counts.max().item())
            where = flat * capacity + slot
            batch = x.new_zeros(self.num_experts * capacity, H)
            batch.index_copy_(0, where, x.index_select(0, token))
            batch = batch.view(self.num_experts, capacity, H)
            gate, up = torch.bmm(batch, self.gate_up.transpose(1, 2)).split(self.inter, dim=-1)
            out = torch.bmm(self.act(gate) * up, self.down.transpose(1, 2)).reshape(-1, H)
            pair_out = out.index_select(0, where)
        rows = pair_out.view(T, self.k, H)
        return (rows * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)


class MixtralBlock(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, tp: TPInfo) -> None:
        super().__init__()
        self.input_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.attn = LlamaAttention(spec, layer_idx, tp)
        self.post_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.moe = MixtralMoE(spec)

    def forward(self, h, meta, cos, sin, k_cache, v_cache):
        h = h + self.attn(self.input_norm(h), meta, cos, sin, k_cache, v_cache)
        return h + self.moe(self.post_norm(h))


class MixtralForCausalLM(LlamaForCausalLM):
    """Llama's embedding, rotary table, norm and LM head around Mixtral's sparse-MoE blocks."""

    block_cls = MixtralBlock

    def __init__(self, spec: ModelSpec, max_positions: int, tp: TPInfo = TPInfo()) -> None:
        if tp.size > 1:
            raise ModelLoadError(f"{spec.model_type}: tensor parallelism (size {tp.size}) is not supported for "
                                 "mixture-of-experts models yet; serve it with tensor_parallel size 1")
        super().__init__(spec, max_positions, tp)


def _stacked(reader, names: list[str], shape: tuple[int, ...]):
    thunks = [reader.get(n, shape) for n in names]
    return lambda: torch.stack([t() for t in thunks])


def load_weights(model: MixtralForCausalLM, reader) -> None:
    spec = model.spec
    d, H, I, E = spec.head_dim, spec.hidden_size, spec.intermediate_size, spec.num_experts
    reader.put(model.embed.weight, "model.embed_tokens.weight", (spec.vocab_size, H))
    reader.put(model.norm.weight, "model.norm.weight", (H,))
    if spec.tie_word_embeddings:
        reader.ignore("lm_head.weight")
    else:
        reader.put(model.lm_head.weight, "lm_head.weight", (spec.vocab_size, H))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a, m = layer.attn, layer.moe
        reader.put(layer.input_norm.weight, p + "input_layernorm.weight", (H,))
        reader.put(layer.post_norm.weight, p + "post_attention_layernorm.weight", (H,))
        q = reader.get(p + "self_attn.q_proj.weight", (spec.num_heads * d, H))
        k = reader.get(p + "self_attn.k_proj.weight", (spec.num_kv_heads * d, H))
        v = reader.get(p + "self_attn.v_proj.weight", (spec.num_kv_heads * d, H))
        reader.assign(a.qkv.weight, lambda q=q, k=k, v=v: torch.cat([q(), k(), v()]))
        reader.put(a.o.weight, p + "self_attn.o_proj.weight", (H, spec.num_heads * d))
        if reader.has(p + "mlp.experts.gate_up_proj"):  # transformers 5: experts stacked, router "mlp.gate"
            reader.put(m.router.weight, p + "mlp.gate.weight", (E, H))
            reader.put(m.gate_up, p + "mlp.experts.gate_up_proj", (E, 2 * I, H))
            reader.put(m.down, p + "mlp.experts.down_proj", (E, H, I))
        else:  # transformers 4: block_sparse_moe.experts.<e>.w1 (gate), w3 (up), w2 (down)
            b = p + "block_sparse_moe."
            reader.put(m.router.weight, b + "gate.weight", (E, H))
            w1 = _stacked(reader, [f"{b}experts.{e}.w1.weight" for e in range(E)], (I, H))
            w3 = _stacked(reader, [f"{b}experts.{e}.w3.weight" for e in range(E)], (I, H))
            reader.assign(m.gate_up, lambda w1=w1, w3=w3: torch.cat([w1(), w3()], dim=1))
            reader.assign(m.down, _stacked(reader, [f"{b}experts.{e}.w2.weight" for e in range(E)], (H, I)))
