"""zerospeed's inference engine: paged KV cache, ragged batching, Dynamic SplitFuse scheduling.

Heavy parts load on first use: ``build_engine`` (the engine behind the server), ``pipeline``
(MII-style), ``build_hf_engine`` (DeepSpeed v2 style put/flush/query), ``init_inference`` (v1).
"""

from __future__ import annotations

import importlib
from typing import Any

from zerospeed.inference.api import EngineStats, RequestError, RequestOutput, SamplingParams

_LAZY = {
    "build_engine": ("zerospeed.inference.build", "build_engine"),
    "InferenceEngine": ("zerospeed.inference.engine", "InferenceEngine"),
    "ModelLoadError": ("zerospeed.inference.models.spec", "ModelLoadError"),
    "pipeline": ("zerospeed.inference.highlevel", "pipeline"),
    "Pipeline": ("zerospeed.inference.highlevel", "Pipeline"),
    "build_hf_engine": ("zerospeed.inference.v2", "build_hf_engine"),
    "RaggedInferenceEngineConfig": ("zerospeed.inference.v2", "RaggedInferenceEngineConfig"),
    "init_inference": ("zerospeed.inference.v1", "init_inference"),
}

__all__ = ["EngineStats", "RequestError", "RequestOutput", "SamplingParams", "serve", *_LAZY]


def serve(*args, **kwargs):
    """Start the OpenAI-compatible HTTP server; see :func:`zerospeed.inference.serving.serve`
    (imported on call so that the engine does not pull in FastAPI)."""
    from zerospeed.inference.serving import serve as _serve

    return _serve(*args, **kwargs)


def _lazy_name(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'zerospeed.inference' has no attribute {name!r}")


from zerospeed._submodules import lazy_submodules as _lazy_submodules

__getattr__ = _lazy_submodules(__name__, _lazy_name)  # and zerospeed.inference.<submodule> (issue #27)
