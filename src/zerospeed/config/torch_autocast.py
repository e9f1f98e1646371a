"""``torch_autocast``: DeepSpeed's autocast-based mixed precision (keys as in DeepSpeed 0.19.8)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator

from .fields import Bool, Section

# DeepSpeed's DtypeEnum spellings of the two autocast dtypes
AutocastDType = Literal["bf16", "bfloat16", "torch.bfloat16", "fp16", "float16", "half", "torch.float16"]


def _names(value: object) -> object:
    if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
        raise ValueError(f"expected a list of 'package.Class' names, got {value!r}")
    return value


class TorchAutocastConfig(Section):
    """``enabled``; ``dtype`` (default: torch's autocast dtype for the device); and
    ``lower_precision_safe_modules``: in DeepSpeed, the modules whose gradients are reduced in the
    autocast dtype. zerospeed reduces every gradient in fp32 (exact, more bandwidth); the names are
    validated and kept (see zerospeed.runtime.precision_options)."""

    enabled: Bool = False
    dtype: AutocastDType | None = None
    lower_precision_safe_modules: Annotated[list[str] | None, BeforeValidator(_names)] = None
