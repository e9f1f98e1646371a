"""Structured output: grammars that constrain which tokens a sequence may sample (issue #31).

A request's ``SamplingParams.guide`` is a grammar in llguidance's format (built by
:func:`grammar_for` from a JSON schema, a regex, a list of choices or a Lark grammar). The engine
gives each guided sequence an ``LLMatcher`` over the model's tokenizer; before sampling, the masks of
every guided row of the forward are computed together (``LLExecutor``, in parallel across requests)
into one int32 bitmask ``[rows, ceil(V / 32)]`` and applied to the logits in one batched op; after
sampling, each matcher consumes its token, and a matcher that reached the end of its grammar
finishes the sequence (``finish_reason`` "stop"). Tokens outside the grammar get ``-inf``, so the
output always parses, greedy or sampled.

Why llguidance: it installs as one wheel with no torch dependency (xgrammar pulls triton and a TVM
runtime here; outlines-core would also do), computes a mask in tens of microseconds for JSON
schemas, and its grammar formats cover JSON schema, regex, choices and Lark.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
from typing import Any

import torch

from zerospeed.inference.api import RequestError

GUIDE_KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
# JSON as json.dumps writes it (", " and ": ", no other whitespace): flexible whitespace lets a model
# spend its tokens on blanks (a small model sampled dozens before the first key); a schema's own
# "x-guidance" options override this
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:  # pragma: no cover - the serve extra installs it
        raise RequestError("guide", "structured output needs the llguidance package "
                                    "(pip install 'zerospeed[serve]')") from None
    return llguidance


def grammar_for(kind: str, spec: Any) -> str:
    """A llguidance grammar: ``kind`` one of :data:`GUIDE_KINDS`; ``spec`` the schema (dict or JSON
    text), the regex, the list of strings, or the Lark text (ignored for ``json_object``)."""
    ll = _llguidance()
    if kind == "json_object":
        return ll.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if kind == "json_schema":
        return ll.LLMatcher.grammar_from_json_schema(spec if isinstance(spec, str) else json.dumps(spec),
                                                     defaults=JSON_LAYOUT)
    if kind == "regex":
        return ll.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return ll.grammar_from("choice", json.dumps(list(spec)))
    if kind == "lark":
        return ll.LLMatcher.grammar_from_lark(spec)
    raise ValueError(f"kind: {kind!r} is not one of {', '.join(GUIDE_KINDS)}")


def validation_error(grammar: str) -> str:
    """llguidance's message for an invalid grammar (checked without a tokenizer), "" when valid."""
    message = _llguidance().LLMatcher.validate_grammar(grammar)
    return "" if not message or message.startswith("WARNING") else message


