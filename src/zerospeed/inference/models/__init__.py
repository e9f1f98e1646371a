"""Our own implementations of the supported model families, loaded from an HF model folder.

``load_model(model_dir, dtype, device, max_positions, tp)`` reads ``config.json`` into a
:class:`~zerospeed.inference.models.spec.ModelSpec`, builds the family's module on the meta device
(no initialisation cost), materialises it on ``device`` in ``dtype`` and fills it from the folder's
safetensors (see :mod:`zerospeed.inference.models.loader`).
"""

from __future__ import annotations

import importlib

import torch

from zerospeed.inference.models.layers import CausalLM, RotaryTable, RowLinear, TPInfo
from zerospeed.inference.models.loader import TensorReader
from zerospeed.inference.models.spec import ARCHITECTURES, ModelLoadError, ModelSpec, load_spec, spec_from_config

_CLASSES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM",
            "mixtral": "MixtralForCausalLM"}

__all__ = ["ARCHITECTURES", "CausalLM", "ModelLoadError", "ModelSpec", "TPInfo", "build_model", "load_model",
           "load_spec", "model_from_hf", "spec_from_config"]


def build_model(spec: ModelSpec, max_positions: int, dtype: torch.dtype, device: torch.device | str,
                tp: TPInfo = TPInfo()) -> CausalLM:
    """An uninitialised model of ``spec``'s family (weights are whatever memory held)."""
    family = importlib.import_module(f"zerospeed.inference.models.{spec.family}")
    with torch.device("meta"):
        model = getattr(family, _CLASSES[spec.family])(spec, max_positions, tp)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    for m in model.modules():
        if isinstance(m, RotaryTable):
            m.fill(device)
    return model.eval().requires_grad_(False)


def prefer_cpu_matmul_layout(model: CausalLM) -> None:
    """On CPU in float32, store each block's linear weight ``[out, in]`` transposed in memory (same
    shape and values, strides ``(1, out)``): ``F.linear`` then hands MKL a contiguous ``[in, out]``
    matrix, which it multiplies faster. Measured (one thread, the bench model's 4 layers of QKV, O,
    gate/up and down after a 32 MB stream, as in a decode step): 16 rows 1.67 -> 1.30 ms, 32 rows
    2.54 -> 1.91, 8 rows 1.12 -> 0.96, 1 row 0.66 -> 0.57. No extra memory. The LM head is left
    alone (tied to the embedding in some families; it has its own copies, see ``CausalLM``)."""
    for m in model.modules():
        if m is model.lm_head or not isinstance(m, (torch.nn.Linear, RowLinear)):
            continue
        w = m.weight
        if w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2 and w.is_contiguous():
            with torch.no_grad():
                w.data = w.data.t().contiguous().t()


def load_model(model_dir: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               max_positions: int | None = None, tp: TPInfo = TPInfo()) -> tuple[CausalLM, ModelSpec]:
    spec = load_spec(model_dir)
    reader = TensorReader(model_dir, dtype, device)  # reads the index/header first: bad folders fail fast
    model = build_model(spec, max_positions or spec.max_position_embeddings, dtype, device, tp)
    family = importlib.import_module(f"zerospeed.inference.models.{spec.family}")
    family.load_weights(model, reader)
    reader.finish(model)
    prefer_cpu_matmul_layout(model)
    return model, spec


def model_from_hf(hf_model: torch.nn.Module, dtype: torch.dtype, device: torch.device | str,
                  max_positions: int | None = None, tp: TPInfo = TPInfo()) -> tuple[CausalLM, ModelSpec]:
    """Our implementation of an in-memory HF model, weights copied (``init_inference`` kernel injection)."""
    spec = spec_from_config(hf_model.config.to_dict(), f"{type(hf_model).__name__}.config")
    reader = TensorReader(f"<{type(hf_model).__name__}>", dtype, device, state_dict=hf_model.state_dict())
    model = build_model(spec, max_positions or spec.max_position_embeddings, dtype, device, tp)
    family = importlib.import_module(f"zerospeed.inference.models.{spec.family}")
    family.load_weights(model, reader)
    reader.finish(model)
    prefer_cpu_matmul_layout(model)
    return model, spec
