"""Request handling: bad requests fail alone with a message naming the field, seeded sampling is
reproducible whatever shares the batch, stop strings / tokens, min_new_tokens, abort, and prefix
sharing of identical prompt blocks with copy-on-write."""

from __future__ import annotations

import pytest

from inference_cases import build_tokenizer, hf_greedy, make_model, prompts, save_model
from zerospeed.inference import RequestError, SamplingParams, build_engine


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    model = make_model("llama", seed=4)
    path = save_model(model, str(tmp_path_factory.mktemp("m")))
    build_tokenizer(path)
    return model, path


def _run(engine, requests):
    for rid, p, sp in requests:
        engine.add_request(rid, p, sp)
    outs = {rid: [] for rid, _, _ in requests}
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                final[o.request_id] = o
    return outs, final


@pytest.mark.parametrize("prompt,params,field", [
    ([], SamplingParams(), "prompt"),
    (list(range(3, 70)), SamplingParams(max_new_tokens=1), "prompt"),  # longer than the 64-token context
    ([5, 6], SamplingParams(max_new_tokens=63), "max_new_tokens"),  # 2 + 63 > 64
    ([5, 6], SamplingParams(max_new_tokens=0), "max_new_tokens"),
    ([5, 999], SamplingParams(), "prompt"),
    ([5], SamplingParams(temperature=-1.0, do_sample=True), "temperature"),
    ([5], SamplingParams(top_p=0.0, do_sample=True), "top_p"),
    ([5], SamplingParams(top_k=-3), "top_k"),
    ([5], SamplingParams(min_new_tokens=9, max_new_tokens=4), "min_new_tokens"),
    ([5], SamplingParams(stop=("",)), "stop"),
    ([5], SamplingParams(stop_token_ids=(10**6,)), "stop_token_ids"),
    ([5], SamplingParams(logprobs=99), "logprobs"),
])
def test_bad_request_fails_alone(folder, prompt, params, field):
    model, path = folder
    engine = build_engine(path, num_blocks=16, block_size=4, max_model_len=64)
    good = prompts([7])[0]
    engine.add_request("good", good, SamplingParams(max_new_tokens=6, ignore_eos=True))
    engine.step()  # the good one is already running
    with pytest.raises(RequestError) as e:
        engine.add_request("bad", prompt, params)
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")
    outs, final = _run(engine, [])
    assert list(outs) == ["good"] and len(outs["good"]) == 5 and final["good"].finish_reason == "length"
    assert engine.stats().num_blocks_free == 16
    with pytest.raises(RequestError, match="request_id: 'x' is already in use"):
        engine.add_request("x", [5], SamplingParams(max_new_tokens=2))
        engine.add_request("x", [5], SamplingParams(max_new_tokens=2))


def test_good_requests_finish_next_to_failures(folder):
    model, path = folder
    engine = build_engine(path, num_blocks=32, block_size=4, max_model_len=64)
    ps = prompts([6, 9])
    engine.add_request("a", ps[0], SamplingParams(max_new_tokens=8, ignore_eos=True))
    for bad in ([], list(range(3, 80))):
        with pytest.raises(RequestError):
            engine.add_request("b", bad, SamplingParams())
    outs, final = _run(engine, [("c", ps[1], SamplingParams(max_new_tokens=8, ignore_eos=True))])
    assert outs["a"] == hf_greedy(model, ps[0], 8) and outs["c"] == hf_greedy(model, ps[1], 8)
    assert final["a"].finish_reason == "length"


