"""Attention over a ragged batch whose keys and values live in the paged KV cache.

A ragged batch is a flat run of ``T`` tokens from many sequences, no padding: first every decoding
sequence's single token (``num_decodes`` of them), then prompt chunks (``n_i`` tokens each, which
may continue a prompt whose earlier chunks are already cached). :class:`AttentionMetadata` is built
once per forward and shared by every layer; :meth:`AttentionMetadata.attend` does, per layer:

1. write this forward's K/V into their cache slots (``slot = block * block_size + offset``);
2. decodes, in groups of similar context length (the engine orders decodes longest first; a new
   group starts where a sequence's context is under 3/4 of its group's longest): per group, one
   batched SDPA call, ``q [b, H, 1, D]`` against the group's contexts gathered through their block
   tables (whole blocks, one index per block) into ``[b, L_max, H, D]``, with a key-padding mask
   (the only padding anywhere, and only in attention keys; grouping keeps it small);
3. prompt chunks: one SDPA call each. A chunk that starts at position 0 attends to its own K/V
   directly with ``is_causal`` (no gather); a later chunk gathers its cached prefix and uses an
   explicit causal-with-offset mask.

Measured on the 2-core CPU (one thread; bench/inference_bench.py's model, 32 decodes of 80-320
tokens, per layer): the gather into a freshly allocated tensor cost 2.2 ms, most of it page faults
on the new memory, against 0.7-0.9 ms into a preallocated :class:`Workspace` buffer, which is what
we do; SDPA over the gathered (token-major) blocks cost about the same as over a head-major cache
layout (0.8 ms either way), so the cache stays token-major; a hand-written ``matmul``/``softmax``
was no faster than SDPA (and ``einsum`` over the gathered layout 8x slower); one SDPA call per
sequence (a Python loop per layer) and one block-diagonal mask for the whole batch (``B``-fold
wasted compute) were rejected by design; ``flex_attention`` was not measured (on CPU it needs
``torch.compile``, whose compile time this 2-core shared machine could not afford).

On CPU in float32 with the C kernels, :meth:`AttentionMetadata.attend_qkv` takes the fused QKV
projection instead and does the rotary, the cache writes and the decodes in one C call
(:func:`cpu_kernel.attention_layer`), prompt chunks as below.

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

from zerospeed.inference import cpu_kernel
from zerospeed.inference.fast_path_choice import OFF, KernelPlan, legacy_plan

GROUP_RATIO = 0.75  # a decode whose context is under this fraction of its group's longest starts a new group


class Workspace:
    """Grow-only scratch buffers reused by every forward (the gathered K and V of one group at a
    time): reusing memory avoids the page faults of a fresh multi-MB allocation per layer."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, device)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 2 * buf.numel() if buf is not None else numel), dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf[:numel]


@dataclass
class PrefillChunk:
    token_start: int  # index of the chunk's first token in the flat batch
    num_tokens: int
    context_len: int  # tokens visible to the chunk's last query (cached prefix + chunk)
    ctx_slots: torch.Tensor | None  # the blocks holding the context; None when the chunk starts at 0


@dataclass
class DecodeGroup:
    start: int  # rows [start, end) of the batch
    end: int
    tables: torch.Tensor  # [b, max_blocks] block tables; padding is block 0, masked
    lens: torch.Tensor  # [b] context lengths (cached tokens + this one)
    full: bool  # every row fills all max_blocks * block_size keys: no mask needed without a window


