"""zerospeed's inference engine: paged KV cache, ragged batching, Dynamic SplitFuse scheduling."""

from zerospeed.inference.api import EngineStats, RequestError, RequestOutput, SamplingParams

__all__ = ["EngineStats", "RequestError", "RequestOutput", "SamplingParams"]
