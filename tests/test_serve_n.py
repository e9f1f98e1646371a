"""OpenAI's ``n`` and ``best_of`` (issue #31): sequences forked from one prompt share its KV blocks
(engine ``add_request(fork_of=)``, copy-on-write through the scheduler), and ``best_of`` ranks by
cumulative logprob."""

from __future__ import annotations

import httpx
import pytest

from serve_cases import ServerProcess, build_model_dir, serve_argv
from zerospeed.inference.api import RequestError, SamplingParams
from zerospeed.inference.build import build_engine

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("serve_n") / "tiny-llama")


def run(engine, ids):
    out = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


@pytest.mark.parametrize("prefill_first", [True, False])
def test_forks_share_the_prompt_blocks_once(model_dir, prefill_first):
    engine = build_engine(str(model_dir), block_size=8, num_blocks=64, max_num_batched_tokens=16,
                          enable_prefix_caching=False, prefill_first=prefill_first)
    calls = []
    allocate = engine.allocator.allocate
    engine.allocator.allocate = lambda: calls.append(1) or allocate()
    prompt = list(range(6, 39))  # 33 tokens: positions 0-31 fill 4 blocks, the last prompt token opens a 5th
    params = [SamplingParams(max_new_tokens=4, do_sample=True, temperature=2.0, seed=s, ignore_eos=True)
              for s in (1, 2, 3)]
    engine.add_request("a", prompt, params[0])
    engine.add_request("b", prompt, params[1], fork_of="a")
    engine.add_request("c", prompt, params[2], fork_of="a")
    out = run(engine, "abc")
    assert all(len(v) == 4 for v in out.values())
    assert len({tuple(v) for v in out.values()}) == 3  # three distinct sampled continuations
    # the parent allocates the prompt's 5 blocks (positions 0-36 fit in them); each fork only the block
    # of its own last prompt token + generated tokens: 5 + 2 x 1, not 3 x 5
    assert len(calls) == 7
    assert engine.allocator.num_free == engine.allocator.num_blocks
    # a fork samples what the same request alone would (its K/V is the parent's, bit for bit)
    engine.add_request("solo", prompt, params[1])
    assert run(engine, ["solo"])["solo"] == out["b"]


def test_fork_errors_and_abort(model_dir):
    engine = build_engine(str(model_dir), block_size=8, num_blocks=64)
    with pytest.raises(RequestError, match="fork_of"):
        engine.add_request("x", [6, 7, 8], SamplingParams(max_new_tokens=2), fork_of="nope")
    engine.add_request("p", [6, 7, 8], SamplingParams(max_new_tokens=2))
    with pytest.raises(RequestError, match="fork_of"):
        engine.add_request("x", [6, 7, 9], SamplingParams(max_new_tokens=2), fork_of="p")
    engine.add_request("f", [6, 7, 8], SamplingParams(max_new_tokens=2), fork_of="p")
    engine.abort("p")  # the fork goes on alone
    assert len(run(engine, ["f"])["f"]) == 2
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_n_and_best_of_over_http(model_dir):
    srv = ServerProcess(serve_argv(model_dir, "--num-blocks", "64", "--block-size", "8"))
    try:
        post = lambda body: httpx.post(srv.url + "/v1/completions", json=body, timeout=60)  # noqa: E731
        r = post({"prompt": ["Knowledge is", "Time flies"], "n": 3, "max_tokens": 6, "temperature": 1.5,
                  "seed": 7, "ignore_eos": True})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == list(range(6))
        assert len({c["text"] for c in choices[:3]}) == 3
        assert r.json()["usage"]["completion_tokens"] == 36
        r2 = post({"prompt": "Knowledge is", "n": 3, "max_tokens": 6, "temperature": 1.5, "seed": 7,
                   "ignore_eos": True})
        assert [c["text"] for c in r2.json()["choices"]] == [c["text"] for c in choices[:3]]
        # best_of: the n of best_of candidates with the highest cumulative logprob, best first
        r = post({"prompt": "Knowledge is", "n": 2, "best_of": 4, "max_tokens": 5, "temperature": 1.5,
                  "seed": 3, "logprobs": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        got = [sum(c["logprobs"]["token_logprobs"]) for c in r.json()["choices"]]
        every = post({"prompt": "Knowledge is", "n": 4, "max_tokens": 5, "temperature": 1.5, "seed": 3,
                      "logprobs": 0, "ignore_eos": True}).json()["choices"]
        ranked = sorted((sum(c["logprobs"]["token_logprobs"]) for c in every), reverse=True)
        assert got == pytest.approx(ranked[:2])
        chat = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 4, "seed": 1,
            "temperature": 1.5, "ignore_eos": True}).json()
        assert [c["index"] for c in chat["choices"]] == [0, 1]
        for body, param in (({"n": 0}, "n"), ({"n": 2, "best_of": 1}, "best_of"),
                            ({"best_of": 2, "stream": True}, "best_of"), ({"n": 200}, "n")):
            r = post(dict({"prompt": "x"}, **body))
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    finally:
        assert srv.stop() == 0, srv.output