@dataclass
class AttentionMetadata:
    slots: torch.Tensor  # [T] where each token's K/V is written
    positions: torch.Tensor  # [T]
    num_decodes: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    scale: float | None = None
    block_size: int = 16
    workspace: Workspace | None = None
    # with the CPU kernel (see cpu_kernel): every decode's block table in one [nd, max_blocks] tensor
    kernel_tables: torch.Tensor | None = None
    kernel_lens: torch.Tensor | None = None
    kernel_max_ctx: int = 0
    # float32 on CPU with the C attention kernels: layers may use attend_qkv (see the models)
    cpu_fused: bool = False
    # which C kernels this forward's layers use (the norms, SwiGLU's gate, the skinny GEMM; see
    # fast_path_choice): chosen per forward by the engine
    kernels: KernelPlan = OFF
    _masks: dict = field(default_factory=dict)

    @classmethod
    def build(cls, seq_tokens: list[tuple[int, int, list[int]]], num_decodes: int, block_size: int,
              device: torch.device, workspace: Workspace | None = None,
              decode_kernel: bool = False, kernels: KernelPlan | None = None) -> "AttentionMetadata":
        """``seq_tokens``: per sequence in batch order ``(num_cached, num_new, block_table)``; the
        first ``num_decodes`` have ``num_new == 1`` (best ordered longest context first).
        ``kernels``: the C kernels of this forward (its ``attention``: decodes go through
        :func:`cpu_kernel.decode_attention` / :func:`cpu_kernel.attention_layer`, float32 CPU); without
        it, ``decode_kernel`` turns every kernel on or off (``fast_path_choice.legacy_plan``)."""
        if kernels is None:
            kernels = legacy_plan(decode_kernel)
        decode_kernel = kernels.attention
        bs = block_size
        positions: list[int] = []
        slots: list[int] = []
        for cached, new, table in seq_tokens[:num_decodes]:
            positions.append(cached)
            slots.append(table[cached // bs] * bs + cached % bs)
        for cached, new, table in seq_tokens[num_decodes:]:
            positions.extend(range(cached, cached + new))
            for b in range(cached // bs, (cached + new - 1) // bs + 1):
                lo, hi = max(cached, b * bs), min(cached + new, (b + 1) * bs)
                base = table[b] * bs - b * bs
                slots.extend(range(base + lo, base + hi))
        groups: list[DecodeGroup] = []
        k_tables = k_lens = None
        k_max = 0
        if decode_kernel and num_decodes:
            lens = [seq_tokens[r][0] + 1 for r in range(num_decodes)]
            k_max = max(lens)
            nb_max = -(-k_max // bs)
            rows = [seq_tokens[r][2][:nb_max] for r in range(num_decodes)]
            k_tables = torch.tensor([t + [0] * (nb_max - len(t)) for t in rows], dtype=torch.int64)
            k_lens = torch.tensor(lens, dtype=torch.int64)
        i = num_decodes if decode_kernel else 0
        while i < num_decodes:
            nb_max = -(-(seq_tokens[i][0] + 1) // bs)
            j = i + 1
            while j < num_decodes:
                nb = -(-(seq_tokens[j][0] + 1) // bs)
                if nb > nb_max or nb < GROUP_RATIO * nb_max:
                    break
                j += 1
            lens = [seq_tokens[r][0] + 1 for r in range(i, j)]
            rows = []
            for r in range(i, j):
                t = seq_tokens[r][2][:nb_max]
                rows.append(t + [0] * (nb_max - len(t)))
            groups.append(DecodeGroup(i, j, torch.tensor(rows, dtype=torch.int64, device=device),
                                      torch.tensor(lens, dtype=torch.int64, device=device),
                                      all(n == nb_max * bs for n in lens)))
            i = j
        prefills = []
        start = num_decodes
        for cached, new, table in seq_tokens[num_decodes:]:
            ctx = cached + new
            ctx_slots = None
            if cached:
                nb = (ctx + bs - 1) // bs
                ctx_slots = torch.tensor(table[:nb], dtype=torch.int64, device=device)
            prefills.append(PrefillChunk(start, new, ctx, ctx_slots))
            start += new
        return cls(torch.tensor(slots, dtype=torch.int64, device=device),
                   torch.tensor(positions, dtype=torch.int64, device=device), num_decodes, groups,
                   prefills, block_size=block_size, workspace=workspace if workspace is not None else Workspace(),
                   kernel_tables=k_tables, kernel_lens=k_lens, kernel_max_ctx=k_max, cpu_fused=decode_kernel,
                   kernels=kernels)

    @property
    def num_tokens(self) -> int:
        return int(self.slots.numel())

    def _decode_mask(self, g: int, window: int | None) -> torch.Tensor | None:
        group = self.decode_groups[g]
        if group.full and window is None:
            return None
        key = ("d", g, window)
        if key not in self._masks:
            L = group.tables.shape[1] * self.block_size
            k = torch.arange(L, device=group.tables.device)
            lens = group.lens.unsqueeze(-1)
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
        if self.kernel_tables is not None:
            out = torch.empty_like(q) if q.is_contiguous() else torch.empty(q.shape, dtype=q.dtype, device=q.device)
            nd = self.num_decodes
            cpu_kernel.decode_attention(q[:nd], k_cache, v_cache, self.kernel_tables, self.kernel_lens,
                                        self.block_size, self.kernel_max_ctx, scale, window, out=out[:nd])
            if not self.prefills:
                return out.view(T, hq * d)
        elif len(self.decode_groups) == 1 and not self.prefills:
            return self._decode(0, q, k_cache, v_cache, scale, window, gqa).reshape(T, hq * d)
        else:
            out = torch.empty_like(q)
        for g, group in enumerate(self.decode_groups):
            out[group.start:group.end] = self._decode(g, q[group.start:group.end], k_cache, v_cache, scale, window,
                                                      gqa)
        self._prefills_into(out, q, k, v, k_cache, v_cache, scale, window, gqa)
        return out.view(T, hq * d)

    def attend_qkv(self, qkv: torch.Tensor, hq: int, hkv: int, d: int, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float | None = None,
                   window: int | None = None) -> torch.Tensor:
        """:meth:`attend` from the fused projection ``qkv [T, (hq + 2 hkv) d]`` with rotary ``cos`` /
        ``sin`` (``[T, 1, rot]``) applied, in one C call for the rotary, the cache writes and the
        decodes (only with ``cpu_fused``: float32 on CPU with the kernels built). Returns ``[T, hq*d]``."""
        T = qkv.shape[0]
        out, q, k = cpu_kernel.attention_layer(
            qkv, self.num_decodes, hq, hkv, d, cos.reshape(T, -1), sin.reshape(T, -1), self.slots, k_cache, v_cache,
            self.kernel_tables, self.kernel_lens, self.block_size, self.kernel_max_ctx, scale, window,
            want_k=bool(self.prefills))
        if self.prefills:
            v = qkv[:, (hq + hkv) * d:].view(T, hkv, d)
            self._prefills_into(out, q, k, v, k_cache, v_cache, scale, window, hq != hkv)
        return out.view(T, hq * d)

    def _prefills_into(self, out, q, k, v, k_cache, v_cache, scale, window, gqa) -> None:
        """Prompt chunks: one SDPA call each, into rows of ``out [T, Hq, D]``."""
        for i, chunk in enumerate(self.prefills):
            s, n = chunk.token_start, chunk.num_tokens
            qp = q[s:s + n].transpose(0, 1).unsqueeze(0)
            if chunk.ctx_slots is None:
                kp, vp = k[s:s + n], v[s:s + n]
            else:
                kp = self._gather(k_cache, chunk.ctx_slots, "k")[0, :chunk.context_len]
                vp = self._gather(v_cache, chunk.ctx_slots, "v")[0, :chunk.context_len]
            kp = kp.transpose(0, 1).unsqueeze(0)
            vp = vp.transpose(0, 1).unsqueeze(0)
            mask = self._prefill_mask(i, window)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=mask is None, scale=scale,
                                               enable_gqa=gqa)
            out[s:s + n] = o[0].transpose(0, 1)

    def _gather(self, cache: torch.Tensor, tables: torch.Tensor, name: str) -> torch.Tensor:
        """Blocks ``tables [B, nb]`` of a ``[slots, H, D]`` cache -> ``[B, nb * block_size, H, D]``, in
        the workspace buffer ``name`` (valid until the next gather into it)."""
        _, h, d = cache.shape
        row = self.block_size * h * d
        blocks = cache.view(-1, row)
        if tables.dim() == 1:
            tables = tables.unsqueeze(0)
        n = tables.numel()
        buf = self.workspace.get(name, n * row, cache.dtype, cache.device).view(n, row)
        torch.index_select(blocks, 0, tables.reshape(-1), out=buf)
        return buf.view(tables.shape[0], -1, h, d)

    def _decode(self, g, q, k_cache, v_cache, scale, window, gqa) -> torch.Tensor:
        tables = self.decode_groups[g].tables
        kd = self._gather(k_cache, tables, "k").transpose(1, 2)  # [b, Hkv, L, D]
        vd = self._gather(v_cache, tables, "v").transpose(1, 2)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=self._decode_mask(g, window),
                                           scale=scale, enable_gqa=gqa)
        return o.squeeze(2)
