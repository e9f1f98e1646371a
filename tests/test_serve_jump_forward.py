"""Jump-forward for structured output (issue #31): the tokens a grammar forces after a sampled token (llguidance's
fast-forward tokens: JSON keys, quotes, separators) are appended without a forward, mask or draw of their own, and
their K/V is computed with the next sampled token's. The output must be exactly what masked sampling gives:

- every forced token is the only token the matcher's mask allows at its position, and the forced run continues
  token by token (checked on states reached by random allowed tokens, so not only on one model's choices);
- the engine's tokens with jump-forward equal its tokens without (``Guides.jump_forward = False``: every token
  masked and sampled), greedy and seeded sampling alike, in fewer forwards;
- max_new_tokens cuts a forced run; a request with logprobs gets no jump-forward (every token has its logprob).
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from serve_cases import build_model_dir
from zerospeed.inference.api import SamplingParams
from zerospeed.inference.constraints import grammar_for
from zerospeed.inference.build import build_engine

pytestmark = pytest.mark.timeout(180)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "color", "size", "tags"],
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                         "size": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 5}}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("jump_forward") / "tiny-llama")


def _grammars():
    return [grammar_for("json_schema", SCHEMA), grammar_for("regex", r"id-[0-9]{2}: (yes|no), done"),
            grammar_for("choice", ["alpha beta", "gamma"])]


def test_forced_tokens_are_the_only_tokens_the_mask_allows(model_dir):
    engine = build_engine(str(model_dir), num_blocks=32, block_size=8, max_model_len=128)
    guides, vocab = engine.guides, engine.spec.vocab_size
    rng = random.Random(0)
    checked = 0
    for grammar in _grammars():
        for _ in range(6):
            m = guides.matcher(grammar)
            for _ in range(60):
                if m.is_stopped():
                    break
                forced = guides.forced_tokens(m, 100)
                if forced:
                    probe = m.deep_copy()
                    for t in forced:  # each forced token is the single allowed one, in turn
                        bits = guides.bitmask([probe], vocab)[0]
                        allowed = [v for v in range(vocab) if (int(bits[v // 32]) >> (v % 32)) & 1]
                        assert allowed == [t]
                        probe.consume_token(t)
                        checked += 1
                bits = guides.bitmask([m], vocab)[0]
                m.consume_token(rng.choice([v for v in range(vocab) if (int(bits[v // 32]) >> (v % 32)) & 1]))
    assert checked > 20  # the grammars do force tokens (keys, separators)
    assert guides.forced_tokens(guides.matcher(_grammars()[0]), 2) == guides.forced_tokens(
        guides.matcher(_grammars()[0]), 100)[:2]


def _run(model_dir, jump: bool):
    """Tokens, forwards and computed prompt tokens of a mixed batch on a fresh engine."""
    engine = build_engine(str(model_dir), num_blocks=96, block_size=8, max_model_len=128)
    with torch.no_grad():  # flatter logits: this model's are so peaked that a seed would not change a sampled token
        engine.model.lm_head.weight.mul_(0.05)
    engine.guides.jump_forward = jump
    tok = engine.tokenizer
    grammars = _grammars()
    prompts = [tok.encode(f"request number {i} asks for something") for i in range(7)]
    params = [SamplingParams(max_new_tokens=90, temperature=0, guide=grammars[i % 3]) for i in range(3)]
    params += [SamplingParams(max_new_tokens=90, do_sample=True, temperature=1.0, seed=7 + i, guide=grammars[i % 3])
               for i in range(3)]
    params.append(SamplingParams(max_new_tokens=12, do_sample=True, temperature=1.0, seed=3))  # a free row in the same batches
    out = engine.generate(prompts, params)
    stats = engine.stats()
    return out, stats.extra["num_forwards"], stats.num_prompt_tokens, engine.tokenizer


def test_engine_tokens_equal_without_jump_forward_in_fewer_forwards(model_dir):
    plain, plain_forwards, plain_prompt, tok = _run(model_dir, False)
    jumped, jump_forwards, jump_prompt, _ = _run(model_dir, True)
    assert jumped == plain
    assert jump_forwards < plain_forwards
    # jump-forward's tokens are computed in chunks but are generated tokens, not prompt tokens
    assert jump_prompt == plain_prompt
    text = [tok.decode(t) for t in jumped]
    for i in (0, 3):
        obj = json.loads(text[i])
        assert obj["color"] in ("red", "green", "blue") and 0 <= obj["size"] <= 99
    assert text[2] in ("alpha beta", "gamma") and text[5] in ("alpha beta", "gamma")
    assert jumped[3:6] != jumped[:3]  # the sampled rows did sample (their grammars are the greedy rows')

def test_max_new_tokens_cuts_a_forced_run_and_logprobs_turn_it_off(model_dir):
    engine = build_engine(str(model_dir), num_blocks=64, block_size=8, max_model_len=128)
    tok = engine.tokenizer
    grammar = grammar_for("json_schema", SCHEMA)
    prompt = tok.encode("a short request")
    forced = engine.guides.forced_tokens(engine.guides.matcher(grammar), 100)
    assert len(forced) >= 3  # '{"ok": ' is forced after the first token
    engine.add_request("cut", prompt, SamplingParams(max_new_tokens=3, temperature=0, guide=grammar))
    engine.add_request("lp", prompt, SamplingParams(max_new_tokens=12, temperature=0, guide=grammar, logprobs=1))
    outs = {"cut": [], "lp": []}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    cut = [t for o in outs["cut"] for t in o.new_token_ids]
    assert len(cut) == 3 and outs["cut"][-1].finish_reason == "length"
    assert len(outs["cut"]) < 3  # forced tokens came with a sampled one, not one output each
    for o in outs["lp"]:  # with logprobs: one token per output, each with its logprob
        assert len(o.new_token_ids) == len(o.new_logprobs) == 1
    lp_tokens = [t for o in outs["lp"] for t in o.new_token_ids]
    assert lp_tokens[:3] == cut
    assert torch.tensor([o.new_logprobs[0] for o in outs["lp"]]).isfinite().all()


def test_forced_tokens_are_not_held_behind_a_burst_of_prompts(model_dir):
    """Prefill-first holds the last token of prompts while a burst is prefilled; a guided sequence whose forced
    tokens await their K/V is decoding, not a prompt: its next forward computes them and samples."""
    engine = build_engine(str(model_dir), num_blocks=96, block_size=8, max_model_len=128, max_num_batched_tokens=16)
    tok = engine.tokenizer
    grammar = grammar_for("json_schema", SCHEMA)
    engine.add_request("g", tok.encode("a short request"), SamplingParams(max_new_tokens=40, temperature=0,
                                                                         guide=grammar))
    for _ in range(20):
        if any(len(o.new_token_ids) > 1 for o in engine.step()):
            break
    assert engine._seqs["g"].num_remaining > 1  # forced tokens appended, their K/V not computed yet
    long_prompt = (tok.encode("request number 7 asks for something") * 4)[:30]
    for i in range(3):
        engine.add_request(f"p{i}", long_prompt, SamplingParams(max_new_tokens=2))
    assert any(o.request_id == "g" for o in engine.step())
