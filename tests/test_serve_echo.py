"""``zerospeed serve`` for scoring clients (issue #31): ``echo`` with ``logprobs`` (lm-eval's
loglikelihood request shape: token-id prompts, ``echo=true``, ``logprobs=1``, ``max_tokens=1``),
``max_tokens=0`` scoring, vLLM's ``prompt_logprobs``, the tokenizer endpoints, ``/v1/models/{id}``,
OpenAI-format 404/405 bodies, ``context_length_exceeded`` and the 4xx counters.

Logprobs are compared with HF's log_softmax of the same model at 1e-4 (see
tests/test_serve_prompt_logprobs.py for the float32 reasoning)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from serve_cases import ServerProcess, build_model_dir, serve_argv

pytestmark = pytest.mark.timeout(180)
ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("serve_echo") / "tiny-llama", max_position_embeddings=64)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerProcess(serve_argv(model_dir, "--served-model-name", "tiny", "--num-blocks", "64",
                                   "--block-size", "8", "--max-model-len", "64"))
    yield srv
    assert srv.stop() == 0, srv.output


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def hf_logprobs(hf, ids):
    with torch.no_grad():
        lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist(), lp


def test_lm_eval_loglikelihood_shape_matches_hf(server, hf):
    prompts = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 60, 70, 80]]
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": prompts, "temperature": 0,
                                         "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for ids, c in zip(prompts, choices):
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1 == len(lp["token_logprobs"]) == len(lp["text_offset"])
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref, full = hf_logprobs(hf, ids)
        assert torch.allclose(torch.tensor(lp["token_logprobs"][1:len(ids)]), torch.tensor(ref), atol=ATOL)
        # the generated token is the greedy one, and its logprob is HF's at the last position
        assert abs(lp["token_logprobs"][-1] - float(full[-1].max())) < ATOL
        for tok, x, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            assert top[tok] == x and 1 <= len(top) <= 2  # the chosen token, plus the best one
        # offsets: each token's text, in turn, from 0
        off = 0
        for tok, o in zip(lp["tokens"], lp["text_offset"]):
            assert o == off
            off += len(tok)
        assert c["text"] == "".join(lp["tokens"])


def test_max_tokens_0_scores_only_and_prompt_logprobs(server, hf):
    ids = [1, 7, 8, 9, 10, 11]
    r = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0,
                                         "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    c = body["choices"][0]
    assert body["usage"]["completion_tokens"] == 0 and c["finish_reason"] == "length"
    assert len(c["logprobs"]["tokens"]) == len(ids)
    ref, _ = hf_logprobs(hf, ids)
    assert torch.allclose(torch.tensor(c["logprobs"]["token_logprobs"][1:]), torch.tensor(ref), atol=ATOL)
    assert all(len(t) == 1 for t in c["logprobs"]["top_logprobs"][1:])  # logprobs=0: the chosen token
    pl = c["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    for j, entry in enumerate(pl[1:], start=1):
        assert abs(entry[str(ids[j])]["logprob"] - ref[j - 1]) < ATOL
        assert 2 <= len(entry) <= 3
    # echo without logprobs and max_tokens=0: the prompt's text, nothing generated
    r = post(server, "/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 0, "echo": True})
    assert r.json()["choices"][0]["text"] == "The quick brown fox"
    # max_tokens=0 without echo or prompt_logprobs is still an error naming the field
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_streamed_echo_matches_the_non_streamed_answer(server):
    body = {"prompt": "Knowledge is power.", "max_tokens": 5, "echo": True, "logprobs": 1,
            "temperature": 0}
    full = post(server, "/v1/completions", body).json()["choices"][0]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    text, tokens, lps, offsets = "", [], [], []
    for chunk in client.completions.create(model="tiny", stream=True, **body):
        ch = chunk.choices[0]
        text += ch.text
        if ch.logprobs:
            tokens += ch.logprobs.tokens
            lps += ch.logprobs.token_logprobs
            offsets += ch.logprobs.text_offset
    assert text == full["text"]
    assert tokens == full["logprobs"]["tokens"] and offsets == full["logprobs"]["text_offset"]
    assert lps[0] is None and lps[1:] == full["logprobs"]["token_logprobs"][1:]


def test_tokenizer_endpoints_and_model_card(server, model_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    r = post(server, "/tokenize", {"prompt": "Time flies", "add_special_tokens": False})
    assert r.json()["tokens"] == tok.encode("Time flies", add_special_tokens=False).ids
    assert r.json()["count"] == len(r.json()["tokens"]) and r.json()["max_model_len"] == 64
    with_bos = post(server, "/tokenize", {"prompt": "Time flies"}).json()["tokens"]
    assert with_bos == tok.encode("Time flies").ids
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 3
    assert post(server, "/detokenize", {"tokens": with_bos}).json()["prompt"] == "Time flies"
    info = httpx.get(server.url + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>" and info["chat_template"]
    assert httpx.get(server.url + "/v1/models/tiny", timeout=30).json()["id"] == "tiny"
    r = httpx.get(server.url + "/v1/models/other", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for body, param in (({}, "prompt"), ({"prompt": "a", "messages": []}, "prompt"),
                        ({"prompt": 3}, "prompt")):
        r = post(server, "/tokenize", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = post(server, "/detokenize", {"tokens": ["a"]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tokens")


def test_error_shapes_and_4xx_counted(server):
    def count(status):
        text = httpx.get(server.url + "/metrics", timeout=30).text
        line = f'zerospeed_requests_rejected_total{{status="{status}"}} '
        return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(line))

    c404, c405, c400 = count(404), count(405), count(400)
    r = httpx.get(server.url + "/v1/nothing", timeout=30)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(server.url + "/v1/completions", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = post(server, "/v1/completions", {"prompt": list(range(6, 70)), "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "64 tokens" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {"prompt": [6, 7], "max_tokens": 63})
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert "(2 tokens)" in err["message"] and "(63)" in err["message"]
    r = post(server, "/v1/completions", {"prompt": "x", "temperature": "hot"})  # pydantic validation
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert count(404) == c404 + 1 and count(405) == c405 + 1 and count(400) == c400 + 3