def test_seeded_sampling_reproducible_across_batches(folder):
    _, path = folder
    sp = SamplingParams(max_new_tokens=10, do_sample=True, temperature=0.9, top_k=50, top_p=0.9, seed=1234,
                        ignore_eos=True)
    p = prompts([8])[0]
    alone = build_engine(path, num_blocks=64, block_size=4).generate([p], sp)[0]
    # the same request among others (different prompts, greedy and sampled), with chunking and a
    # cache small enough to preempt
    engine = build_engine(path, num_blocks=12, block_size=4, max_num_batched_tokens=5)
    others = prompts([15, 3, 11], seed=9)
    mixed = engine.generate(others[:2] + [p] + others[2:],
                            [SamplingParams(max_new_tokens=10, do_sample=True, seed=7, ignore_eos=True),
                             SamplingParams(max_new_tokens=10, ignore_eos=True), sp,
                             SamplingParams(max_new_tokens=10, do_sample=True, ignore_eos=True)])
    assert mixed[2] == alone
    again = build_engine(path, num_blocks=64, block_size=4).generate([p], sp)[0]
    assert again == alone
    other_seed = build_engine(path, num_blocks=64, block_size=4).generate(
        [p], SamplingParams(max_new_tokens=10, do_sample=True, temperature=0.9, seed=99, ignore_eos=True))[0]
    assert other_seed != alone
    # temperature 0 with do_sample is greedy
    greedy = build_engine(path, num_blocks=64, block_size=4).generate(
        [p], SamplingParams(max_new_tokens=10, do_sample=True, temperature=0.0, ignore_eos=True))[0]
    assert greedy == build_engine(path, num_blocks=64, block_size=4).generate(
        [p], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]


def test_stop_tokens_strings_min_new_tokens_eos(folder):
    model, path = folder
    p = prompts([10])[0]
    ref = hf_greedy(model, p, 12)
    engine = build_engine(path, num_blocks=64, block_size=4)
    stop_tok = ref[4]
    first = ref.index(stop_tok)
    outs, final = _run(engine, [("t", p, SamplingParams(max_new_tokens=12, stop_token_ids=(stop_tok,)))])
    assert outs["t"] == ref[:first + 1] and final["t"].finish_reason == "stop" and final["t"].stop_reason == stop_tok
    text = engine.tokenizer.decode(ref)
    stop_str = engine.tokenizer.decode(ref[5:7])
    outs, final = _run(engine, [("s", p, SamplingParams(max_new_tokens=12, stop=(stop_str,)))])
    assert final["s"].stop_reason == stop_str and stop_str in engine.tokenizer.decode(outs["s"])
    assert text.startswith(engine.tokenizer.decode(outs["s"]))
    # min_new_tokens keeps a stop token from ending generation early
    outs, final = _run(engine, [("m", p, SamplingParams(max_new_tokens=12, stop_token_ids=(stop_tok,),
                                                        min_new_tokens=first + 2))])
    assert len(outs["m"]) > first + 1 and outs["m"][:first] == ref[:first]
    assert stop_tok not in outs["m"][:first + 2]
    # EOS ends a request unless ignore_eos (EOS id made a likely token by stopping on ref's token)
    engine.eos_token_ids = [stop_tok]
    outs, final = _run(engine, [("e", p, SamplingParams(max_new_tokens=12)),
                                ("i", p, SamplingParams(max_new_tokens=12, ignore_eos=True))])
    assert outs["e"] == ref[:first + 1] and outs["i"] == ref


def test_logprobs(folder):
    _, path = folder
    engine = build_engine(path, num_blocks=64, block_size=4)
    engine.add_request("l", prompts([5])[0], SamplingParams(max_new_tokens=3, logprobs=2, ignore_eos=True))
    o = engine.step()[0]
    assert len(o.new_logprobs) == 1 and o.new_logprobs[0] <= 0
    top = o.new_top_logprobs[0]
    assert len(top) == 2 and max(top.values()) == pytest.approx(o.new_logprobs[0])  # greedy: chosen is top


def test_abort_frees_blocks(folder):
    _, path = folder
    engine = build_engine(path, num_blocks=16, block_size=4)
    engine.add_request("a", prompts([9])[0], SamplingParams(max_new_tokens=20))
    engine.add_request("b", prompts([9], seed=3)[0], SamplingParams(max_new_tokens=20))
    engine.step()
    assert engine.stats().num_blocks_free < 16
    assert engine.abort("a") and engine.abort("b") and not engine.abort("a")
    assert engine.stats().num_blocks_free == 16 and not engine.has_unfinished() and engine.step() == []


