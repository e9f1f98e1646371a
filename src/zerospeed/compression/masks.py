"""Pruning masks: which weights, rows, heads or channels stay.

Every mask keeps exactly ``keep_count(n, dense_ratio) = max(1, round(n * dense_ratio))`` of its ``n``
units (elements, rows, heads, channels), chosen by the largest scores; ties break by index
(``torch.topk`` on scores plus a tiny index-ordered epsilon would be fragile, so the selection is a
stable sort).  Scores are detached: masks never carry gradient themselves, the learnable ``topk``
method gets its gradient through :func:`straight_through`.

Orientation: weights are in the ``(out, in, ...)`` layout of ``nn.Linear``/``nn.Conv2d``; a row is an
output unit, a head is a block of ``in // num_heads`` input columns of the attention output
projection, a channel is a Conv2d output channel.
"""

from __future__ import annotations

import torch


def keep_count(n: int, dense_ratio: float) -> int:
    return max(1, min(n, int(round(n * dense_ratio))))


def top_mask(scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """A {0, 1} float mask of ``scores``' shape keeping exactly ``keep_count`` largest entries."""
    flat = scores.detach().reshape(-1).float()
    k = keep_count(flat.numel(), dense_ratio)
    order = torch.sort(flat, descending=True, stable=True).indices[:k]
    mask = torch.zeros_like(flat)
    mask[order] = 1.0
    return mask.view(scores.shape)


def straight_through(mask: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``mask`` in the forward pass, identity gradient to ``scores`` in the backward pass."""
    return mask + scores - scores.detach()


def row_scores(weight: torch.Tensor) -> torch.Tensor:
    """L1 norm of each output row (dim 0) over all other dims."""
    return weight.detach().float().abs().reshape(weight.shape[0], -1).sum(dim=1)


def head_scores(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """L1 norm of each head's block of input columns of an ``(out, in)`` projection."""
    out_features, in_features = weight.shape
    return weight.detach().float().abs().view(out_features, num_heads, in_features // num_heads).sum(dim=(0, 2))


def block_scores(scores: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Sum ``scores`` (2-D, or flattened to ``(out, -1)``) over ``rows x cols`` blocks."""
    rows, cols = block
    s = scores.reshape(scores.shape[0], -1)
    out_features, in_features = s.shape
    if out_features % rows or in_features % cols:
        raise ValueError(f"block pattern {rows}x{cols} does not tile a weight of shape {tuple(scores.shape)}")
    return s.view(out_features // rows, rows, in_features // cols, cols).sum(dim=(1, 3))


def expand_blocks(block_mask: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    rows, cols = block
    full = block_mask.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)
    return full.reshape(shape)
