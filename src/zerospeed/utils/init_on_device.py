"""DeepSpeed's ``OnDevice`` (``deepspeed.OnDevice``, ``deepspeed.utils.init_on_device``): build a model's tensors on a
given device (``"meta"`` for a model with no storage, to be loaded or materialised later) and floating dtype.

DeepSpeed replaces ``torch.empty`` / ``zeros`` / ``ones`` / ``full`` and ``Tensor.__new__`` for the block. zerospeed
patches nothing (DESIGN.md): the block runs under torch's own default-device context (``with torch.device(...)``) and
torch's default floating dtype (``torch.set_default_dtype``), both restored on exit. So every tensor created without
an explicit ``device=`` lands on ``device``, and every floating tensor created without an explicit ``dtype=`` has
``dtype``, which is what module constructors do. One difference: a constructor that names its floating dtype
explicitly keeps it (DeepSpeed casts it to ``dtype`` as well).
"""

from __future__ import annotations

from typing import Any

import torch


class OnDevice:
    """``with OnDevice(dtype=torch.float16, device="meta"): model = MyModel()``; ``enabled=False`` does nothing."""

    def __init__(self, dtype: torch.dtype | None, device: str | torch.device = "meta", enabled: bool = True) -> None:
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ValueError(f"OnDevice: dtype must be a floating torch.dtype (torch.float16, torch.bfloat16, "
                             f"torch.float32...), got {dtype!r}")
        self.dtype = dtype
        self.device = torch.device(device)  # an unknown device string raises here, naming it
        self.enabled = enabled
        self._device_ctx: Any = None
        self._saved_dtype: torch.dtype | None = None

    def __enter__(self) -> "OnDevice":
        if not self.enabled:
            return self
        self._device_ctx = torch.device(self.device)
        self._device_ctx.__enter__()
        if self.dtype is not None:
            self._saved_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled or self._device_ctx is None:
            return
        if self._saved_dtype is not None:
            torch.set_default_dtype(self._saved_dtype)
            self._saved_dtype = None
        ctx, self._device_ctx = self._device_ctx, None
        ctx.__exit__(*exc)


__all__ = ["OnDevice"]
