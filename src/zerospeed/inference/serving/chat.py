"""``POST /v1/chat/completions``: the chat template, ``n``, chat logprobs (with each token's own
bytes), tools (:mod:`~zerospeed.inference.serving.tools`), streaming with the role sent with the
first token.

Split from :mod:`~zerospeed.inference.serving.app` (which parses the body and routes here).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from zerospeed.inference.constraints import grammar_for, validation_error
from zerospeed.inference.serving.chat_template import require
from zerospeed.inference.serving.generation import (Generation, coalesce, finite_logprob, fingerprint, sse,
                                                    sse_stream)
from zerospeed.inference.serving.protocol import ApiError, ChatCompletionRequest, bad_request
from zerospeed.inference.serving.tools import call_schema, check_messages, parse_calls, plan_tools


async def chat(h: Any, request: Request, req: ChatCompletionRequest) -> Response:
    """``POST /v1/chat/completions`` for the handlers ``h`` (:class:`~zerospeed.inference.serving.app.Handlers`)."""
    req.check()
    h.check_model(req.model)
    template = require(h.s.chat_template)
    plan = plan_tools(req.tools, req.tool_choice)
    messages = req.template_messages()
    check_messages(messages)
    text = template.render(messages, tools=plan.tools or None)
    ids = h.encode(text, "messages", add_special_tokens=not template.adds_bos)
    h.check_prompt(ids, "messages")
    requested = req.requested_max_tokens()
    max_tokens = h.s.max_model_len - len(ids) if requested is None else requested
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    try:
        params = req.sampling_params(max_tokens, req.engine_logprobs())
        h.check_fits(ids, max_tokens)
        schema = call_schema(plan)
        if schema is not None:  # "required" / a named function: the call always parses
            if params.guide is not None:
                raise bad_request("tool_choice", "cannot be combined with structured output")
            try:
                grammar = grammar_for("json_schema", schema)
                problem = validation_error(grammar)
            except (ValueError, TypeError) as e:
                problem = str(e)
            if problem:
                raise bad_request("tools", f"a parameters schema is invalid: {problem}")
            params = dataclasses.replace(params, guide=grammar)
    except ApiError as e:
        if e.param == "max_tokens" and field != "max_tokens":
            raise ApiError(400, f"{field}: {e.message.split(': ', 1)[1]}", param=field,
                           code=e.code) from None
        raise
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    gen = Generation(h.s.engine_loop, h.s.tokenizer, rid, [ids], params, "messages",
                     n=req.n or 1)
    base = {"id": rid, "object": "chat.completion.chunk", "created": created,
            "model": h.s.model_name}

    def logprobs_of(token_ids: list[int], lps: list[float] | None,
                    top: list[dict[int, float]] | None) -> dict[str, Any] | None:
        if not req.logprobs or lps is None:
            return None
        content = []
        tk = h.s.tokenizer
        for i, (t, lp) in enumerate(zip(token_ids, lps)):
            alts = [{"token": tk.token_text(a), "logprob": finite_logprob(v),
                     "bytes": tk.token_bytes(a)}
                    for a, v in sorted((top[i] if top and i < len(top) and top[i] else {}).items(),
                                       key=lambda kv: -kv[1])]
            content.append({"token": tk.token_text(t), "logprob": finite_logprob(lp),
                            "bytes": tk.token_bytes(t), "top_logprobs": alts})
        return {"content": content}

    def chunks(g: Generation) -> AsyncIterator[str]:
        def chunk(index: int, delta: dict[str, Any], finish: str | None,
                  lp: Any = None) -> str:
            c = dict(base, **fingerprint(g), choices=[{"index": index, "delta": delta, "logprobs": lp,
                                     "finish_reason": finish}])
            if req.include_usage():
                c["usage"] = None
            return sse(c)

        async def tool_deltas() -> AsyncIterator[str]:
            # with tools, a reply is sent when complete: its calls cannot be told from text
            # before (see serving/tools.py)
            async for d in coalesce(g.events()):
                if d.finish_reason is None:
                    continue
                c = g.choices[d.index]
                message, finish = reply(c)
                delta = {"role": "assistant", "content": message["content"]}
                if "tool_calls" in message:
                    delta["tool_calls"] = [dict(call, index=j)
                                           for j, call in enumerate(message["tool_calls"])]
                yield chunk(d.index, delta, None,
                            logprobs_of(c.token_ids, c.logprobs, c.top_logprobs))
                yield chunk(d.index, {}, finish)

        async def deltas() -> AsyncIterator[str]:
            # the role goes with each choice's first token (as vLLM sends it), so a client's
            # time to first chunk is its time to first token, not the time to admission
            started = [False] * len(g.choices)
            async for d in coalesce(g.events()):
                delta: dict[str, Any] = {}
                if not started[d.index]:
                    started[d.index] = True
                    delta["role"] = "assistant"
                if d.text or d.logprobs or delta:
                    delta["content"] = d.text
                    yield chunk(d.index, delta, None,
                                logprobs_of(d.token_ids, d.logprobs, d.top_logprobs))
                if d.finish_reason is not None:
                    yield chunk(d.index, {}, d.finish_reason)

        return sse_stream(g, tool_deltas() if plan.active else deltas(), base,
                          req.include_usage())

    def reply(c: Any) -> tuple[dict[str, Any], str | None]:
        """One choice's message and finish reason (tool calls parsed when tools are on)."""
        if not plan.active:
            return {"role": "assistant", "content": c.stream.text}, c.finish_reason
        content, calls = parse_calls(c.stream.text, plan)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
            return message, "tool_calls"
        return message, c.finish_reason

    def final(g: Generation) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(g.choices):
            message, finish = reply(c)
            choices.append({"index": i, "message": message, "finish_reason": finish,
                            "logprobs": logprobs_of(c.token_ids, c.logprobs, c.top_logprobs)})
        return {"id": rid, "object": "chat.completion", "created": created,
                "model": h.s.model_name, "choices": choices, "usage": g.usage()}

    return await h.run(request, gen, bool(req.stream), chunks, final)
