"""Cast a model to the engine's 16-bit compute dtype: parameters, not the buffers meant to stay fp32.

``model.to(bf16)`` (what DeepSpeed does) also casts every floating buffer, e.g. RoPE's ``inv_freq``,
which HuggingFace computes and keeps in fp32 even in a bf16 model; the rotary angles then lose
precision and the logits drift away from HF's own bf16 model. Decision: cast every floating
parameter and every *persistent* floating buffer (they are model state, saved in the state dict,
like BatchNorm's running statistics); leave *non-persistent* buffers (derived tables the module
computes itself: rotary frequencies, position ids, masks) in the dtype their module chose. This is
what ``from_pretrained(..., dtype=torch.bfloat16)`` produces for HF models.
"""

from __future__ import annotations

import torch
from torch import nn


def cast_to_compute_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``model``'s floating parameters and persistent floating buffers to ``dtype`` in place."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
                if p.grad is not None:
                    p.grad = p.grad.to(dtype)
        for module in model.modules():
            skip = getattr(module, "_non_persistent_buffers_set", set())
            for name, buf in list(module._buffers.items()):
                if buf is None or name in skip or not buf.is_floating_point() or buf.dtype == dtype:
                    continue
                module._buffers[name] = buf.to(dtype)


__all__ = ["cast_to_compute_dtype"]