def test_prefix_sharing_and_copy_on_write(folder):
    model, path = folder
    shared = prompts([16], seed=11)[0]  # four full blocks of 4
    tails = prompts([3, 5], seed=12)
    engine = build_engine(path, num_blocks=64, block_size=4)
    a = shared + tails[0]
    first = engine.generate([a], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert first == hf_greedy(model, a, 6)
    # a later request with the same 16-token prefix finds its blocks (kept in the free list, hashed)
    b = shared + tails[1]
    assert engine.generate([b], SamplingParams(max_new_tokens=6, ignore_eos=True))[0] == hf_greedy(model, b, 6)
    assert engine.stats().extra["prefix_cache_hit_blocks"] == 4
    # two concurrent requests with the same block-aligned prompt: the second shares every block and
    # recomputes the last token into a copy of the last block (copy-on-write)
    engine.add_request("x", shared, SamplingParams(max_new_tokens=6, ignore_eos=True))
    outs = {"x": engine.step()[0].new_token_ids, "y": []}
    engine.add_request("y", shared, SamplingParams(max_new_tokens=6, ignore_eos=True))
    seq_x, seq_y = engine._seqs["x"], engine._seqs["y"]
    hits = engine.stats().extra["prefix_cache_hit_blocks"]
    for o in engine.step():
        outs[o.request_id].extend(o.new_token_ids)
    assert engine.stats().extra["prefix_cache_hit_blocks"] == hits + 4
    assert seq_y.blocks[:3] == seq_x.blocks[:3]  # shared
    assert seq_y.blocks[3] != seq_x.blocks[3]  # copied on write before the last prompt token was rewritten
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
    ref = hf_greedy(model, shared, 6)
    assert outs == {"x": ref, "y": ref}
    assert engine.stats().num_blocks_free == 64


def test_batched_sampler_draws_the_filtered_distribution():
    """The sampler's inverse-CDF draw (one uniform per row from the row's own generator, softmax / cumsum / search
    batched over the sampled rows) follows temperature, top-k and top-p, never picks a zero-probability token, and
    a row's tokens do not depend on the other rows of its batch."""
    from types import SimpleNamespace

    import torch

    from zerospeed.inference.sampling import _draw, make_generator

    logits = torch.tensor([1.0, 0.5, -1.0, float("-inf"), 2.0, 0.0])
    n = 4000
    cases = [(SamplingParams(do_sample=True, temperature=0.7), (logits / 0.7).softmax(-1)),
             (SamplingParams(do_sample=True, top_k=2), torch.tensor([1.0, 0, 0, 0, 2.0, 0]).exp() * (logits > 0.9)),
             (SamplingParams(do_sample=True, top_p=0.6), torch.tensor([1.0, 0, 0, 0, 2.0, 0]).exp() * (logits > 0.9))]
    for params, expected in cases:
        rows = [SimpleNamespace(params=params, generator=make_generator(i)) for i in range(n)]
        counts = torch.bincount(torch.tensor(_draw(logits.repeat(n, 1), rows)), minlength=6).float() / n
        assert counts[3] == 0 and torch.allclose(counts, expected / expected.sum(), atol=0.03), (params, counts)
    x = torch.randn(3, 50)
    mixed = [SimpleNamespace(params=SamplingParams(do_sample=True, temperature=t), generator=make_generator(s))
             for s, t in ((1, 1.0), (2, 0.5), (3, 1.3))]
    alone = SimpleNamespace(params=SamplingParams(do_sample=True, temperature=0.5), generator=make_generator(2))
    assert _draw(x.clone(), mixed)[1] == _draw(x[1:2].clone(), [alone])[0]


def test_sampler_draw_near_one_stays_on_a_kept_token(monkeypatch):
    """A uniform draw just below 1 whose product with the total rounds up to it in float32 must still land on a
    token top-k kept, not run past the last one onto a filtered token at the end of the vocabulary."""
    from types import SimpleNamespace

    import torch

    from zerospeed.inference import sampling

    real_rand = torch.rand
    monkeypatch.setattr(sampling.torch, "rand",
                        lambda *a, **k: torch.tensor([1.0 - 2.0 ** -53], dtype=torch.float64)
                        if k.get("dtype") == torch.float64 else real_rand(*a, **k))
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.1, 0.0]])
    row = SimpleNamespace(params=SamplingParams(do_sample=True, top_k=2), generator=None)
    assert sampling._draw(logits.clone(), [row]) == [1]  # the last kept token, not index 4
