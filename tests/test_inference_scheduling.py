"""Scheduling for inter-token latency, asserted on the scheduler's decisions (tokens per forward,
which sequences decode when), never on wall time: prefill first on a burst (every prompt computed up
to its last token, then all first tokens sampled in one forward of decodes), no extra forward for
prompts that fit in one, no hold once sequences decode, a full-cache or ``max_num_seqs`` limit ends
the hold instead of stalling it; greedy tokens equal HF's either way."""

from __future__ import annotations

import pytest
import torch

from inference_cases import hf_greedy, make_model, prompts, save_model
from zerospeed.inference import SamplingParams, build_engine

NEW = 6
LENGTHS = [30, 7, 19, 2]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    model = make_model("llama", seed=3)
    path = save_model(model, str(tmp_path_factory.mktemp("llama_sched")))
    ps = prompts(LENGTHS, seed=5)
    return path, ps, [hf_greedy(model, p, NEW) for p in ps]


def _recorded(engine):
    """Run the engine to completion; per forward: the scheduled ``(request_id, n)`` items, and
    the ids that got a token from it."""
    log = []
    schedule = engine.scheduler.schedule

    def record():
        batch = schedule()
        log.append([[(s.request_id, n) for s, n in batch.items], []])
        return batch

    engine.scheduler.schedule = record  # our own object: watch its decisions
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            log[-1][1].append(o.request_id)
    return log, out


def _burst(engine, ps):
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    return _recorded(engine)


