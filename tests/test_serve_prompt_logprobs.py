"""Prompt log-probabilities in the engine (issue #31): ``SamplingParams.prompt_logprobs`` scores every
prompt token from the same ragged forward that computes the prompt, chunk by chunk, and
``max_new_tokens=0`` scores without generating.

Reference: HF's ``log_softmax`` of the same model's float32 logits. Tolerance: the two compute the
same float32 logits by differently ordered sums (ragged paged attention vs HF's SDPA, GEMMs blocked
differently), so each logit differs by a few ulps of the largest intermediate; with this 2-layer model
the logits are O(10), whose float32 ulp is ~1e-6, and log_softmax adds the logsumexp's own rounding:
we allow 1e-4 absolute (about 100 ulps), far below the gap between any two candidate tokens a
scoring client compares (mean |logprob| here is ~5).
"""

from __future__ import annotations

import pytest
import torch

from serve_cases import build_model_dir
from zerospeed.inference.api import RequestError, SamplingParams
from zerospeed.inference.build import build_engine

pytestmark = pytest.mark.timeout(300)
ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("prompt_lp") / "tiny-llama")


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()


def hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0], lp


def run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params[i] if isinstance(params, list) else params)
    outs: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            outs[o.request_id].append(o)
    return [outs[f"r{i}"] for i in range(len(prompts))]


def test_prompt_logprobs_match_hf_in_chunks_and_score_only(model_dir, hf):
    # a token budget of 16 splits the 60-token prompt into 4 chunks; 5 blocks of 4 tokens hold the
    # prefix of the second identical prompt, which must still be scored (no prefix-cache skip)
    engine = build_engine(str(model_dir), block_size=4, num_blocks=96, max_num_batched_tokens=16,
                          max_num_seqs=4)
    g = torch.Generator().manual_seed(1)
    long = torch.randint(6, engine.spec.vocab_size, (60,), generator=g).tolist()
    short = torch.randint(6, engine.spec.vocab_size, (7,), generator=g).tolist()
    params = [SamplingParams(max_new_tokens=0, prompt_logprobs=3),
              SamplingParams(max_new_tokens=0, prompt_logprobs=0),
              SamplingParams(max_new_tokens=4, prompt_logprobs=1, logprobs=0)]
    outs = run(engine, [long, short, long], params)
    for prompt, p, out in zip([long, short, long], params, outs):
        first = out[0]
        assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(prompt)
        assert first.prompt_logprobs[0] is None and first.prompt_top_logprobs[0] is None
        assert all(o.prompt_logprobs is None for o in out[1:])  # sent once
        ref, full = hf_prompt_logprobs(hf, prompt)
        got = torch.tensor(first.prompt_logprobs[1:])
        assert torch.allclose(got, ref, atol=ATOL), (got - ref).abs().max()
        for i, top in enumerate(first.prompt_top_logprobs[1:]):
            assert len(top) == p.prompt_logprobs
            want = torch.topk(full[i], p.prompt_logprobs) if p.prompt_logprobs else None
            if want is not None:
                assert torch.allclose(torch.tensor(sorted(top.values(), reverse=True)), want.values, atol=ATOL)
        if p.max_new_tokens == 0:
            assert len(out) == 1 and out[0].finished and out[0].new_token_ids == []
            assert out[0].finish_reason == "length"
        else:
            assert sum(len(o.new_token_ids) for o in out) == 4
    assert engine.allocator.num_free == engine.allocator.num_blocks  # every block came back


def test_score_only_fills_the_context_and_bad_values_are_refused(model_dir):
    engine = build_engine(str(model_dir), block_size=4, num_blocks=64, max_model_len=32)
    out = run(engine, [list(range(6, 38))], SamplingParams(max_new_tokens=0, prompt_logprobs=0))[0]
    assert len(out[0].prompt_logprobs) == 32
    with pytest.raises(RequestError, match="max_new_tokens"):
        engine.add_request("x", [6, 7], SamplingParams(max_new_tokens=0))
    with pytest.raises(RequestError, match="prompt_logprobs"):
        engine.add_request("x", [6, 7], SamplingParams(prompt_logprobs=99))
    with pytest.raises(RequestError, match="prompt"):
        engine.add_request("x", list(range(6, 39)), SamplingParams(max_new_tokens=0, prompt_logprobs=0))
