"""``zerospeed.runtime.zero.partition_parameters``: DeepSpeed's module of ``zero.Init`` and its companions (issue #27).

What other libraries import from ``deepspeed.runtime.zero.partition_parameters`` (transformers 5.24's
``integrations/deepspeed.py``, TRL's ``trainer/utils.py``), as views of zerospeed's own objects:

* ``Init``, ``GatheredParameters``, ``register_external_parameter``, ``unregister_external_parameter``,
  ``ZeroParamStatus``: the objects of :mod:`zerospeed.zero`, not copies.
* ``zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype, target_device)``: DeepSpeed's helper that wraps a
  torch tensor constructor so the tensor lands on ``target_device`` (when the call names no device) and floating
  tensors take ``target_fp_dtype``. DeepSpeed's ``zero.Init`` wraps torch's constructors with it; zerospeed's
  ``zero.Init`` partitions each module after its constructor returns and never replaces torch's functions, so the
  helper is not on zerospeed's path. It is here, built to DeepSpeed's semantics, because transformers' context
  ``prevent_arange_dtype_change`` reads it and swaps it for the duration of ``from_pretrained``: under zerospeed
  that swap is harmless, and RoPE's ``torch.arange`` buffers keep their dtype either way.
* ``_orig_torch_arange`` (and DeepSpeed's other ``_orig_torch_*`` names): torch's constructors, which zerospeed never
  replaces, so they are simply torch's functions.
* ``get_accelerator``: :func:`zerospeed.accelerator.get_accelerator`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from zerospeed.accelerator import get_accelerator
from zerospeed.zero import GatheredParameters, Init, register_external_parameter, unregister_external_parameter

_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype | None,
                                           target_device: Any = None) -> Callable[..., torch.Tensor]:
    """``fn`` (a torch tensor constructor) returning its tensor on ``target_device`` unless the call passes a
    ``device``, and cast to ``target_fp_dtype`` when floating-point (``None``: no cast, no device)."""

    def constructed(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point() and tensor.dtype != target_fp_dtype:
            tensor.data = tensor.data.to(target_fp_dtype)  # keep the object (a Parameter stays one)
        return tensor

    return constructed


def __getattr__(name: str) -> Any:
    if name == "ZeroParamStatus":  # the ds_status values of stage-3 parameters, loaded with them
        import zerospeed.zero

        return zerospeed.zero.ZeroParamStatus
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "get_accelerator", "register_external_parameter",
           "unregister_external_parameter", "zero_wrapper_for_fp_tensor_constructor"]
