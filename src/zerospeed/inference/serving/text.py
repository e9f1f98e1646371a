"""Token ids to text for the server: a tokenizer adapter and incremental detokenisation with stop
strings.

Decisions:

* The engine's ``tokenizer`` may be a ``tokenizers.Tokenizer`` (whose ``encode`` returns an
  ``Encoding``), a transformers tokenizer or the engine's own wrapper returning id lists;
  :class:`TokenizerAdapter` gives the server one interface over all three.
* Streaming text is produced by decoding the whole generated sequence each time and sending what is
  new, so multi-byte characters split over tokens and decoders that merge tokens (byte-level BPE,
  SentencePiece's leading spaces) come out right. A trailing U+FFFD (an incomplete UTF-8 sequence)
  is held back until the next token completes it.
* Stop strings are applied to text here even though the engine also knows them: the engine
  finishes on the token that completes a stop string, but only text shows where the string begins,
  and the reply must not contain it. While streaming, the tail that could still grow into a stop
  string is held back, so no client ever sees part of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TokenizerAdapter:
    """``encode(text, add_special_tokens) -> list[int]`` and ``decode(ids) -> str`` (special tokens
    skipped) over whatever tokenizer object the engine exposes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @property
    def available(self) -> bool:
        """False for a model folder without a tokenizer: token-id prompts only, no text out."""
        return self.tokenizer is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("the model folder has no tokenizer; send token ids")
        try:
            out = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except TypeError:
            out = self.tokenizer.encode(text)
        ids = getattr(out, "ids", out)
        return [int(i) for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        try:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)
        except TypeError:
            return self.tokenizer.decode(list(ids))

    def token_bytes(self, token_id: int) -> list[int]:
        """The UTF-8 bytes one token stands for (chat logprobs' ``bytes``): its decoded text's
        bytes when it decodes to whole characters; for a token inside a multi-byte character
        (decoded as U+FFFD), the bytes of its vocabulary entry: byte-level BPE's stand-in
        characters, or SentencePiece's ``<0xNN>`` byte tokens."""
        text = self.token_text(token_id)
        if "\ufffd" not in text or self.tokenizer is None:
            return list(text.encode())
        piece = _piece(self.tokenizer, token_id)
        if piece:
            if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
                try:
                    return [int(piece[3:5], 16)]
                except ValueError:
                    pass
            if all(ch in _BYTE_LEVEL for ch in piece):
                return [_BYTE_LEVEL[ch] for ch in piece]
        return list(text.encode())

    def token_text(self, token_id: int) -> str:
        """One token's text for log-probability entries (its decoded text, as OpenAI gives it;
        ``token_id:N`` without a tokenizer)."""
        if self.tokenizer is None:
            return f"token_id:{int(token_id)}"
        return self.decode([token_id])


def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins (GPT-2's): bytes that print as themselves keep their
    character, the others take 256, 257, ... in byte order. Character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_table()


def _piece(tokenizer: Any, token_id: int) -> str | None:
    """The vocabulary entry of ``token_id`` (before decoding), whatever the tokenizer object."""
    for obj in (tokenizer, getattr(tokenizer, "backend", None)):
        if obj is None:
            continue
        for name in ("id_to_token", "convert_ids_to_tokens"):
            fn = getattr(obj, name, None)
            if fn is not None:
                try:
                    piece = fn(int(token_id))
                except Exception:  # noqa: BLE001 - an id the tokenizer does not know
                    return None
                return piece if isinstance(piece, str) else None
    return None


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class TextStream:
    """The text of one choice, built token by token.

    ``add(ids)`` returns the text that is safe to send now; ``stopped`` becomes True when a stop
    string appeared (the text is cut before it and nothing more is sent); ``finish()`` returns what
    was held back once the request is over. ``text`` is everything sent so far.
    """

    def __init__(self, tokenizer: TokenizerAdapter, stops: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stops = [s for s in stops if s]
        self._ids: list[int] = []
        self._full = ""
        self.text = ""
        self.stopped = False

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def add(self, ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self._ids.extend(int(i) for i in ids)
        self._full = self._tokenizer.decode(self._ids)
        return self._emit(final=False)

    def finish(self) -> str:
        return "" if self.stopped else self._emit(final=True)

    def _emit(self, final: bool) -> str:
        full = self._full
        if self._stops:
            start = max(0, len(self.text) - max(len(s) for s in self._stops))
            cut = min((i for i in (full.find(s, start) for s in self._stops) if i >= 0), default=-1)
            if cut >= 0:
                full = full[:cut]
                self.stopped = True
                final = True
        end = len(full)
        if not final:
            if full.endswith("\ufffd"):
                end -= 1
            end -= _held_back(full[:end], self._stops)
        if end <= len(self.text) or not full.startswith(self.text):
            # decoders may rewrite earlier text (rare); never take back what was sent
            return ""
        delta = full[len(self.text):end]
        self.text += delta
        return delta
