"""The FastAPI application: OpenAI's completions (serving/completions.py), chat completions
(serving/chat.py) and models endpoints, vLLM's ``/tokenize``, ``/detokenize`` and
``/tokenizer_info``, plus ``/health`` and ``/metrics``.

Decisions:

* Handlers never touch the engine: they build a :class:`Generation`, which submits to the engine
  thread and reads results from an asyncio queue.
* Every error is an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``; request
  validation (pydantic or ours) is a 400 naming the field, never FastAPI's 422; a prompt that does
  not fit the context is a 400 naming ``prompt``/``messages`` or ``max_tokens``. An unexpected
  exception in a handler is a 500 for that request only.
* Streaming is server-sent events: one ``data: {chunk}`` per engine output that produced text,
  a chunk with the ``finish_reason``, a usage chunk when ``stream_options.include_usage``, then
  ``data: [DONE]``. :class:`EventStream` watches for the client's disconnect while it streams and
  aborts the request's engine work as soon as the stream ends for any reason, so the KV blocks are
  freed before the next step. Non-streaming handlers watch for a disconnect too.
* ``--api-key`` protects ``/v1/*`` (``Authorization: Bearer KEY``, constant-time comparison);
  ``/health`` and ``/metrics`` stay open for probes and scrapers, as in vLLM.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from zerospeed.inference.serving.chat import chat as chat_endpoint
from zerospeed.inference.serving.chat_template import ChatTemplate, require
from zerospeed.inference.serving.completions import completions as completions_endpoint
from zerospeed.inference.serving.engine_loop import EngineLoop
from zerospeed.inference.serving.generation import Generation, GenerationFailed, finite_logprob, fingerprint
from zerospeed.inference.serving.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
)
from zerospeed.inference.serving.text import TokenizerAdapter

log = logging.getLogger("zerospeed.serve")


@dataclass
class ServerState:
    """What the handlers need; built once by :func:`zerospeed.inference.serving.server.serve`."""

    engine_loop: EngineLoop
    tokenizer: TokenizerAdapter
    chat_template: ChatTemplate | None
    model_name: str
    max_model_len: int
    api_key: str | None
    created: int
    tokenizer_info: dict[str, Any] | None = None


# -- responses ---------------------------------------------------------------------------------------


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class EventStream(Response):
    """``text/event-stream`` from an async iterator of strings; calls ``on_close`` when the stream
    ends, whether it finished, the client went away, or the server cancelled it."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[str], on_close: Callable[[], None],
                 on_disconnect: Callable[[], None] = lambda: None) -> None:
        self._chunks = chunks
        self._on_close = on_close
        self._on_disconnect = on_disconnect
        self._gone = False
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _went_away(self) -> None:
        if not self._gone:  # counted once, whichever side noticed first
            self._gone = True
            self._on_disconnect()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        complete = False
        try:
            async with anyio.create_task_group() as tg:

                async def watch_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    if not complete:
                        self._went_away()
                    tg.cancel_scope.cancel()

                tg.start_soon(watch_disconnect)
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                async for chunk in self._chunks:
                    await send({"type": "http.response.body", "body": chunk.encode(),
                                "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                complete = True
                tg.cancel_scope.cancel()
        except OSError:  # the client went away between two writes: quiet, counted
            if not complete:
                self._went_away()
        except BaseExceptionGroup as group:  # the same, seen through the task group
            if not all(isinstance(e, OSError) for e in group.exceptions):
                raise
            if not complete:
                self._went_away()
        finally:
            self._on_close()
            with anyio.CancelScope(shield=True):
                aclose = getattr(self._chunks, "aclose", None)
                if aclose is not None:
                    await aclose()


# -- request parsing ---------------------------------------------------------------------------------


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[int]", "list[str]", "list[list[int]]") or "[" in str(part):
            continue  # union member names pydantic adds to the location
        else:
            out += f".{part}" if out else str(part)
    return out or "body"


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"body: invalid JSON ({e})", param="body") from None
    if not isinstance(data, dict):
        raise ApiError(400, "body: expected a JSON object", param="body")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        field = _loc(tuple(first["loc"]))
        raise bad_request(field, first["msg"]) from None


class Handlers:
    """Endpoint implementations over a :class:`ServerState`."""

    def __init__(self, state: ServerState) -> None:
        self.s = state

    # -- shared ----------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.s.model_name:
            raise ApiError(404, f"model: {model!r} does not exist; this server serves "
                           f"{self.s.model_name!r}", param="model", code="model_not_found")

    def check_prompt(self, ids: list[int], field: str, scoring: bool = False) -> None:
        """``scoring``: nothing is generated (``max_tokens=0``), so the prompt may fill the
        context."""
        if not ids:
            raise bad_request(field, "is empty (no tokens)")
        if any(not isinstance(t, int) or t < 0 for t in ids):
            raise bad_request(field, "token ids must be non-negative integers")
        if len(ids) > self.s.max_model_len or (len(ids) == self.s.max_model_len and not scoring):
            raise ApiError(400, f"{field}: {len(ids)} tokens leave no room to generate in the "
                           f"context of {self.s.max_model_len} tokens", param=field,
                           code="context_length_exceeded")

    def encode(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        if not self.s.tokenizer.available:
            raise bad_request(field, "this model folder has no tokenizer; send token ids")
        return self.s.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def top_entries(self, top: list[dict[int, float]] | None, i: int,
                    limit: int | None = None) -> dict[str, float]:
        """Token text -> logprob of position ``i``'s alternatives (the best ``limit``)."""
        if not top or i >= len(top) or not top[i]:
            return {}
        out: dict[str, float] = {}
        items = sorted(top[i].items(), key=lambda kv: -kv[1])[:limit]
        for t, lp in items:  # tokens with the same text (partial UTF-8) keep the best
            key, value = self.s.tokenizer.token_text(t), finite_logprob(lp)
            out[key] = max(value, out.get(key, value))
        return out

    def check_fits(self, ids: list[int], max_tokens: int) -> None:
        if len(ids) + max_tokens > self.s.max_model_len:
            raise ApiError(400, f"max_tokens: the prompt ({len(ids)} tokens) plus max_tokens "
                           f"({max_tokens}) exceed the context of {self.s.max_model_len} tokens",
                           param="max_tokens", code="context_length_exceeded")

    async def run(self, request: Request, gen: Generation, stream: bool,
                  chunks: Callable[[Generation], AsyncIterator[str]],
                  final: Callable[[Generation], dict[str, Any]]) -> Response:
        await gen.start()
        if stream:
            return EventStream(chunks(gen), on_close=gen.abort,
                               on_disconnect=self.s.engine_loop.metrics.disconnects.inc)
        try:
            collected = asyncio.ensure_future(self._collect(gen))
            disconnected = asyncio.ensure_future(_wait_disconnect(request))
            done, _ = await asyncio.wait({collected, disconnected},
                                         return_when=asyncio.FIRST_COMPLETED)
            if collected not in done:
                collected.cancel()
                self.s.engine_loop.metrics.disconnects.inc()
                return Response(status_code=499)  # nobody reads it
            disconnected.cancel()
            collected.result()
        except GenerationFailed as e:
            raise ApiError(500, e.message, type_="server_error", code="engine_error") from None
        finally:
            gen.abort()
        body = final(gen)
        body.update(fingerprint(gen))  # which weights produced it (issue #32 weight sync): OpenAI's field
        return JSONResponse(body)

    @staticmethod
    async def _collect(gen: Generation) -> None:
        async for _ in gen.events():
            pass

    async def completions(self, request: Request) -> Response:
        return await completions_endpoint(self, request, await parse_body(request, CompletionRequest))

    async def chat(self, request: Request) -> Response:
        return await chat_endpoint(self, request, await parse_body(request, ChatCompletionRequest))

async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(state: ServerState) -> FastAPI:
    """The ASGI application for one engine."""
    app = FastAPI(title="zerospeed", docs_url=None, redoc_url=None, openapi_url=None)
    handlers = Handlers(state)

    def counted(err: ApiError) -> JSONResponse:
        if 400 <= err.status < 500:  # every client error, validation included, by status
            state.engine_loop.metrics.rejected.labels(str(err.status)).inc()
        return error_response(err)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, err: ApiError) -> JSONResponse:
        return counted(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        # unknown routes and methods: OpenAI's body, not FastAPI's {"detail": ...}
        if err.status_code == 404:
            msg, code = f"{request.url.path}: no such route", "not_found"
        elif err.status_code == 405:
            msg, code = f"{request.method} {request.url.path}: method not allowed", "method_not_allowed"
        else:
            msg, code = str(err.detail), None
        return counted(ApiError(err.status_code, msg, type_="invalid_request_error", code=code,
                                headers=dict(err.headers or {})))

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, err: ClientDisconnect) -> Response:
        # the client left before its body was read (or while it was): nothing to answer, no
        # traceback; counted with the other disconnects
        state.engine_loop.metrics.disconnects.inc()
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, err: Exception) -> JSONResponse:
        log.exception("request failed")
        return error_response(ApiError(500, f"internal error: {type(err).__name__}: {err}",
                                       type_="server_error"))

    def check_key(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 state.api_key.encode()):
            raise ApiError(401, "api key: missing or incorrect (send 'Authorization: Bearer KEY')",
                           type_="authentication_error", code="invalid_api_key")

    auth = [Depends(check_key)]

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        return await handlers.completions(request)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(request: Request) -> Response:
        return await handlers.chat(request)

    def model_card() -> dict[str, Any]:
        return {"id": state.model_name, "object": "model", "created": state.created,
                "owned_by": "zerospeed", "max_model_len": state.max_model_len}

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(model_id: str) -> dict[str, Any]:
        handlers.check_model(model_id)
        return model_card()

    # vLLM's tokenizer endpoints (lm-eval's remote tokenizer mode uses all three)
    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> dict[str, Any]:
        req: TokenizeRequest = await parse_body(request, TokenizeRequest)
        handlers.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("prompt", "send exactly one of prompt or messages")
        if req.messages is not None:
            template = require(state.chat_template)
            chat = ChatCompletionRequest(messages=req.messages)
            text = template.render(chat.template_messages(), req.add_generation_prompt)
            add = req.add_special_tokens if req.add_special_tokens is not None \
                else not template.adds_bos
            ids = handlers.encode(text, "messages", add_special_tokens=add)
        else:
            ids = handlers.encode(req.prompt, "prompt", add_special_tokens=req.add_special_tokens
                                  is not False)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_model_len,
                               "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [state.tokenizer.token_text(t) for t in ids]
        return out

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> dict[str, Any]:
        req: DetokenizeRequest = await parse_body(request, DetokenizeRequest)
        handlers.check_model(req.model)
        if any(t < 0 for t in req.tokens):
            raise bad_request("tokens", "token ids must be non-negative integers")
        if not state.tokenizer.available:
            raise bad_request("tokens", "this model folder has no tokenizer")
        try:
            return {"prompt": state.tokenizer.decode(req.tokens)}
        except Exception as e:  # noqa: BLE001 - ids the tokenizer does not know
            raise bad_request("tokens", f"cannot be decoded ({e})") from None

    @app.get("/tokenizer_info", dependencies=auth)
    async def get_tokenizer_info() -> dict[str, Any]:
        if state.tokenizer_info is None:
            raise ApiError(404, "tokenizer_info: this server has no tokenizer information",
                           code="not_found")
        return state.tokenizer_info

    @app.get("/health")
    async def health() -> Response:
        if not state.engine_loop.is_alive():
            return error_response(ApiError(503, "the engine thread is not running",
                                           type_="server_error"))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.engine_loop.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
