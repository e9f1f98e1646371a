"""The contract between the inference engine and everything that drives it (pipeline(), the HTTP
server, benchmarks): request parameters, per-step outputs and engine statistics.

Only plain data lives here, so the server and the engine can be built and tested apart.

The engine (``zerospeed.inference.engine.InferenceEngine``) offers, on the rank that schedules:

* ``add_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None``;
  raises :class:`RequestError` naming the bad field (empty prompt, prompt longer than the context,
  ``max_new_tokens`` that cannot fit, invalid sampling values, duplicate id) and changes nothing.
* ``abort(request_id: str) -> bool``: cancels a waiting or running request and frees its KV blocks
  at once; True when the id was known.
* ``step() -> list[RequestOutput]``: one ragged forward (decodes first, prompt chunks fill the token
  budget), then sampling; one output per request that produced a token or finished in this step.
* ``has_unfinished() -> bool`` and ``stats() -> EngineStats``.
* ``tokenizer`` (a ``tokenizers.Tokenizer``-backed object with ``encode``/``decode``),
  ``eos_token_ids``, ``max_model_len`` and ``model_name``.

``step()`` is not thread-safe: one thread owns the engine and calls it in a loop; other threads hand
it work through a queue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


class RequestError(ValueError):
    """A request the engine refuses; ``field`` names the offending request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # picklable (issue #27)
        return type(self), (self.field, self.message)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (HF / MII names). Greedy unless ``do_sample``; a
    ``temperature`` of 0 is greedy too. ``seed`` makes sampling reproducible whatever else runs in
    the same batch. ``stop`` strings end generation (the stop string is not returned);
    ``stop_token_ids`` likewise, and EOS unless ``ignore_eos``. ``logprobs``: how many top
    alternatives to return per generated token (None: none, 0: only the chosen token's).
    ``prompt_logprobs``: the same for the prompt's tokens (the first has none); with it,
    ``max_new_tokens`` may be 0 (score the prompt, generate nothing)."""

    max_new_tokens: int = 256
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # structured output: a grammar in llguidance's format (zerospeed.inference.constraints.grammar_for);
    # only tokens it allows are sampled, and the sequence stops ("stop") when the grammar is complete
    guide: str | None = None


@dataclass
class RequestOutput:
    """What one ``step()`` produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    new_logprobs: list[float] | None = None
    error: str | None = None  # set when the request failed inside the engine (it is then finished)
    # the stop string or stop token id that ended the request (finish_reason "stop"); the token ids
    # include the stopping token (as HF generate does), text consumers cut at the stop string
    stop_reason: str | int | None = None
    new_top_logprobs: list[dict[int, float]] | None = None  # per new token, when logprobs > 0
    # with SamplingParams.prompt_logprobs, once, in the request's first output: one entry per prompt
    # token (None for the first), and the top alternatives per prompt token (None for the first)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    # the server's weights version that produced this output (set by the serving loop; issue #32 weight sync)
    weights_version: int | None = None


@dataclass
class EngineStats:
    """A snapshot for /metrics and for tests that check that every block came back."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks_total: int = 0
    num_blocks_free: int = 0
    block_size: int = 0
    kv_cache_bytes: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    num_preemptions: int = 0
    extra: dict[str, float] = field(default_factory=dict)


# Construction (implemented in zerospeed.inference.engine; listed here so the server can rely on it):
#
#   build_engine(model_dir: str, *, dtype="fp32", block_size=16, num_blocks=None,
#                kv_cache_memory=None, max_num_seqs=256, max_model_len=None,
#                max_num_batched_tokens=512, tensor_parallel=1, max_prefill_tokens_with_decodes=16,
#                attention_backend="auto", prefill_first=True) -> InferenceEngine
#
# With tensor_parallel > 1 it is called on every rank of a torchrun world: rank 0 gets the engine
# to drive; on the other ranks the caller runs ``engine.run_worker_loop()``, which follows rank 0's
# broadcast batches and returns when rank 0 calls ``engine.shutdown()``.