def test_burst_prefills_first_then_samples_every_first_token_together(llama):
    path, ps, ref = llama
    budget = 16
    engine = build_engine(path, block_size=4, num_blocks=64, max_num_batched_tokens=budget)
    log, out = _burst(engine, ps)
    assert [out[str(i)] for i in range(len(ps))] == ref
    first = next(i for i, (_, got) in enumerate(log) if got)
    hold, start = log[:first], log[first]
    # the held forwards: prompt tokens only, full budget, no prompt computed to its end
    assert all(sum(n for _, n in items) == budget for items, _ in hold)
    done: dict[str, int] = {}
    for items, _ in hold:
        for rid, n in items:
            done[rid] = done.get(rid, 0) + n
    assert all(done[rid] <= LENGTHS[int(rid)] - 1 for rid in done)
    # the forward that ends the burst: the held last tokens as decodes, the rest of the prompts
    # fused in (no cap: nothing is decoding yet), and every request's first token from it
    assert len(hold) + 1 == -(-sum(LENGTHS) // budget)  # no forward wasted on the hold
    assert sorted(rid for rid, n in start[0] if n == 1 and done.get(rid) == LENGTHS[int(rid)] - 1) == ["0", "1"]
    assert sorted(start[1]) == [str(i) for i in range(len(ps))]
    # and from there on every forward is pure decode: no prompt chunk between two tokens
    assert all(n == 1 for items, _ in log[first + 1:] for _, n in items)


def test_without_prefill_first_early_prompts_decode_beside_later_chunks(llama):
    path, ps, ref = llama
    engine = build_engine(path, block_size=4, num_blocks=64, max_num_batched_tokens=16, prefill_first=False,
                          max_prefill_tokens_with_decodes=None)
    log, out = _burst(engine, ps)
    assert [out[str(i)] for i in range(len(ps))] == ref
    first = next(i for i, (_, got) in enumerate(log) if got)
    assert log[first][1] == ["0"]  # the first prompt finished alone and started decoding ...
    mixed = [items for items, _ in log if any(n == 1 for _, n in items) and any(n > 1 for _, n in items)]
    assert mixed  # ... beside the other prompts' chunks


def test_prompts_that_fit_one_forward_are_not_held(llama):
    path, ps, ref = llama
    engine = build_engine(path, block_size=4, num_blocks=64, max_num_batched_tokens=64)
    log, out = _burst(engine, ps)  # 58 prompt tokens <= 64: one forward, first tokens from it
    assert [out[str(i)] for i in range(len(ps))] == ref
    assert sorted(log[0][0]) == [(str(i), n) for i, n in enumerate(LENGTHS)]
    assert sorted(log[0][1]) == ["0", "1", "2", "3"]


def test_arrivals_while_decoding_are_not_held_and_are_capped(llama):
    path, ps, ref = llama
    engine = build_engine(path, block_size=4, num_blocks=64, max_num_batched_tokens=16,
                          max_prefill_tokens_with_decodes=4)
    sp = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    engine.add_request("1", ps[1], sp)
    assert [o.request_id for o in engine.step()] == ["1"]  # 7 tokens fit: sampled at once
    engine.add_request("2", ps[2], sp)
    engine.add_request("3", ps[3], sp)
    log, out = _recorded(engine)
    # "1" decodes every forward; 4 prompt tokens at most beside it, and "3"'s last token is not held
    assert all(("1", 1) in items for items, _ in log[:len(ref[1]) - 1])
    assert all(sum(n for rid, n in items if rid != "1") <= 4 for items, _ in log[:len(ref[1]) - 1])
    assert out["2"] == ref[2] and out["3"] == ref[3] and len(out["1"]) == NEW - 1


@pytest.mark.parametrize("limit", ["max_num_seqs", "cache"])
def test_a_limit_on_admission_ends_the_hold(llama, limit):
    """Held sequences that fill ``max_num_seqs`` (or the cache) start decoding rather than wait for
    prompts that cannot be admitted until they finish."""
    path, ps, ref = llama
    kw = dict(max_num_seqs=2, num_blocks=64) if limit == "max_num_seqs" else dict(num_blocks=16)
    engine = build_engine(path, block_size=4, max_num_batched_tokens=16, **kw)
    log, out = _burst(engine, ps)
    assert [out[str(i)] for i in range(len(ps))] == ref
    assert engine.stats().num_blocks_free == engine.stats().num_blocks_total


def test_prefill_first_must_be_a_bool(llama):
    with pytest.raises(ValueError, match="prefill_first: must be True or False"):
        build_engine(llama[0], num_blocks=8, prefill_first="yes")


# -- the greedy LM head (bfloat16 approximation, exact float32 candidates) ------------------------

def _head(w):
    from zerospeed.inference.models.layers import CausalLM

    model = CausalLM()
    model.lm_head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        model.lm_head.weight.copy_(w)
    return model


def test_greedy_head_equals_float32_argmax_on_near_ties():
    """Tokens from the approximate head + exact candidates equal the float32 logits' argmax (first
    maximum on ties), on random rows of several scales, on near-duplicate vocabulary rows (logits
    closer than bfloat16 can tell apart), exact duplicates (a tie), all-negative logits and rows
    so flat that they fall back to the full float32 logits."""
    from zerospeed.inference.models import layers

    g = torch.Generator().manual_seed(0)
    V, H = 3000, 64
    w = torch.randn(V, H, generator=g) * 0.05
    w[11] = w[7]  # an exact tie: the lower id wins
    w[500] = w[400] * (1 + 1e-6)  # 1e-6 apart: the approximation cannot order them, the refinement must
    h = torch.randn(40, H, generator=g) * torch.logspace(-2, 2, 40).unsqueeze(1)
    h[0] = w[7] * 10  # rows whose best tokens are the tied / near-tied pairs
    h[1] = w[400] * 10
    h[2] = -w[400] * 10
    model = _head(w)
    got = model._greedy_tokens_bf16(h, model.lm_head.weight)
    want = torch.nn.functional.linear(h, w).max(dim=1).indices
    assert torch.equal(got, want)
    assert got[0].item() == 7 and got[1].item() == 500
    # the same through torch.mm when oneDNN's packed matmul is not there
    cached = model.__dict__["_lm_head_bf16_t"]  # (weight, version, data_ptr, shape, derived)
    _, _, wmax = cached[-1]
    wb_t = model.lm_head.weight.detach().to(torch.bfloat16).t().contiguous()
    model.__dict__["_lm_head_bf16_t"] = cached[:-1] + ((wb_t, False, wmax),)
    assert torch.equal(model._greedy_tokens_bf16(h, model.lm_head.weight), want)
    neg = _head(-w.abs())  # every logit negative: the threshold rounds the other way
    hp = h.abs()
    assert torch.equal(neg._greedy_tokens_bf16(hp, neg.lm_head.weight),
                       torch.nn.functional.linear(hp, -w.abs()).max(dim=1).indices)
    flat = _head(torch.ones(V, H) + torch.randn(V, H, generator=g) * 1e-7)  # thousands of candidates
    hf = torch.randn(8, H, generator=g)
    assert torch.equal(flat._greedy_tokens_bf16(hf, flat.lm_head.weight),
                       torch.nn.functional.linear(hf, flat.lm_head.weight).max(dim=1).indices)
    assert layers.GREEDY_MAX_CANDIDATES < V


def test_greedy_head_is_used_by_the_engine_and_keeps_hf_tokens(llama):
    """A batch of 10 greedy requests decodes through the greedy head (bfloat16, forced: auto may time
    float32 faster), with HF's tokens; a batch that asks for logprobs goes through the logits."""
    from zerospeed.inference.models import layers

    path, _, _ = llama
    model = make_model("llama", seed=3)
    ps = prompts([5 + 3 * i for i in range(10)], seed=9)
    ref = [hf_greedy(model, p, NEW) for p in ps]
    engine = build_engine(path, block_size=4, num_blocks=128, max_num_batched_tokens=256, greedy_head="bf16")
    used = []
    greedy_tokens = engine.model.greedy_tokens
    engine.model.greedy_tokens = lambda h: used.append(greedy_tokens(h)) or used[-1]
    assert engine.generate(ps, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) == ref
    assert any(u is not None for u in used)
    used.clear()
    outs = engine.generate(ps, SamplingParams(max_new_tokens=2, ignore_eos=True, logprobs=1))
    assert outs == [r[:2] for r in ref] and not used


def test_block_weights_are_stored_transposed_with_the_same_values(llama):
    """On CPU in float32 the blocks' linear weights keep their shape and values but live transposed
    in memory (MKL multiplies that layout faster); the LM head is left as loaded."""
    path, _, _ = llama
    model = make_model("llama", seed=3)
    engine = build_engine(path, num_blocks=8)
    ours = engine.model
    qkv = ours.layers[0].attn.qkv.weight
    a = model.model.layers[0].self_attn
    assert qkv.stride() == (1, qkv.shape[0])
    assert torch.equal(qkv, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
    down = ours.layers[1].mlp.down.weight
    assert down.stride() == (1, down.shape[0]) and torch.equal(down, model.model.layers[1].mlp.down_proj.weight)
    assert ours.lm_head.weight.is_contiguous()
