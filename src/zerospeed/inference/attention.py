"""Attention over a ragged batch whose keys and values live in the paged KV cache.

A ragged batch is a flat run of ``T`` tokens from many sequences, no padding: first every decoding
sequence's single token (``num_decodes`` of them), then prompt chunks (``n_i`` tokens each, which
may continue a prompt whose earlier chunks are already cached). :class:`AttentionMetadata` is built
once per forward and shared by every layer; :meth:`AttentionMetadata.attend` does, per layer:

1. write this forward's K/V into their cache slots (``slot = block * block_size + offset``);
2. decodes: one batched SDPA call, ``q [B, H, 1, D]`` against each sequence's context gathered
   through its block table (whole blocks, one index per block) into ``[B, H, L_max, D]``, with a
   key-padding mask (the only padding anywhere, and only in attention keys). Chosen over one call
   per sequence (a Python loop per layer) and over one block-diagonal mask for the whole batch
   (``B``-fold wasted compute); ``flex_attention`` was not measured (on CPU it needs
   ``torch.compile``, whose compile time this 2-core shared machine could not afford);
3. prompt chunks: one SDPA call each. A chunk that starts at position 0 attends to its own K/V
   directly with ``is_causal`` (no gather); a later chunk gathers its cached prefix and uses an
   explicit causal-with-offset mask.

Grouped-query attention repeats nothing: SDPA's ``enable_gqa`` broadcasts KV heads. A sliding
window (Mistral, Qwen2) narrows the masks per layer; masks are built once per window value.

Invariants: the cache is ``[num_slots, kv_heads, head_dim]`` per layer (a flat view of
``[num_blocks, block_size, kv_heads, head_dim]``); ``slots``, ``positions`` are int64 on the cache's
device; every query has at least one visible key, so no softmax row is empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    token_start: int  # index of the chunk's first token in the flat batch
    num_tokens: int
    context_len: int  # tokens visible to the chunk's last query (cached prefix + chunk)
    ctx_slots: torch.Tensor | None  # the blocks holding the context; None when the chunk starts at 0


@dataclass
class AttentionMetadata:
    slots: torch.Tensor  # [T] where each token's K/V is written
    positions: torch.Tensor  # [T]
    num_decodes: int
    decode_ctx_slots: torch.Tensor | None  # [B, max_blocks] block tables; padding is block 0, masked
    decode_ctx_lens: torch.Tensor | None  # [B]
    prefills: list[PrefillChunk]
    scale: float | None = None
    block_size: int = 16
    _masks: dict = field(default_factory=dict)

    @classmethod
    def build(cls, seq_tokens: list[tuple[int, int, list[int]]], num_decodes: int, block_size: int,
              device: torch.device) -> "AttentionMetadata":
        """``seq_tokens``: per sequence in batch order ``(num_cached, num_new, block_table)``; the
        first ``num_decodes`` have ``num_new == 1``."""
        positions: list[int] = []
        slots: list[int] = []
        for cached, new, table in seq_tokens:
            for p in range(cached, cached + new):
                positions.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
        dec_slots = dec_lens = None
        if num_decodes:
            lens = [seq_tokens[i][0] + 1 for i in range(num_decodes)]
            max_blocks = (max(lens) + block_size - 1) // block_size
            rows = []
            for i in range(num_decodes):
                t = seq_tokens[i][2][:-(-lens[i] // block_size)]
                rows.append(t + [0] * (max_blocks - len(t)))
            # whole blocks are gathered (one contiguous row of block_size * heads * dim per block)
            dec_slots = torch.tensor(rows, dtype=torch.int64, device=device)
            dec_lens = torch.tensor(lens, dtype=torch.int64, device=device)
        prefills = []
        start = num_decodes
        for cached, new, table in seq_tokens[num_decodes:]:
            ctx = cached + new
            ctx_slots = None
            if cached:
                nb = (ctx + block_size - 1) // block_size
                ctx_slots = torch.tensor(table[:nb], dtype=torch.int64, device=device)
            prefills.append(PrefillChunk(start, new, ctx, ctx_slots))
            start += new
        return cls(torch.tensor(slots, dtype=torch.int64, device=device),
                   torch.tensor(positions, dtype=torch.int64, device=device), num_decodes, dec_slots, dec_lens,
                   prefills, block_size=block_size)

    @property
    def num_tokens(self) -> int:
        return int(self.slots.numel())

    def _decode_mask(self, window: int | None) -> torch.Tensor:
        key = ("d", window)
        if key not in self._masks:
            L = self.decode_ctx_slots.shape[1] * self.block_size
            k = torch.arange(L, device=self.decode_ctx_slots.device)
            lens = self.decode_ctx_lens.unsqueeze(-1)
            m = k < lens
            if window is not None:
                m &= k > (lens - 1 - window)
            self._masks[key] = m.view(-1, 1, 1, L)
        return self._masks[key]

    def _prefill_mask(self, i: int, window: int | None) -> torch.Tensor | None:
        chunk = self.prefills[i]
        if chunk.ctx_slots is None and window is None:
            return None  # is_causal
        key = (i, window)
        if key not in self._masks:
            dev = self.slots.device
            q_pos = torch.arange(chunk.context_len - chunk.num_tokens, chunk.context_len, device=dev).unsqueeze(-1)
            k_pos = torch.arange(chunk.context_len, device=dev)
            m = k_pos <= q_pos
            if window is not None:
                m &= k_pos > q_pos - window
            self._masks[key] = m
        return self._masks[key]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float | None = None, window: int | None = None) -> torch.Tensor:
        """``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]``; caches ``[slots, Hkv, D]``. Returns ``[T, Hq*D]``."""
        T, hq, d = q.shape
        gqa = hq != k.shape[1]
        k_cache.index_copy_(0, self.slots, k)
        v_cache.index_copy_(0, self.slots, v)
        if self.num_decodes == T and not self.prefills:
            return self._decode(q, k_cache, v_cache, scale, window, gqa).reshape(T, hq * d)
        out = torch.empty_like(q)
        nd = self.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, scale, window, gqa)
        for i, chunk in enumerate(self.prefills):
            s, n = chunk.token_start, chunk.num_tokens
            qp = q[s:s + n].transpose(0, 1).unsqueeze(0)
            if chunk.ctx_slots is None:
                kp, vp = k[s:s + n], v[s:s + n]
            else:
                kp = self._gather(k_cache, chunk.ctx_slots)[0, :chunk.context_len]
                vp = self._gather(v_cache, chunk.ctx_slots)[0, :chunk.context_len]
            kp = kp.transpose(0, 1).unsqueeze(0)
            vp = vp.transpose(0, 1).unsqueeze(0)
            mask = self._prefill_mask(i, window)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=mask is None, scale=scale,
                                               enable_gqa=gqa)
            out[s:s + n] = o[0].transpose(0, 1)
        return out.view(T, hq * d)

    def _gather(self, cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Blocks ``tables [B, nb]`` of a ``[slots, H, D]`` cache -> ``[B, nb * block_size, H, D]``."""
        _, h, d = cache.shape
        blocks = cache.view(-1, self.block_size * h * d)
        if tables.dim() == 1:
            tables = tables.unsqueeze(0)
        return blocks.index_select(0, tables.reshape(-1)).view(tables.shape[0], -1, h, d)

    def _decode(self, q, k_cache, v_cache, scale, window, gqa) -> torch.Tensor:
        kd = self._gather(k_cache, self.decode_ctx_slots).transpose(1, 2)  # [B, Hkv, L, D]
        vd = self._gather(v_cache, self.decode_ctx_slots).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=self._decode_mask(window), scale=scale,
                                           enable_gqa=gqa)
        return o.squeeze(2)
