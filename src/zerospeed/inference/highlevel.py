"""MII-style high-level API: ``pipe = zerospeed.inference.pipeline(path)`` then
``pipe(prompts, max_new_tokens=..., ...)`` -> one :class:`Response` per prompt.

Prompts are strings (tokenized with the folder's tokenizer) or lists of token ids; a single string
or a single id list is one prompt. All prompts run together through the continuous-batching
engine. ``generated_tokens`` are the ids as generated (a stopping EOS / stop token included, as HF
``generate`` returns them); ``generated_text`` is their text without special tokens, cut before a
stop string or a stop token.

Streaming: pass ``streaming_fn`` (called with a :class:`StreamChunk` per new token of any prompt)
or iterate ``pipe.stream(prompts, ...)``. An invalid request raises
:class:`~zerospeed.inference.api.RequestError` before anything runs (``pipe`` checks all prompts
first, so one bad prompt does not leave others half-run).

With ``tensor_parallel > 1`` under torchrun, every rank calls ``pipeline(...)``; rank 0 gets the
pipe, the other ranks serve rank 0's forwards inside this call and get ``None`` once rank 0 calls
``pipe.shutdown()`` (or exits).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from zerospeed.inference.api import RequestError, SamplingParams


@dataclass
class Response:
    generated_text: str
    generated_tokens: list[int]
    prompt_length: int
    generated_length: int
    finish_reason: str

    def __str__(self) -> str:
        return self.generated_text


@dataclass
class StreamChunk:
    index: int  # which prompt
    new_tokens: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None = None


def _is_id_list(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, int) for t in x)


class Pipeline:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._ids = itertools.count()

    def _prompts(self, prompts: Any) -> list[list[int]]:
        if isinstance(prompts, str) or _is_id_list(prompts):
            prompts = [prompts]
        out = []
        for p in prompts:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise RequestError("prompt", "a text prompt needs a tokenizer and the model folder has none; "
                                                 "pass token ids")
                out.append(self.tokenizer.encode(p))
            else:
                out.append(list(p))
        return out

    def _text(self, tokens: list[int], reason: str | None, stop_reason: Any) -> str:
        if self.tokenizer is None:
            return ""
        if reason == "stop" and isinstance(stop_reason, int) and tokens and tokens[-1] == stop_reason:
            tokens = tokens[:-1]
        text = self.tokenizer.decode(tokens)
        if reason == "stop" and isinstance(stop_reason, str):
            text = text[:text.find(stop_reason)] if stop_reason in text else text
        return text

    def stream(self, prompts: Any, **kw: Any) -> Iterator[StreamChunk]:
        """Yield chunks as tokens are generated; the final chunk of each prompt has ``finished``."""
        ids = self._prompts(prompts)
        params = self._params(**kw)
        rids = [f"pipe{next(self._ids)}" for _ in ids]
        for rid, p in zip(rids, ids):  # validate everything before running anything
            self.engine.add_request(rid, p, params)
        index = {rid: i for i, rid in enumerate(rids)}
        tokens: dict[str, list[int]] = {rid: [] for rid in rids}
        texts: dict[str, str] = {rid: "" for rid in rids}
        try:
            while any(rid in self.engine._seqs for rid in rids):
                for o in self.engine.step():
                    if o.request_id not in index:
                        continue
                    if o.error:
                        raise RuntimeError(f"prompt {index[o.request_id]} failed: {o.error}")
                    tokens[o.request_id].extend(o.new_token_ids)
                    text = self._text(tokens[o.request_id], o.finish_reason, o.stop_reason)
                    if not o.finished and text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait
                        new_text = ""
                    else:
                        new_text = text[len(texts[o.request_id]):] if text.startswith(texts[o.request_id]) else text
                        texts[o.request_id] = text
                    yield StreamChunk(index[o.request_id], list(o.new_token_ids), new_text, o.finished, o.finish_reason,
                                      o.stop_reason)
        finally:
            for rid in rids:
                self.engine.abort(rid)

    def __call__(self, prompts: Any, streaming_fn: Callable[[StreamChunk], None] | None = None,
                 **kw: Any) -> list[Response]:
        ids = self._prompts(prompts)
        tokens: list[list[int]] = [[] for _ in ids]
        final: list[StreamChunk | None] = [None] * len(ids)
        for chunk in self.stream(ids, **kw):
            tokens[chunk.index].extend(chunk.new_tokens)
            if chunk.finished:
                final[chunk.index] = chunk
            if streaming_fn is not None:
                streaming_fn(chunk)
        return [Response(self._text(toks, f.finish_reason, f.stop_reason), toks, len(p), len(toks), f.finish_reason)
                for p, toks, f in zip(ids, tokens, final)]

    @staticmethod
    def _params(max_new_tokens: int = 256, min_new_tokens: int = 0, do_sample: bool = False,
                temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, stop: Any = (),
                stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, seed: int | None = None,
                logprobs: int | None = None) -> SamplingParams:
        if isinstance(stop, str):
            stop = (stop,)
        return SamplingParams(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, do_sample=do_sample,
                              temperature=temperature, top_k=top_k, top_p=top_p, stop=tuple(stop or ()),
                              stop_token_ids=tuple(stop_token_ids or ()), ignore_eos=ignore_eos, seed=seed,
                              logprobs=logprobs)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def pipeline(model_name_or_path: str, tensor_parallel: int = 1, **engine_kwargs: Any) -> Pipeline | None:
    """Build a :class:`Pipeline` on :func:`~zerospeed.inference.build.build_engine` (its keyword
    arguments pass through: ``dtype``, ``block_size``, ``num_blocks``, ``max_num_batched_tokens``...)."""
    from zerospeed.inference.build import build_engine

    engine = build_engine(model_name_or_path, tensor_parallel=tensor_parallel, **engine_kwargs)
    if engine.tp.rank != 0:
        engine.run_worker_loop()
        return None
    return Pipeline(engine)
