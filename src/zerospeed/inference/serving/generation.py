"""One HTTP request's generation: its engine requests (one per prompt), the asyncio queue their
results arrive on, and the text, log-probabilities and finish reason of each choice.

The engine thread calls each request's sink; the sink moves the item onto this event loop with
``loop.call_soon_threadsafe``, so all the state here is touched by the event loop only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from zerospeed.inference.api import RequestError, RequestOutput, SamplingParams
from zerospeed.inference.serving.engine_loop import (
    ACCEPTED,
    EngineFailure,
    EngineLoop,
    QueueFull,
    ServerClosing,
)
from zerospeed.inference.serving.protocol import ApiError, http_field
from zerospeed.inference.serving.text import TextStream, TokenizerAdapter

RETRY_AFTER_S = 1


@dataclass
class Delta:
    """What one choice gained from one engine output."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None = None
    top_logprobs: list[dict[int, float]] | None = None


@dataclass
class _Choice:
    stream: TextStream
    accepted: bool = False
    finished: bool = False
    finish_reason: str | None = None
    num_generated: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    # the prompt's logprobs (SamplingParams.prompt_logprobs), once the engine sent them
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None


class GenerationFailed(Exception):
    """The engine failed this request after it had been accepted (500 or an error event)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Generation:
    """Submits ``prompts`` to the engine loop and yields :class:`Delta` objects as tokens come.

    ``n`` choices per prompt (choice ``i * n + j`` is prompt ``i``'s ``j``-th): choice ``j > 0`` is
    forked from choice ``j = 0`` in the engine (one prompt computation, shared KV blocks), and
    draws with ``seed + j`` when the request has a seed, so the choices differ and repeat."""

    def __init__(self, engine_loop: EngineLoop, tokenizer: TokenizerAdapter, request_id: str,
                 prompts: list[list[int]], params: SamplingParams, prompt_field: str,
                 n: int = 1) -> None:
        self._engine_loop = engine_loop
        self._prompt_field = prompt_field
        self._params = params
        self.request_id = request_id
        self.prompts = prompts
        self.n = n
        self.engine_ids = [f"{request_id}-{i}" for i in range(len(prompts) * n)]
        self.choices = [_Choice(TextStream(tokenizer, params.stop)) for _ in self.engine_ids]
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._submitted = 0
        self.weights_version: int | None = None  # the server's weights version of this request's outputs

    def prompt_of(self, index: int) -> int:
        """The prompt (index into ``prompts``) of choice ``index``."""
        return index // self.n

    def _entry(self, index: int) -> tuple[str, list[int], SamplingParams, Any, str | None]:
        j = index % self.n
        params, fork_of = self._params, None
        if j:
            seed = None if params.seed is None else (params.seed + j) % 2**63
            params = dataclasses.replace(params, seed=seed, prompt_logprobs=None)
            fork_of = self.engine_ids[index - j]
        return self.engine_ids[index], self.prompts[index // self.n], params, self._sink(index), fork_of

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_generated_tokens(self) -> int:
        return sum(c.num_generated for c in self.choices)

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)

    def _sink(self, index: int):
        loop = asyncio.get_running_loop()
        queue = self._queue

        def sink(item: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (index, item))

        return sink

    async def start(self) -> None:
        """Submit every prompt and wait until the engine accepted all of them; raises
        :class:`ApiError` (429 when the waiting queue is full, 400 when the engine refuses a
        request, 503 when the server is closing) after aborting whatever was submitted."""
        try:
            self._engine_loop.submit_group([self._entry(i) for i in range(len(self.choices))])
            self._submitted = len(self.choices)
        except QueueFull:
            self.abort()
            raise ApiError(429, "the server is at capacity (waiting queue full); retry later",
                           type_="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ServerClosing:
            self.abort()
            raise ApiError(503, "the server is shutting down", type_="server_error",
                           code="shutting_down") from None
        while not all(c.accepted or c.finished for c in self.choices):
            index, item = await self._queue.get()
            choice = self.choices[index]
            if item == ACCEPTED:
                choice.accepted = True
            elif isinstance(item, RequestError):
                choice.finished = True
                self.abort()
                field_name = http_field(item.field, self._prompt_field)
                raise ApiError(400, f"{field_name}: {item.message}", param=field_name)
            elif isinstance(item, (EngineFailure, ServerClosing)):
                choice.finished = True
                self.abort()
                if isinstance(item, ServerClosing):
                    raise ApiError(503, "the server is shutting down", type_="server_error",
                                   code="shutting_down")
                raise ApiError(500, item.message, type_="server_error", code="engine_error")
            else:  # an output racing ahead of nothing: keep it for events()
                self._queue.put_nowait((index, item))
                choice.accepted = True

    def abort(self) -> None:
        """Cancel every unfinished engine request of this generation (idempotent)."""
        for i in range(self._submitted):
            if not self.choices[i].finished:
                self.choices[i].finished = True
                self.choices[i].finish_reason = self.choices[i].finish_reason or "abort"
                self._engine_loop.abort(self.engine_ids[i])

    async def events(self) -> AsyncIterator[Delta]:
        """Deltas until every choice finished; raises :class:`GenerationFailed`."""
        while not self.done:
            index, item = await self._queue.get()
            choice = self.choices[index]
            if choice.finished:
                continue
            if isinstance(item, EngineFailure):
                self.abort()
                raise GenerationFailed(item.message)
            if not isinstance(item, RequestOutput):
                continue
            if item.error:
                choice.finished = True
                self.abort()
                raise GenerationFailed(f"the engine failed this request: {item.error}")
            yield self._apply(index, choice, item)

    def _apply(self, index: int, choice: _Choice, out: RequestOutput) -> Delta:
        ids = list(out.new_token_ids)
        self.weights_version = getattr(out, "weights_version", self.weights_version)
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = out.prompt_logprobs
            choice.prompt_top_logprobs = out.prompt_top_logprobs
        text = choice.stream.add(ids)
        choice.token_ids.extend(ids)
        logprobs = None
        if out.new_logprobs is not None:
            logprobs = [float(x) for x in out.new_logprobs]
            choice.logprobs.extend(logprobs)
        top = getattr(out, "new_top_logprobs", None)
        if top is not None:
            choice.top_logprobs.extend(top)
        choice.num_generated = max(out.num_generated_tokens, len(choice.token_ids))
        reason = None
        if choice.stream.stopped:
            reason = "stop"
            if not out.finished:  # the stop string showed up in text first: end it here
                self._engine_loop.abort(self.engine_ids[index])
        elif out.finished:
            text += choice.stream.finish()
            reason = out.finish_reason or "stop"
        if reason is not None:
            choice.finished = True
            choice.finish_reason = reason
        return Delta(index, text, ids, logprobs, reason, top)

    def usage(self) -> dict[str, int]:
        p, g = self.num_prompt_tokens, self.num_generated_tokens
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}


async def coalesce(deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """Deltas worth a streamed chunk (new text or a finish); the tokens and log-probabilities of
    the ones skipped (text held back) ride along with the next chunk of the same choice."""
    pending: dict[int, Delta] = {}
    async for d in deltas:
        p = pending.pop(d.index, None)
        if p is not None:
            d = Delta(d.index, p.text + d.text, p.token_ids + d.token_ids,
                      None if p.logprobs is None and d.logprobs is None
                      else (p.logprobs or []) + (d.logprobs or []),
                      d.finish_reason,
                      None if p.top_logprobs is None and d.top_logprobs is None
                      else (p.top_logprobs or []) + (d.top_logprobs or []))
        if d.text or d.finish_reason is not None:
            yield d
        else:
            pending[d.index] = d


def finite_logprob(x: float) -> float:
    """JSON has no -inf; clamp to a very unlikely value as OpenAI-compatible servers do."""
    return x if math.isfinite(x) else -9999.0


# -- server-sent events ------------------------------------------------------------------------------


def fingerprint(g: Generation) -> dict[str, str]:
    """``system_fingerprint`` of a response or stream chunk: the server's weights version that produced it
    (issue #32 weight sync), ``weights-vN``; empty before the engine reported one."""
    return {} if g.weights_version is None else {"system_fingerprint": f"weights-v{g.weights_version}"}


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


async def sse_stream(g: Generation, deltas: AsyncIterator[str], base: dict[str, Any],
                     include_usage: bool) -> AsyncIterator[str]:
    """An OpenAI event stream: the endpoint's chunks, then the usage chunk (when asked) and
    ``[DONE]``; a failed generation ends the stream with an error event and ``[DONE]``."""
    try:
        async for chunk in deltas:
            yield chunk
    except GenerationFailed as e:
        yield sse({"error": {"message": e.message, "type": "server_error", "param": None,
                             "code": "engine_error"}})
        yield sse("[DONE]")
        return
    finally:
        await deltas.aclose()  # a client that went away closes this stream: close the endpoint's too
    if include_usage:
        yield sse(dict(base, **fingerprint(g), choices=[], usage=g.usage()))
    yield sse("[DONE]")
