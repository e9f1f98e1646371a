"""zerospeed's inference engine: paged KV cache, ragged batching, Dynamic SplitFuse scheduling."""

from zerospeed.inference.api import EngineStats, RequestError, RequestOutput, SamplingParams

__all__ = ["EngineStats", "RequestError", "RequestOutput", "SamplingParams", "serve"]


def serve(*args, **kwargs):
    """Start the OpenAI-compatible HTTP server; see :func:`zerospeed.inference.serving.serve`
    (imported on call so that the engine does not pull in FastAPI)."""
    from zerospeed.inference.serving import serve as _serve

    return _serve(*args, **kwargs)
