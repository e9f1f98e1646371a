"""When a generated sequence stops, and the tokens its grammar forces next (split from engine.py, issue #31).

A sequence stops after a token when: the token is a stop token (EOS unless ``ignore_eos``, or one of
``stop_token_ids``) and ``min_new_tokens`` are done; the generated text contains a ``stop`` string; its grammar
(structured output) is complete; or ``max_new_tokens`` are generated. Jump-forward (:func:`jump_forward`) appends
the tokens a guided sequence's grammar forces after a sampled token, each checked like a sampled one.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from zerospeed.inference.sequence import Sequence


def stop_reason(seq: Sequence, tok: int, tokenizer: Any) -> str | None:
    """After ``tok`` was appended to ``seq``: "stop", "length" or None (it goes on); sets ``seq.stop_reason`` (the
    stop token or string; None when the grammar completed) and feeds ``tok`` to the sequence's grammar matcher."""
    p = seq.params
    n = seq.num_generated
    reason = None
    if tok in seq.stop_set and n > p.min_new_tokens - 1:
        reason, seq.stop_reason = "stop", tok
    elif p.stop and n >= p.min_new_tokens:
        text = tokenizer.decode(seq.generated)
        for s in p.stop:
            if s in text:
                reason, seq.stop_reason = "stop", s
                break
    if reason is None and seq.matcher is not None:
        seq.matcher.consume_token(tok)
        if seq.matcher.is_stopped():  # the grammar is complete (or refused the token: never sampled)
            reason, seq.stop_reason = "stop", None
    if reason is None and n >= p.max_new_tokens:
        reason = "length"
    return reason


def jump_forward(seq: Sequence, guides: Any, check: Callable[[Sequence, int], None]) -> list[int]:
    """Append the tokens ``seq``'s grammar forces next (``guides.forced_tokens``), each passed to ``check`` (the
    engine's stop check) as a sampled one; a stop token is left to be sampled. A seeded sequence's generator
    advances by the draw sampling would have taken, so its later draws are the same. Their K/V is computed in
    the next forward. Returns the tokens appended."""
    out: list[int] = []
    for t in guides.forced_tokens(seq.matcher, seq.params.max_new_tokens - seq.num_generated):
        if t in seq.stop_set:
            break
        seq.tokens.append(t)
        out.append(t)
        if seq.generator is not None:
            torch.rand(1, generator=seq.generator, dtype=torch.float64)
        check(seq, t)
        if seq.is_finished:
            break
    return out
