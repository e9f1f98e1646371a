"""Knowledge distillation loss for layer reduction and QAT with a teacher.

``distillation_loss(student_logits, teacher_logits, temperature=T, hard_loss=None, alpha=a)`` returns
``a * T^2 * KL(softmax(teacher/T) || softmax(student/T)) + (1 - a) * hard_loss`` (the soft term alone
when ``hard_loss`` is None).  The ``T^2`` factor keeps the soft-target gradients' scale independent of
``T`` (Hinton et al., 2015).  Logits of any shape ``(..., classes)`` are compared position by position
and averaged; the teacher side is detached.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
                      hard_loss: torch.Tensor | None = None, alpha: float = 1.0) -> torch.Tensor:
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"distillation_loss: student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ in shape")
    if temperature <= 0:
        raise ValueError(f"distillation_loss: temperature {temperature} must be > 0")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"distillation_loss: alpha {alpha} must be in [0, 1]")
    classes = student_logits.shape[-1]
    s = F.log_softmax(student_logits.float().reshape(-1, classes) / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.detach().float().reshape(-1, classes) / temperature, dim=-1)
    soft = F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2
    if hard_loss is None:
        return soft
    return alpha * soft + (1 - alpha) * hard_loss