class Guides:
    """The engine's grammar side: one llguidance tokenizer (built when the first guided request
    comes, ~0.1-1 s) and an executor that computes a forward's masks in parallel."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _tokenizer_json(self) -> str:
        t = self._tokenizer
        for obj in (getattr(t, "backend", None), t):
            if obj is None:
                continue
            for owner in (obj, getattr(obj, "backend_tokenizer", None)):
                to_str = getattr(owner, "to_str", None)
                if to_str is not None:
                    return to_str()
        raise RequestError("guide", "structured output needs a fast (tokenizer.json) tokenizer")

    def matcher(self, grammar: str) -> Any:
        """A fresh matcher for ``grammar``; :class:`RequestError` ("guide") when it is invalid."""
        ll = _llguidance()
        if self._tokenizer is None:
            raise RequestError("guide", "structured output needs the model folder's tokenizer")
        if self._ll_tokenizer is None:
            self._ll_tokenizer = ll.LLTokenizer(self._tokenizer_json(), n_vocab=self._vocab_size,
                                                eos_token=self._eos or None)
            self._executor = ll.LLExecutor()
        message = ll.LLMatcher.validate_grammar(grammar, self._ll_tokenizer)
        if message:
            raise RequestError("guide", f"invalid grammar: {message}")
        m = ll.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if m.is_error():
            raise RequestError("guide", f"invalid grammar: {m.get_error()}")
        return m

    #: jump-forward: tokens the grammar forces after a sampled token are appended without a forward of their own
    #: (:meth:`forced_tokens`); False computes a mask and samples each of them, as every other token
    jump_forward: bool = True

    def forced_tokens(self, matcher: Any, limit: int) -> list[int]:
        """At most ``limit`` tokens the grammar of ``matcher`` forces next (llguidance's fast-forward tokens),
        or none. A forced token is the only one the matcher's mask allows at its position (llguidance forces
        its canonical tokenization of the forced bytes), so appending it gives the tokens masked sampling
        would give, greedy or sampled, without the forward that would compute its logits, the mask and the
        sampling: its K/V is computed with the next sampled token's, in one chunk. JSON's keys, quotes,
        separators and closing brackets are forced: three quarters of the tokens of bench/serve_structured.py's
        replies. The matcher has not consumed them (the caller does, token by token, checking its stops)."""
        if not self.jump_forward or limit <= 0 or matcher.is_stopped():
            return []
        return list(matcher.compute_ff_tokens()[:limit])

    def mask(self, logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
        """Set ``logits[rows[i], t] = -inf`` for every token ``t`` that ``matchers[i]`` refuses:
        one parallel mask computation, then one table lookup and one batched add for all guided rows.

        The bitmask (bit ``t % 32`` of word ``t // 32``: token ``t`` allowed) is read as bytes (little
        endian: byte ``i`` holds tokens ``8i .. 8i + 7``, the order of the int32 words' bits) and each
        byte looks up its 8 additive terms (0 or -inf) in a 256 x 8 table: one gather of 32 bytes per
        byte of mask, then ``index_add_`` of the ``[rows, V]`` terms. Exact (``x + 0 == x``). Measured
        on this CPU (V = 32000, one thread, bench/serve_structured.py): ~30 us per row for 8-32 rows,
        3x less than unpacking the bits with shifts and a bool ``masked_fill`` (torch's bool-mask
        kernels are slow here); llguidance's own mask computation is ~40 us per row and token."""
        self.apply(logits, rows, self.bitmask(matchers, logits.shape[1]))

    def bitmask(self, matchers: list[Any], vocab_size: int) -> torch.Tensor:
        """``[len(matchers), ceil(vocab_size / 32)]`` int32: bit ``t % 32`` of word ``t // 32`` of row
        ``i`` set when ``matchers[i]`` allows token ``t`` (one parallel llguidance call)."""
        words = (vocab_size + 31) // 32
        bitmask = torch.empty((len(matchers), words), dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                               bitmask.data_ptr(), words * 4, len(matchers))
        return bitmask

    def start(self, rows: list[int], matchers: list[Any], vocab_size: int) -> "PendingMasks":
        """Compute the masks of ``matchers`` (the guided ``rows`` of a forward) and their float32
        ``[rows, V]`` terms on a worker thread while the caller runs the model: the matchers must not
        consume tokens until the result is applied. llguidance and torch's gather run outside the GIL,
        so on a CPU with a core to spare the mask costs the forward little wall time."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zerospeed-guides")
        return PendingMasks(rows, self._pool.submit(self._prepare, matchers, vocab_size))

    def _prepare(self, matchers: list[Any], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        bitmask = self.bitmask(matchers, vocab_size)
        return bitmask, refusal_terms(bitmask, vocab_size, torch.float32, torch.device("cpu"))

    @staticmethod
    def apply(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        """``logits[rows[i], t] += -inf`` where bit ``t`` of ``bitmask[i]`` is clear, ``+= 0`` elsewhere."""
        terms = refusal_terms(bitmask, logits.shape[1], logits.dtype, logits.device)
        logits.index_add_(0, torch.tensor(rows, device=logits.device), terms)


class PendingMasks:
    """The masks of one forward's guided rows, being computed (:meth:`Guides.start`)."""

    def __init__(self, rows: list[int], future: "concurrent.futures.Future") -> None:
        self.rows = rows
        self._future = future

    def bitmask(self) -> torch.Tensor:
        return self._future.result()[0]

    def wait(self) -> None:
        """Until the worker is done with the matchers (whether it succeeded or not)."""
        concurrent.futures.wait([self._future])

    def apply(self, logits: torch.Tensor) -> None:
        """:meth:`Guides.apply` to ``logits`` (the forward's sampled rows, or its approximate logits),
        with the terms computed ahead where their dtype and device fit."""
        bitmask, terms = self._future.result()
        if terms.dtype != logits.dtype or terms.device != logits.device or terms.shape[1] != logits.shape[1]:
            Guides.apply(logits, self.rows, bitmask)
            return
        logits.index_add_(0, torch.tensor(self.rows, device=logits.device), terms)


def refusal_terms(bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[rows, vocab_size]``: 0 where bit ``t`` of ``bitmask[i]`` is set (token allowed), ``-inf`` elsewhere."""
    words = bitmask.shape[1]
    mask_bytes = bitmask.view(torch.uint8).reshape(-1, 4)
    if sys.byteorder == "big":  # byte i of a word must hold its bits 8i .. 8i + 7
        mask_bytes = mask_bytes.flip(1)
    table = _refusal_table(dtype, device)
    terms = torch.nn.functional.embedding(mask_bytes.reshape(-1).to(device, torch.long), table)
    return terms.view(bitmask.shape[0], words * 32)[:, :vocab_size]


_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _refusal_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[256, 8]``: row ``b``, column ``k`` is 0 when bit ``k`` of byte ``b`` is set (allowed), else -inf."""
    key = (dtype, device)
    if key not in _TABLES:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        _TABLES[key] = torch.zeros(256, 8, dtype=dtype).masked_fill(bits == 0, float("-inf")).to(device)
    return _TABLES[key]
