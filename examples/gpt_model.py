"""A small GPT-style decoder in plain PyTorch, used by the demo, the benchmarks and the tests.

Nothing here knows about zerospeed: it is the kind of model a user brings. Architecture (GPT-2
style): token + learned position embeddings, ``n_layer`` pre-LayerNorm blocks (causal
self-attention through ``F.scaled_dot_product_attention``, then a 4x GELU MLP, each with a
residual connection), a final LayerNorm and an LM head that shares its weight with the token
embedding when ``tie_embeddings`` (a tied parameter is a useful case for ZeRO: one tensor, two
uses, one gradient).

Invariants: ``idx`` is a LongTensor ``(batch, time)`` with ``time <= seq_len`` and values in
``[0, vocab_size)``; ``forward`` returns logits ``(batch, time, vocab_size)``, or with ``targets``
(same shape as ``idx``) the mean cross-entropy over all positions as a 0-d tensor. Initialisation
draws only from torch's global RNG in a fixed order, so ``torch.manual_seed(s); GPT(cfg)`` gives
the same weights in every process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 6
    d_model: int = 192
    seq_len: int = 64
    dropout: float = 0.0
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")


def gpt_small() -> GPTConfig:
    """~1.8M parameters, seq 64, byte vocabulary: trains visibly in a minute on a laptop CPU."""
    return GPTConfig(vocab_size=256, n_layer=4, n_head=6, d_model=192, seq_len=64)


def gpt_bench() -> GPTConfig:
    """~14M parameters, seq 128, byte vocabulary: big enough that gradients and optimizer state
    dominate a step, small enough for a 2-process CPU benchmark."""
    return GPTConfig(vocab_size=256, n_layer=8, n_head=6, d_model=384, seq_len=128)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=2)
        # (batch, time, d_model) -> (batch, n_head, time, head_dim)
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(batch, time, d_model)
        return self.proj_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self._init_weights()
        #: ``None``, or a function ``fn(block, x)`` run for each block instead of ``block(x)``, e.g.
        #: ``zerospeed.checkpointing.checkpoint`` (activation checkpointing, one checkpoint per block).
        self.checkpoint_fn = None

    def _init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, residual projections scaled down by
        sqrt(2 * n_layer) so the residual stream's variance does not grow with depth."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if module is self.lm_head and self.cfg.tie_embeddings:
                    continue  # shares tok_emb.weight, initialised once below
                std = residual_std if name.endswith(".proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Number of distinct parameter elements (a tied weight counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        batch, time = idx.shape
        if time > self.cfg.seq_len:
            raise ValueError(f"sequence length {time} exceeds seq_len {self.cfg.seq_len}")
        pos = torch.arange(time, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x) if self.checkpoint_fn is None or not torch.is_grad_enabled() else self.checkpoint_fn(block, x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
