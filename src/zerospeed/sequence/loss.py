"""The loss of one sample split over a sequence-parallel group: each rank's mean over its real tokens, averaged
by the number of real tokens (labels other than -100), as DeepSpeed's ALST tutorial does, in both its forms.

* :func:`sp_loss_all_gather`: a differentiable all-gather of the per-rank losses and real-token counts, then
  ``sum(loss_r * tokens_r) / max(sum(tokens_r), 1)`` (the tutorial's main form);
* :func:`sp_loss_all_reduce`: one differentiable all-reduce of ``loss * tokens`` and one of ``tokens`` (the
  tutorial's "weighted all-reduce" workaround).

Both give every rank of the group the same value, the mean over the real tokens of the whole sample, and the
same gradients: rank ``r``'s local loss gets ``sp * tokens_r / total`` (the adjoint collective sums over the
group; see :mod:`zerospeed.comm.all_to_all`), which the engine's average over the dp x sp group turns back into
the single-process gradient. A rank whose shard has no real token contributes nothing (its loss may be NaN
from a mean over nothing: it is replaced by 0 before weighting, so it cannot poison the others).
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.comm.all_to_all import all_gather_with_grad, all_reduce_with_grad

__all__ = ["real_tokens", "sp_loss_all_gather", "sp_loss_all_reduce"]


def real_tokens(shift_labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The number of labels that count towards the loss (an int64 scalar tensor)."""
    return (shift_labels != ignore_index).sum()


def _finite_where_empty(loss: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.where(tokens > 0, loss, torch.zeros_like(loss))


def sp_loss_all_gather(loss: torch.Tensor, num_tokens: torch.Tensor, group: Any) -> torch.Tensor:
    """The group's token-weighted mean of the per-rank mean losses (differentiable all-gather form)."""
    tokens = num_tokens.to(loss.dtype)
    losses = all_gather_with_grad(_finite_where_empty(loss, tokens), group)
    counts = all_gather_with_grad(tokens, group)
    total = sum(l * c for l, c in zip(losses, counts))
    return total / torch.clamp(sum(counts), min=1)


def sp_loss_all_reduce(loss: torch.Tensor, num_tokens: torch.Tensor, group: Any) -> torch.Tensor:
    """The same value as :func:`sp_loss_all_gather`, with two all-reduces (the weighted all-reduce form)."""
    tokens = num_tokens.to(loss.dtype)
    weighted = all_reduce_with_grad(_finite_where_empty(loss, tokens) * tokens, group)
    total_tokens = all_reduce_with_grad(tokens.detach(), group)
    return weighted / torch.clamp(total_tokens, min=1)
