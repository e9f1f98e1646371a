"""Turning each sequence's last-token logits into its next token.

Greedy rows (``do_sample=False`` or ``temperature == 0``) take one batched ``argmax``. Sampled rows
are drawn on the CPU, each with its own ``torch.Generator`` seeded from the request's ``seed``:
temperature, then top-k, then top-p (nucleus; the most likely token always survives), then one
uniform draw against the row's cumulative distribution (batched over the sampled rows). A row's
draw depends only on its own logits and generator, so a
seeded request gives the same tokens whatever else shares its batch, and on any device.

``min_new_tokens`` masks the stop tokens (EOS and ``stop_token_ids``) until enough tokens exist,
as HF's ``MinNewTokensLengthLogitsProcessor`` masks EOS.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from zerospeed.inference.api import RequestError, SamplingParams

MAX_LOGPROBS = 20


def validate(params: SamplingParams, vocab_size: int) -> None:
    """Raise :class:`RequestError` naming the first invalid field."""
    def bad(field: str, msg: str) -> None:
        raise RequestError(field, msg)

    if params.prompt_logprobs is not None and (not isinstance(params.prompt_logprobs, int)
                                               or not 0 <= params.prompt_logprobs <= MAX_LOGPROBS):
        bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None, got "
                               f"{params.prompt_logprobs!r}")
    least = 0 if params.prompt_logprobs is not None else 1  # 0: score the prompt only
    if not isinstance(params.max_new_tokens, int) or params.max_new_tokens < least:
        bad("max_new_tokens", f"must be an integer >= {least}, got {params.max_new_tokens!r}")
    if not isinstance(params.min_new_tokens, int) or not 0 <= params.min_new_tokens <= params.max_new_tokens:
        bad("min_new_tokens", f"must be an integer in [0, max_new_tokens={params.max_new_tokens}], "
                              f"got {params.min_new_tokens!r}")
    t = params.temperature
    if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t < 0:
        bad("temperature", f"must be a finite number >= 0, got {t!r}")
    if not isinstance(params.top_k, int) or params.top_k < -1:
        bad("top_k", f"must be an integer >= 0 (0 or -1: disabled), got {params.top_k!r}")
    p = params.top_p
    if not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
        bad("top_p", f"must be in (0, 1], got {p!r}")
    if params.seed is not None and (not isinstance(params.seed, int) or params.seed < 0):
        bad("seed", f"must be a non-negative integer or None, got {params.seed!r}")
    if isinstance(params.stop, str) or not all(isinstance(s, str) and s for s in params.stop):
        bad("stop", f"must be a sequence of non-empty strings, got {params.stop!r}")
    for tok in params.stop_token_ids:
        if not isinstance(tok, int) or not 0 <= tok < vocab_size:
            bad("stop_token_ids", f"token id {tok!r} is outside the vocabulary [0, {vocab_size})")
    if params.logprobs is not None and (not isinstance(params.logprobs, int)
                                        or not 0 <= params.logprobs <= MAX_LOGPROBS):
        bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None, got {params.logprobs!r}")


def is_greedy(params: SamplingParams) -> bool:
    return not params.do_sample or params.temperature == 0


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return g


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits [V]`` float32 -> temperature-scaled, top-k / top-p filtered logits."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > params.top_p  # mass before this token already exceeds top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def _draw(logits: torch.Tensor, seqs: list) -> list[int]:
    """Sampled rows ``logits [R, V]`` (CPU float32) -> one token each by inverse-CDF: row ``r``'s one uniform
    draw comes from its own generator, so its token depends only on its logits and seed. Temperature, softmax,
    cumsum and the search run once over all rows (a per-row ``multinomial`` cost 0.3 ms a row at V=4096: a
    64-sequence GRPO rollout spent a third of its decode there); top-k / top-p rows are filtered one by one."""
    temps = [float(s.params.temperature) for s in seqs]
    filtered = any(s.params.top_k > 0 or s.params.top_p < 1.0 for s in seqs)
    if any(t != 1.0 for t in temps):  # x / 1.0 is x: the common T = 1 skips a pass over [R, V]
        logits = logits / torch.tensor(temps, dtype=logits.dtype)[:, None]
    elif filtered:
        logits = logits.clone()  # the filters below write rows: never into the caller's logits
    for r, s in enumerate(seqs):
        if s.params.top_k > 0 or s.params.top_p < 1.0:
            logits[r] = _filter(logits[r], dataclasses.replace(s.params, temperature=1.0))  # applied above
    cdf = logits.softmax(-1).cumsum_(-1)
    u = torch.cat([torch.rand(1, generator=s.generator, dtype=torch.float64) for s in seqs])
    total = cdf[:, -1:]
    # strictly below the total: u close to 1 can round up to it in float32, and the search would then run past the
    # last token of non-zero probability (onto a token top-k / top-p removed)
    target = torch.minimum((u[:, None] * total.double()).to(cdf.dtype), torch.nextafter(total, torch.zeros_like(total)))
    # the first index whose cumulative mass exceeds the target: cdf[i-1] <= target < cdf[i], so p[i] > 0
    return torch.searchsorted(cdf, target, right=True)[:, 0].tolist()


def sample(logits: torch.Tensor, seqs: list) -> tuple[list[int], list[float | None], list[dict[int, float] | None]]:
    """``logits [N, V]`` float32, one row per sequence. Returns token ids, the chosen token's
    logprob (when asked) and the top alternatives (when ``logprobs > 0``)."""
    for i, seq in enumerate(seqs):
        if seq.num_generated < seq.params.min_new_tokens and seq.stop_set:
            logits[i, list(seq.stop_set)] = float("-inf")
    rows = [i for i, s in enumerate(seqs) if not is_greedy(s.params)]
    if len(rows) == len(seqs):  # all sampled (a GRPO rollout): no argmax, no gather of the rows
        tokens = _draw(logits.cpu(), seqs)
    else:
        tokens = logits.max(-1).indices.tolist()  # first maximum, as argmax; 3x faster on CPU here
        if rows:
            for i, t in zip(rows, _draw(logits[rows].cpu(), [seqs[i] for i in rows])):
                tokens[i] = t
    chosen: list[float | None] = [None] * len(seqs)
    tops: list[dict[int, float] | None] = [None] * len(seqs)
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if want:
        lp = logits[want].log_softmax(-1).cpu()
        for r, i in enumerate(want):
            chosen[i] = float(lp[r, tokens[i]])
            k = seqs[i].params.logprobs
            if k:
                v, ix = torch.topk(lp[r], k)
                tops[i] = {int(a): float(b) for a, b in zip(ix.tolist(), v.tolist())}
    return tokens, chosen, tops


PROMPT_LOGPROB_ROWS = 128  # rows per log_softmax pass: bounds the float32 temporaries


def record_prompt_logprobs(logits: torch.Tensor, parts: list) -> None:
    """``logits [R, V]``: the LM head's output at prompt positions, in the order of ``parts``
    (``(seq, first_position, count)``); position ``p`` scores prompt token ``p + 1``. Appends to
    ``seq.prompt_lps`` / ``seq.prompt_tops``; a position already recorded (a preempted sequence
    recomputing its prompt) is skipped."""
    r = 0
    for seq, first, count in parts:
        k = seq.params.prompt_logprobs
        for a in range(0, count, PROMPT_LOGPROB_ROWS):
            b = min(count, a + PROMPT_LOGPROB_ROWS)
            lp = logits[r + a:r + b].float().log_softmax(-1)
            target = torch.tensor(seq.tokens[first + a + 1:first + b + 1], device=lp.device)
            chosen = lp.gather(1, target[:, None])[:, 0].cpu().tolist()
            tv = ti = None
            if k == 1:  # lm-eval's logprobs=1: one pass of max instead of topk's selection (same value)
                top = lp.max(dim=1, keepdim=True)
                tv, ti = top.values.cpu().tolist(), top.indices.cpu().tolist()
            elif k:
                top = torch.topk(lp, k)
                tv, ti = top.values.cpu().tolist(), top.indices.cpu().tolist()
            for j in range(b - a):
                if first + a + j + 1 != len(seq.prompt_lps):
                    continue
                seq.prompt_lps.append(float(chosen[j]))
                seq.prompt_tops.append({int(t): float(v) for t, v in zip(ti[j], tv[j])} if k else {})
        r += count
