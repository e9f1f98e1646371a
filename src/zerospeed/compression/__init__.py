"""Model compression: DeepSpeed's ``compression_training`` rebuilt so the result is really smaller.

* :func:`init_compression` wraps the configured modules for quantization-aware training and pruning
  (:mod:`.init`, :mod:`.layers`); the engine advances the schedule (:mod:`.scheduler`).
* :func:`redundancy_clean` turns the simulated compression into a physically smaller model
  (:mod:`.clean`): pruned units removed, weights packed in :class:`QuantizedLinear` (:mod:`.quantized`).
* :func:`quantize` is post-training quantization (:mod:`.ptq`); :func:`quantize_for_inference` applies
  ``init_inference``'s ``quant`` section (:mod:`.inference`).
* :func:`save_compressed` / :func:`load_compressed` store a cleaned model with safetensors (:mod:`.io`).
* :func:`distillation_loss` is the KD loss for layer reduction (:mod:`.distill`).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "init_compression": "zerospeed.compression.init",
    "compression_section": "zerospeed.compression.init",
    "CompressedLayer": "zerospeed.compression.layers",
    "CompressionScheduler": "zerospeed.compression.scheduler",
    "scheduler_of": "zerospeed.compression.scheduler",
    "distillation_loss": "zerospeed.compression.distill",
    "redundancy_clean": "zerospeed.compression.clean",
    "QuantizedLinear": "zerospeed.compression.quantized",
    "QuantizedEmbedding": "zerospeed.compression.quantized",
    "quantize": "zerospeed.compression.ptq",
    "quantize_for_inference": "zerospeed.compression.inference",
    "save_compressed": "zerospeed.compression.io",
    "load_compressed": "zerospeed.compression.io",
    "model_bytes": "zerospeed.compression.io",
}

__all__ = list(_LAZY)


def _lazy_name(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zerospeed.compression' has no attribute {name!r}")


from zerospeed._submodules import lazy_submodules as _lazy_submodules

__getattr__ = _lazy_submodules(__name__, _lazy_name)  # and zerospeed.compression.<submodule> (issue #27)
