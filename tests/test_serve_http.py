"""``zerospeed serve`` over real HTTP: the command in a subprocess on a free loopback port, driven by
the official ``openai`` client (completions and chat, streaming and not), ``httpx`` for the error
cases and the API key, greedy output identical to ``pipeline()``, and a bounded load test (64
concurrent streams from 16 client tasks) after which every KV block is free again. The command's
engine flags (KV-cache bytes, block size, context) are checked on the same model through
``serve()`` in this process.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from serve_cases import ServerProcess, build_model_dir, metric, serve_argv

KEY = "sk-test-zerospeed"
MODEL = "tiny"
NUM_BLOCKS = 48
BLOCK_SIZE = 8
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("serve_http") / "tiny-llama")


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerProcess(serve_argv(model_dir, "--api-key", KEY, "--served-model-name", MODEL,
                                   "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
                                   "--max-num-seqs", "24"))
    yield srv
    status = srv.stop()
    assert status == 0, srv.output


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def _http(server, method, path, key=KEY, headers=None, **kw):
    headers = dict(headers or {}, **({"Authorization": f"Bearer {key}"} if key else {}))
    return httpx.request(method, server.url + path, headers=headers, timeout=30, **kw)


def test_models_health_and_api_key(server):
    r = _http(server, "GET", "/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [MODEL]
    assert _http(server, "GET", "/health", key=None).status_code == 200
    for key in (None, "sk-wrong"):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
            r = _http(server, method, path, key=key, json={"model": MODEL, "prompt": "hi"})
            assert r.status_code == 401, (key, path)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and "api key" in err["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_completion_streaming_and_not_agree(client, tokenizer):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=10, temperature=0,
              logprobs=1, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    prompt_ids = tokenizer.encode("The quick brown fox").ids  # BOS from the post-processor
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.completion_tokens == 10 and full.usage.total_tokens == len(prompt_ids) + 10
    assert full.id.startswith("cmpl-") and full.model == MODEL and choice.text

    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    # held-back text never loses a token's log-probability: chunks carry them all, in order
    streamed = [(t, lp) for c in chunks if c.choices
                for t, lp in zip(c.choices[0].logprobs.tokens, c.choices[0].logprobs.token_logprobs)]
    assert len(streamed) == 10
    assert [t for t, _ in streamed] == choice.logprobs.tokens
    assert [lp for _, lp in streamed] == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)
    assert len({c.id for c in chunks}) == 1


def test_chat_streaming_and_not_agree(client, tokenizer):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Où est la gare?"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
    # the template from tokenizer_config.json, rendered; its BOS text is not added twice
    rendered = ("<s><|system|>You are terse.</s><|user|>Où est la gare?</s><|assistant|>")
    assert full.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False).ids)
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 8

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == \
        full.usage.prompt_tokens


def test_greedy_output_matches_pipeline_and_hf_generate(client, model_dir, tokenizer):
    import torch
    from transformers import LlamaForCausalLM

    from zerospeed.inference import pipeline

    prompts = ["To be or not to be", "Knowledge is power. Time", "東京は"]
    expected = pipeline(str(model_dir))(prompts, max_new_tokens=12, ignore_eos=True)
    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for prompt, ref in zip(prompts, expected):
        ids = tokenizer.encode(prompt).ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12,
                                 do_sample=False, pad_token_id=0)
        assert ref.generated_tokens == out[0, len(ids):].tolist()  # the reference agrees with HF
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                      logprobs=2, extra_body={"ignore_eos": True})
        c = r.choices[0]
        assert c.text == ref.generated_text
        assert c.logprobs.tokens == [tokenizer.decode([t]) for t in ref.generated_tokens]
        assert r.usage.completion_tokens == ref.generated_length == 12
        assert r.usage.prompt_tokens == ref.prompt_length == len(ids)
        for lp, top in zip(c.logprobs.token_logprobs, c.logprobs.top_logprobs):
            assert lp <= 0 and 1 <= len(top) <= 2 and max(top.values()) >= lp - 1e-5  # greedy: best


def test_seed_stop_and_token_prompts(client, tokenizer):
    kw = dict(model=MODEL, prompt="A journey of", max_tokens=12, temperature=1.0, top_p=0.9,
              extra_body={"ignore_eos": True, "top_k": 50})
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    assert a == b
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (8, 9, 10)}
    assert others - {a}, "different seeds all gave the seed-7 text"

    greedy = client.completions.create(model=MODEL, prompt="A journey of", max_tokens=12,
                                       temperature=0, extra_body={"ignore_eos": True})
    text = greedy.choices[0].text
    stop = text[4:7]
    cut = client.completions.create(model=MODEL, prompt="A journey of", max_tokens=12,
                                    temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="A journey of", max_tokens=12, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == text[:text.index(stop)]

    ids = tokenizer.encode("A journey of").ids
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == text
    two = client.completions.create(model=MODEL, prompt=["A journey of", "The early bird"],
                                    max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].text == text[:len(two.choices[0].text)]
    assert two.usage.completion_tokens == 10


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "fox " * 400}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**6]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "fox " * 400}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 65}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 10**5}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function"}]}, 400, "tools[0]"),
])
def test_bad_requests_name_the_field(server, path, body, status, param):
    r = _http(server, "POST", path, json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err


def test_invalid_json_and_server_still_serves(server, client):
    r = _http(server, "POST", "/v1/completions", content=b"{not json",
              headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", n=100)
    assert e.value.body["param"] == "n"
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 3


def test_engine_flags_size_the_kv_cache_and_the_context(model_dir):
    """--kv-cache-memory / --block-size / --max-model-len / --max-num-seqs, parsed by the command,
    reach the engine: the block count is the bytes over the bytes of one block, and a prompt the
    model could take but the shorter context cannot is a 400 naming the prompt."""
    from zerospeed.inference import serve
    from zerospeed.inference.serving.cli import build_parser, engine_kwargs

    # the module's model: 2 layers, 2 KV heads of 8, fp32, 128 positions; served in this process
    args = build_parser().parse_args([str(model_dir), "--kv-cache-memory", "64KiB",
                                      "--block-size", "8", "--max-model-len", "64",
                                      "--max-num-seqs", "3"])
    kwargs = engine_kwargs(args)
    assert kwargs == {"kv_cache_memory": 65536, "block_size": 8, "max_model_len": 64,
                      "max_num_seqs": 3}
    latency = build_parser().parse_args([str(model_dir), "--max-prefill-tokens-with-decodes", "none",
                                         "--no-prefill-first"])
    assert engine_kwargs(latency) == {"max_prefill_tokens_with_decodes": None, "prefill_first": False}
    assert engine_kwargs(build_parser().parse_args([str(model_dir), "--max-prefill-tokens-with-decodes", "4"])) \
        == {"max_prefill_tokens_with_decodes": 4}
    knobs = engine_kwargs(build_parser().parse_args([str(model_dir), "--max-prefill-tokens-with-decodes", "4",
                                                     "--max-decode-kv-bytes", "8KiB"]))
    assert knobs == {"max_prefill_tokens_with_decodes": 4, "max_decode_kv_bytes": 8192}
    for text, want in (("none", None), ("auto", "auto")):
        args_kv = build_parser().parse_args([str(model_dir), "--max-decode-kv-bytes", text])
        assert engine_kwargs(args_kv)["max_decode_kv_bytes"] == want
    block_bytes = 2 * 2 * 2 * 8 * 4 * 8  # layers x (K, V) x KV heads x head_dim x fp32 x block
    with serve(model_dir, port=0, **kwargs, **knobs) as handle:  # the latency knobs reach the engine too
        ok = httpx.post(handle.url + "/v1/completions", timeout=30, json={
            "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        m = httpx.get(handle.url + "/metrics", timeout=10).text
        assert metric(m, "zerospeed_kv_blocks_free") == 65536 // block_bytes == 32
        assert metric(m, "zerospeed_kv_blocks_used") == 0
        models = httpx.get(handle.url + "/v1/models", timeout=10).json()
        assert models["data"][0]["max_model_len"] == 64
        long = httpx.post(handle.url + "/v1/completions", timeout=30, json={
            "prompt": [10] * 70, "max_tokens": 4})  # fits the model's 128, not the 64 asked for
        assert long.status_code == 400 and long.json()["error"]["param"] == "prompt"
        assert "64" in long.json()["error"]["message"]


def test_load_64_concurrent_streams_from_16_tasks(server, client):
    prompts = [f"Serving request number {i} over HTTP" for i in range(8)]
    max_tokens = 8
    expected = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=max_tokens,
                                             temperature=0, extra_body={"ignore_eos": True})
                .choices[0].text for p in prompts}
    before = httpx.get(server.url + "/metrics").text
    tokens_before = metric(before, "zerospeed_generation_tokens_total")

    async def one(aclient, k):
        prompt = prompts[k % len(prompts)]
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        ids, text, finish, usage = set(), "", None, None
        async for chunk in stream:
            ids.add(chunk.id)
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        assert len(ids) == 1
        return k, ids.pop(), prompt, text, finish, usage

    async def task(t):
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=60,
                                      max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, t * 4 + j) for j in range(4)))

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(task(t) for t in range(16))), 100)

    results = [r for group in asyncio.run(main()) for r in group]
    assert sorted(r[0] for r in results) == list(range(64))  # none lost, none duplicated
    assert len({r[1] for r in results}) == 64
    for k, _, prompt, text, finish, usage in results:
        assert finish == "length" and usage.completion_tokens == max_tokens, k
        assert text == expected[prompt], (k, prompt)  # batching changes no greedy token
    after = httpx.get(server.url + "/metrics").text
    assert metric(after, "zerospeed_generation_tokens_total") - tokens_before == 64 * max_tokens
    assert metric(after, "zerospeed_kv_blocks_used") == 0
    assert metric(after, "zerospeed_kv_blocks_free") == NUM_BLOCKS
    assert metric(after, "zerospeed_requests_running") == 0
    assert metric(after, "zerospeed_requests_waiting") == 0
    assert metric(after, "zerospeed_time_to_first_token_seconds_count") >= 64
    assert metric(after, "zerospeed_inter_token_latency_seconds_count") >= 64 * (max_tokens - 1)
    assert json.loads(_http(server, "GET", "/health", key=None).text) == {"status": "ok"}
