"""Ulysses sequence parallelism: ``DistributedAttention`` (DeepSpeed's ``deepspeed.sequence.layer`` name).

Each rank of the sequence-parallel (sp) group holds ``1/sp`` of the sequence and every head. An all-to-all per
tensor turns sequence-sharded q/k/v into head-sharded q/k/v over the *whole* sequence, the unchanged local
attention runs on its ``heads/sp`` heads, and one more all-to-all returns the output to sequence shards. The
result equals attention over the whole sequence exactly (the same arithmetic per head, only moved).

Shapes: ``gather_idx`` is the sequence dimension of the inputs, ``scatter_idx`` their head dimension (DeepSpeed's
defaults 2 and 0 are ``[s/sp, b, heads, d]``). The output has the input's layout with the local attention's
head dimension merged as it returns it.

Heads: the query heads must divide by sp. Key/value heads (grouped-query attention) either divide by sp, or
sp divides by them: then each KV head is repeated ``sp // kv_heads`` times first (``repeat_interleave``, as
DeepSpeed's Ulysses does), so each rank receives the one KV head its query heads use. Any other count is one
line naming the head counts and the degree. The sequence shards must have the same length on every rank
(the all-to-all exchanges equal chunks); :class:`~zerospeed.runtime.sequence_parallel.ulysses_sp.
UlyssesSPDataLoaderAdapter` refuses a length sp does not divide, as DeepSpeed's does.

Collectives: one all-to-all forward for q, k and v packed together and one for the output; backward the same
two (:mod:`zerospeed.sequence.exchange`, through comm/, counted as ``all_to_all``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerospeed.comm import get_world_size, is_initialized
from zerospeed.sequence.exchange import heads_to_seq, seq_to_heads

__all__ = ["DistributedAttention", "SequenceParallelError", "kv_replication", "check_heads"]


class SequenceParallelError(ValueError):
    """A sequence-parallel set-up that cannot work (head counts, sequence lengths, hooks), in one line."""


def check_heads(num_heads: int, num_kv_heads: int, sp_size: int) -> None:
    """Raise :class:`SequenceParallelError` unless ``num_heads`` divides by ``sp_size`` and ``num_kv_heads``
    divides by it or divides it."""
    if num_heads % sp_size:
        raise SequenceParallelError(f"sequence parallelism: {num_heads} attention heads do not divide by "
                                    f"sequence_parallel_size {sp_size}")
    if num_kv_heads % sp_size and sp_size % num_kv_heads:
        raise SequenceParallelError(f"sequence parallelism: {num_kv_heads} key/value heads neither divide by nor "
                                    f"divide sequence_parallel_size {sp_size} (attention heads {num_heads})")
    if num_heads % num_kv_heads:
        raise SequenceParallelError(f"sequence parallelism: {num_heads} attention heads are not a multiple of "
                                    f"{num_kv_heads} key/value heads")


def kv_replication(num_kv_heads: int, sp_size: int) -> int:
    """How many times each KV head is repeated before the all-to-all (1 when the KV heads divide by sp)."""
    return 1 if num_kv_heads % sp_size == 0 else sp_size // num_kv_heads


class DistributedAttention(nn.Module):
    """Ulysses attention around ``local_attention(q, k, v, *args, **kwargs)`` over the group ``sp_group``.

    ``scatter_idx``: the head dimension of q/k/v; ``gather_idx``: their sequence dimension. The local
    attention sees the whole sequence and ``1/sp`` of the heads (GQA's KV heads repeated when fewer than sp).
    """

    def __init__(self, local_attention: Any, sequence_process_group: Any, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream: Any = None) -> None:
        super().__init__()
        if sp_stream is not None:
            raise SequenceParallelError("DistributedAttention: sp_stream (a CUDA side stream for overlapping the "
                                        "all-to-all) is not supported; pass None")
        if scatter_idx == gather_idx:
            raise SequenceParallelError(f"DistributedAttention: scatter_idx and gather_idx are both {scatter_idx}")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx

    @property
    def sp_size(self) -> int:
        return get_world_size(self.spg) if is_initialized() else 1

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int | None = None,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        """``batch_dim_idx`` is accepted for DeepSpeed's signature; the exchange does not depend on it."""
        del batch_dim_idx
        sp, heads = self.sp_size, self.scatter_idx
        if key.shape[heads] != value.shape[heads]:
            raise SequenceParallelError(f"DistributedAttention: key has {key.shape[heads]} heads, value "
                                        f"{value.shape[heads]} (dimension {heads})")
        check_heads(query.shape[heads], key.shape[heads], sp)
        rep = kv_replication(key.shape[heads], sp)
        q, k, v = heads_to_seq((query, key, value), self.spg, head_dim=heads, seq_dim=self.gather_idx,
                               reps=(1, rep, rep))
        context = self.local_attn(q, k, v, *args, **kwargs)
        return seq_to_heads((context,), self.spg, head_dim=heads, seq_dim=self.gather_idx)[0]
