"""``POST /v1/completions``: prompts (text or token ids), ``n`` / ``best_of``, ``echo`` and prompt
logprobs (scoring clients such as lm-eval), completion logprobs with ``text_offset``, streaming.

Split from :mod:`~zerospeed.inference.serving.app` (which parses the body and routes here); the
handlers object ``h`` gives the shared checks (model, prompt, context) and :meth:`run`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from zerospeed.inference.serving.generation import (Generation, coalesce, finite_logprob, fingerprint, sse,
                                                    sse_stream)
from zerospeed.inference.serving.protocol import CompletionRequest


async def completions(h: Any, request: Request, req: CompletionRequest) -> Response:
    """``POST /v1/completions`` for the handlers ``h`` (:class:`~zerospeed.inference.serving.app.Handlers`)."""
    req.check()
    h.check_model(req.model)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    prompt_lps = req.engine_prompt_logprobs()
    k = req.num_candidates()
    n = req.n or 1
    ranking = k > n  # best_of: the engine returns every chosen token's logprob to rank them
    params = req.sampling_params(max_tokens, req.logprobs if req.logprobs is not None
                                 else (0 if ranking else None), prompt_lps)
    prompts, echoes = [], []
    for p in req.prompts():
        ids = h.encode(p, "prompt") if isinstance(p, str) else list(p)
        h.check_prompt(ids, "prompt", scoring=max_tokens == 0)
        prompts.append(ids)
        echoes.append(p if isinstance(p, str) else h.s.tokenizer.decode(ids))
    for ids in prompts:
        h.check_fits(ids, max_tokens)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    gen = Generation(h.s.engine_loop, h.s.tokenizer, rid, prompts, params, "prompt", n=k)
    want_logprobs = req.logprobs is not None
    echo = bool(req.echo)
    base = {"id": rid, "object": "text_completion", "created": created,
            "model": h.s.model_name}

    def logprobs_of(token_ids: list[int], lps: list[float | None] | None,
                    top: list[dict[int, float] | None] | None,
                    offset: int = 0) -> dict[str, Any] | None:
        """OpenAI's completion logprobs; ``text_offset`` counts characters of the choice's
        text from ``offset`` (each token's decoded text in turn, as vLLM counts them)."""
        if not want_logprobs or lps is None:
            return None
        tokens = [h.s.tokenizer.token_text(t) for t in token_ids]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        tops: list[dict[str, float] | None] = []
        for i, (tok, x) in enumerate(zip(tokens, lps)):
            if x is None:  # the prompt's first token: nothing before it to score it
                tops.append(None)
                continue
            # the chosen token is always listed (so logprobs=0 gives it alone, and a client
            # checking "was this the argmax" finds it), plus the requested alternatives
            entries = {tok: finite_logprob(x)}
            entries.update(h.top_entries(top, i, req.logprobs))
            tops.append(entries)
        return {"tokens": tokens,
                "token_logprobs": [None if x is None else finite_logprob(x) for x in lps],
                "top_logprobs": tops, "text_offset": offsets}

    def echo_part(i: int, c: Any) -> tuple[str, dict[str, Any] | None]:
        """The echoed prompt of choice ``i``: its text and its logprobs (computed by the
        prompt's first choice; the forks share them)."""
        p = gen.prompt_of(i)
        first = gen.choices[p * k]
        lp = logprobs_of(prompts[p], first.prompt_logprobs or [None] * len(prompts[p]),
                         first.prompt_top_logprobs)
        return echoes[p], lp

    def joined(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
        if a is None or b is None:
            return a or b
        return {k: a[k] + b[k] for k in a}

    def prompt_logprobs_field(i: int, c: Any) -> list[Any] | None:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id:
        {logprob, rank, decoded_token}} with the prompt's token and the top alternatives (rank
        known for those only)."""
        p = gen.prompt_of(i)
        c = gen.choices[p * k]
        if req.prompt_logprobs is None or c.prompt_logprobs is None:
            return None
        out: list[Any] = [None]
        for j in range(1, len(prompts[p])):
            top = c.prompt_top_logprobs[j] or {}
            ranked = sorted(top.items(), key=lambda kv: -kv[1])[:req.prompt_logprobs]
            entry = {str(t): {"logprob": finite_logprob(v), "rank": r + 1,
                              "decoded_token": h.s.tokenizer.token_text(t)}
                     for r, (t, v) in enumerate(ranked)}
            tid = prompts[p][j]
            if str(tid) not in entry:
                entry = {str(tid): {"logprob": finite_logprob(c.prompt_logprobs[j]),
                                    "rank": None,
                                    "decoded_token": h.s.tokenizer.token_text(tid)},
                         **entry}
            out.append(entry)
        return out

    async def deltas(g: Generation) -> AsyncIterator[str]:
        started = [False] * len(g.choices)
        sent = [0] * len(g.choices)
        async for d in coalesce(g.events()):
            text = d.text
            lp = logprobs_of(d.token_ids, d.logprobs, d.top_logprobs, sent[d.index])
            extra: dict[str, Any] = {}
            if not started[d.index]:
                started[d.index] = True
                c = g.choices[d.index]
                if echo:
                    etext, elp = echo_part(d.index, c)
                    text = etext + text
                    lp = joined(elp, logprobs_of(d.token_ids, d.logprobs, d.top_logprobs,
                                                 len(etext)))
                if req.prompt_logprobs is not None:
                    extra["prompt_logprobs"] = prompt_logprobs_field(d.index, c)
            if lp and lp["tokens"]:  # offsets count token texts, as the full answer's do
                sent[d.index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            chunk = dict(base, **fingerprint(g), choices=[{
                "index": d.index, "text": text, "logprobs": lp,
                "finish_reason": d.finish_reason, **extra}])
            if req.include_usage():
                chunk["usage"] = None
            yield sse(chunk)

    def chunks(g: Generation) -> AsyncIterator[str]:
        return sse_stream(g, deltas(g), base, req.include_usage())

    def final(g: Generation) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(g.choices):
            text, lp = c.stream.text, logprobs_of(c.token_ids, c.logprobs, c.top_logprobs)
            if echo:
                etext, elp = echo_part(i, c)
                text = etext + text
                lp = joined(elp, logprobs_of(c.token_ids, c.logprobs, c.top_logprobs,
                                             len(etext)))
            choice = {"index": i, "text": text, "logprobs": lp,
                      "finish_reason": c.finish_reason}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_field(i, c)
            choices.append(choice)
        if ranking:  # best_of: each prompt's n best candidates by cumulative logprob
            kept = []
            for p in range(len(prompts)):
                group = list(range(p * k, (p + 1) * k))
                group.sort(key=lambda i: -sum(g.choices[i].logprobs))
                for r, i in enumerate(group[:n]):
                    choice = choices[i]
                    choice["index"] = p * n + r
                    if not want_logprobs:
                        choice["logprobs"] = None
                    kept.append(choice)
            choices = kept
        return dict(base, choices=choices, usage=g.usage())

    return await h.run(request, gen, bool(req.stream), chunks, final)
