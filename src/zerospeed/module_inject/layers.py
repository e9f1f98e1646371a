"""Tensor-parallel replacement layers (DeepSpeed's names): each holds one tp rank's piece.

* :class:`LinearLayer` -- column-parallel: weight split on the output dimension, no forward
  collective, the input gradient all-reduced.
* :class:`LinearAllreduce` -- row-parallel: weight split on the input dimension, the output
  all-reduced, the bias (replicated) added once after the reduction.
* :class:`LmHeadLayer` -- vocabulary-parallel LM head: the vocabulary is split (padded to a multiple
  of tp), local logits all-gathered and cut back to the vocabulary, so the model's own loss works.
* :class:`VocabParallelEmbedding` -- the input embedding split on the vocabulary, used when the LM
  head is tied to it (GPT-2): both keep sharing one local ``weight`` Parameter.

Decisions:

* Parameter names stay ``weight`` / ``bias``, so state-dict keys are the original model's.
* ``transposed=True`` keeps HF ``Conv1D``'s ``[in, out]`` storage (its weight is saved and
  consolidated in that layout), computing ``x @ W + b``.
* Each layer records the :class:`~zerospeed.module_inject.tp_shard.TPSplit` of each of its
  parameters in ``tp_splits``; :func:`zerospeed.module_inject.tp_param_splits` collects them by
  qualified name for checkpoints, consolidation and gradient-norm accounting. A parameter absent
  from that map is replicated over the tp group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.comm import traceable
from zerospeed.module_inject.functional import copy_to_tp, gather_from_tp, reduce_from_tp
from zerospeed.module_inject.tp_shard import TPSplit, local_piece

__all__ = ["LinearAllreduce", "LinearLayer", "LmHeadLayer", "TPLayer", "VocabParallelEmbedding"]


class TPLayer(nn.Module):
    """Base of the replacement layers: the tp group, this rank's index and each parameter's split."""

    def __init__(self, tp_group: Any, tp_size: int, tp_rank: int) -> None:
        super().__init__()
        self.tp_group, self.tp_size, self.tp_rank = tp_group, tp_size, tp_rank
        self.tp_splits: dict[str, TPSplit] = {}
        traceable.group_id(tp_group)  # registered eagerly: a compiled forward refers to it by number

    def _set_piece(self, name: str, full: torch.Tensor | None, split: TPSplit | None, requires_grad: bool) -> None:
        if full is None:
            self.register_parameter(name, None)
            return
        data = full.detach() if split is None else local_piece(full.detach(), split, self.tp_rank)
        self.register_parameter(name, nn.Parameter(data.clone() if split is None else data,
                                                   requires_grad=requires_grad))
        if split is not None:
            self.tp_splits[name] = split


class LinearLayer(TPLayer):
    """Column-parallel linear: ``y_local = x @ W_local^T + b_local``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, weight_split: TPSplit,
                 bias_split: TPSplit | None, tp_group: Any, tp_size: int, tp_rank: int,
                 transposed: bool = False) -> None:
        super().__init__(tp_group, tp_size, tp_rank)
        self.transposed = transposed
        self._set_piece("weight", weight, weight_split, weight.requires_grad)
        self._set_piece("bias", bias, bias_split, bias is not None and bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.tp_group, self.tp_size)
        if self.transposed:
            out = x @ self.weight
            return out + self.bias if self.bias is not None else out
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"column, local weight {list(self.weight.shape)}, tp={self.tp_size}"


class LinearAllreduce(TPLayer):
    """Row-parallel linear: ``y = allreduce(x_local @ W_local^T) + b``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, weight_split: TPSplit, tp_group: Any,
                 tp_size: int, tp_rank: int, transposed: bool = False) -> None:
        super().__init__(tp_group, tp_size, tp_rank)
        self.transposed = transposed
        self._set_piece("weight", weight, weight_split, weight.requires_grad)
        self._set_piece("bias", bias, None, bias is not None and bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight if self.transposed else F.linear(x, self.weight)
        out = reduce_from_tp(out, self.tp_group, self.tp_size)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return f"row, local weight {list(self.weight.shape)}, tp={self.tp_size}"


class LmHeadLayer(TPLayer):
    """Vocabulary-parallel LM head: local logits for ``vocab / tp`` rows, gathered to the full vocabulary.

    ``weight`` may be an existing local Parameter (tied to a :class:`VocabParallelEmbedding`).
    """

    def __init__(self, weight: torch.Tensor | nn.Parameter, bias: torch.Tensor | None, vocab_size: int,
                 weight_split: TPSplit, tp_group: Any, tp_size: int, tp_rank: int, shared: bool = False) -> None:
        super().__init__(tp_group, tp_size, tp_rank)
        self.vocab_size = vocab_size
        if shared:
            self.weight = weight  # the embedding's local piece, already cut
            self.tp_splits["weight"] = weight_split
        else:
            self._set_piece("weight", weight, weight_split, weight.requires_grad)
        bias_split = None
        if bias is not None:
            bias_split = TPSplit((vocab_size,), 0, (vocab_size,), tp_size, padded_size=weight_split.total)
        self._set_piece("bias", bias, bias_split, bias is not None and bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.tp_group, self.tp_size)
        logits = gather_from_tp(F.linear(x, self.weight, self.bias), self.tp_group, self.tp_size, self.tp_rank)
        return logits[..., : self.vocab_size] if logits.shape[-1] != self.vocab_size else logits

    def extra_repr(self) -> str:
        return f"vocab-parallel, vocab {self.vocab_size}, local weight {list(self.weight.shape)}, tp={self.tp_size}"


class VocabParallelEmbedding(TPLayer):
    """Embedding with rows ``[rank * n, (rank + 1) * n)`` of the (padded) vocabulary; outputs all-reduced."""

    def __init__(self, embedding: nn.Embedding, weight_split: TPSplit, tp_group: Any, tp_size: int,
                 tp_rank: int) -> None:
        super().__init__(tp_group, tp_size, tp_rank)
        if embedding.max_norm is not None:
            raise ValueError("VocabParallelEmbedding: max_norm embeddings cannot be split over the vocabulary")
        self.num_embeddings = embedding.num_embeddings
        self.padding_idx = embedding.padding_idx
        self._set_piece("weight", embedding.weight, weight_split, embedding.weight.requires_grad)
        self.local_rows = self.weight.shape[0]
        self.start = tp_rank * self.local_rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.local_rows)
        pad = None
        if self.padding_idx is not None and 0 <= self.padding_idx - self.start < self.local_rows:
            pad = self.padding_idx - self.start  # its row gets no gradient, as in nn.Embedding
        out = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp_group, self.tp_size)

    def extra_repr(self) -> str:
        return f"vocab-parallel, {self.num_embeddings} rows, local {list(self.weight.shape)}, tp={self.tp_size}"
