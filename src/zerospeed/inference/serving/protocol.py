"""OpenAI request bodies in, :class:`SamplingParams` out; OpenAI-style error bodies.

Decisions:

* ``n`` choices per prompt share the prompt's KV blocks in the engine (forks); ``best_of``
  generates that many and returns the ``n`` with the highest cumulative logprob, best first, as
  OpenAI did (not streamable).
* Request bodies are pydantic models with ``extra="ignore"``: OpenAI clients send fields we do not
  act on (``user``, ``metadata``...), and refusing them would break unchanged clients. Fields that
  *would* change the output and that we cannot honour (penalties, ``logit_bias``, ``suffix``...) are refused with a 400 naming the field instead of being silently dropped.
* OpenAI's defaults are kept: ``temperature`` 1.0 (so sampling unless the client asks for 0),
  ``max_tokens`` 16 for completions and "the rest of the context" for chat.
* vLLM's extra fields that clients pass through ``extra_body`` are accepted: ``top_k`` (0 or -1: off),
  ``min_tokens``, ``ignore_eos``, ``stop_token_ids``.
* ``echo`` returns the prompt before the completion (its tokens' logprobs too, the first one None,
  as OpenAI did); ``max_tokens=0`` with ``echo`` or vLLM's ``prompt_logprobs`` scores a prompt
  without generating (lm-eval's loglikelihood requests).
* Log-probabilities: completions' ``logprobs`` (0-5 alternatives) and chat's ``logprobs`` +
  ``top_logprobs`` (0-20) are passed to the engine, which returns the chosen token's
  log-probability and the requested number of alternatives.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from zerospeed.inference.api import SamplingParams

MAX_STOP_SEQUENCES = 4
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limits
MAX_CHAT_TOP_LOGPROBS = 20
MAX_N = 64  # choices per prompt (n, best_of): each one is a sequence in the engine


class ApiError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code
        self.headers = headers or {}

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:  # picklable (issue #27)
        return type(self), (self.status, self.message, self.param, self.type, self.code, self.headers)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(param: str, message: str) -> ApiError:
    """A 400 whose message starts with the field name, as every error of the server does."""
    return ApiError(400, f"{param}: {message}", param=param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    # structured output: OpenAI's response_format, and vLLM's guided_* extras
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def guide(self) -> str | None:
        """The engine's grammar (llguidance format) for the structured-output fields, None for
        free text; a 400 naming the field when it is malformed or its grammar invalid."""
        asked = []
        rf = self.response_format
        if rf is not None and rf.get("type", "text") != "text":
            kind = rf.get("type")
            if kind == "json_object":
                asked.append(("response_format", "json_object", None))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema") if isinstance(js, dict) else None
                if not isinstance(schema, dict):
                    raise bad_request("response_format.json_schema.schema", "must be a JSON schema object")
                asked.append(("response_format", "json_schema", schema))
            else:
                raise bad_request("response_format.type", f"must be text, json_object or json_schema, "
                                  f"got {kind!r}")
        for field_name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                                 ("guided_choice", "choice"), ("guided_grammar", "lark")):
            value = getattr(self, field_name)
            if value is not None:
                asked.append((field_name, kind, value))
        if not asked:
            return None
        if len(asked) > 1:
            raise bad_request(asked[1][0], f"only one structured-output field at a time (also {asked[0][0]})")
        field_name, kind, spec = asked[0]
        if kind == "choice" and (not spec or not all(isinstance(c, str) for c in spec)):
            raise bad_request(field_name, "must be a non-empty list of strings")
        from zerospeed.inference.api import RequestError
        from zerospeed.inference.constraints import grammar_for, validation_error

        try:
            grammar = grammar_for(kind, spec)
            problem = validation_error(grammar)
        except (RequestError, ValueError, TypeError) as e:
            problem = str(e)
        if problem:
            raise bad_request(field_name, f"invalid {kind.replace('_', ' ')}: {problem}")
        return grammar

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _check_common(self) -> None:
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise bad_request("n", f"must be in [1, {MAX_N}], got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise bad_request(name, "is not supported (only 0)")
        if self.logit_bias:
            raise bad_request("logit_bias", "is not supported")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options", "is only allowed with stream=true")

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise bad_request("stop", f"at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}")
        if any(s == "" for s in stops):
            raise bad_request("stop", "empty stop strings are not allowed")
        return stops

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters; raises :class:`ApiError` (400) naming the bad field."""
        temperature = 1.0 if self.temperature is None else self.temperature
        if not 0.0 <= temperature <= 2.0:
            raise bad_request("temperature", f"must be in [0, 2], got {temperature}")
        top_p = 1.0 if self.top_p is None else self.top_p
        if not 0.0 < top_p <= 1.0:
            raise bad_request("top_p", f"must be in (0, 1], got {top_p}")
        top_k = 0 if self.top_k in (None, -1) else self.top_k
        if top_k < 0:
            raise bad_request("top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        least = 0 if prompt_logprobs is not None else 1  # 0: score the prompt only
        if max_tokens < least:
            raise bad_request("max_tokens", f"must be at least {least}, got {max_tokens}"
                              + ("" if least == 0 else " (0 only with echo or prompt_logprobs)"))
        if self.min_tokens < 0 or self.min_tokens > max_tokens:
            raise bad_request("min_tokens", f"must be in [0, max_tokens={max_tokens}], got "
                              f"{self.min_tokens}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise bad_request("seed", "must fit in 64 bits")
        if any(t < 0 for t in self.stop_token_ids or ()):
            raise bad_request("stop_token_ids", "token ids must be non-negative")
        return SamplingParams(
            max_new_tokens=max_tokens,
            min_new_tokens=self.min_tokens,
            do_sample=temperature > 0.0,
            temperature=temperature if temperature > 0.0 else 1.0,
            top_k=top_k,
            top_p=top_p,
            stop=tuple(self.stop_list()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            seed=None if self.seed is None else self.seed % 2**63,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            guide=self.guide(),
        )


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, token ids, or a list of
    token-id lists; several prompts give one choice each (``index`` in prompt order)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    prompt_logprobs: int | None = None  # vLLM's extra: the prompt tokens' logprobs, per choice

    def check(self) -> None:
        self._check_common()
        n = self.n or 1
        if self.best_of is not None:
            if not n <= self.best_of <= MAX_N:
                raise bad_request("best_of", f"must be in [n={n}, {MAX_N}], got {self.best_of}")
            if self.stream and self.best_of > n:
                raise bad_request("best_of", "cannot be streamed (the best are known at the end)")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_CHAT_TOP_LOGPROBS:
            raise bad_request("prompt_logprobs", f"must be in [0, {MAX_CHAT_TOP_LOGPROBS}], got "
                              f"{self.prompt_logprobs}")
        if self.suffix:
            raise bad_request("suffix", "is not supported")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise bad_request("logprobs", f"must be in [0, {MAX_COMPLETION_LOGPROBS}], got "
                              f"{self.logprobs}")

    def num_candidates(self) -> int:
        """Sequences generated per prompt: ``best_of`` (the best ``n`` are returned) or ``n``."""
        return max(self.best_of or 1, self.n or 1)

    def engine_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the engine computes: ``echo`` with ``logprobs`` needs the
        prompt's logprobs, ``prompt_logprobs`` asks for them; ``echo`` with ``max_tokens=0`` and no
        logprobs still goes through the engine (0: the chosen token only). None: not needed."""
        want = []
        if self.echo and (self.logprobs is not None or self.max_tokens == 0):
            want.append(self.logprobs or 0)
        if self.prompt_logprobs is not None:
            want.append(self.prompt_logprobs)
        return max(want) if want else None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as strings or token-id lists; raises a 400 for an empty list."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt", "must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None

    def check(self) -> None:
        self._check_common()
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_CHAT_TOP_LOGPROBS:
                raise bad_request("top_logprobs", f"must be in [0, {MAX_CHAT_TOP_LOGPROBS}], got "
                                  f"{self.top_logprobs}")
            if not self.logprobs and self.top_logprobs:
                raise bad_request("top_logprobs", "needs logprobs=true")

    def engine_logprobs(self) -> int | None:
        """The engine's ``logprobs`` (alternatives per token), None when not asked for."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for the chat template; text parts are joined."""
        out = []
        for i, m in enumerate(self.messages):
            content = m.content
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise bad_request(f"messages[{i}].content[{j}]",
                                          f"only text parts are supported, got type {part.type!r}")
                    texts.append(part.text)
                content = "".join(texts)
            d = {k: v for k, v in m.model_dump(exclude_none=True).items() if k != "content"}
            d["content"] = content if content is not None else ""
            out.append(d)
        return out


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): ``prompt`` text, or chat ``messages`` through the template."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


FinishReasonOut = Literal["stop", "length", "abort"]

# The engine names request fields its way (SamplingParams / add_request); the HTTP API its own.
ENGINE_FIELD_TO_HTTP = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "prompt_token_ids": "prompt",
    "do_sample": "temperature",
    "guide": "response_format",
}


def http_field(engine_field: str, prompt_field: str) -> str:
    """The HTTP request field for an engine :class:`RequestError` field."""
    name = ENGINE_FIELD_TO_HTTP.get(engine_field, engine_field)
    return prompt_field if name in ("prompt", "prompt_token_ids") else name
