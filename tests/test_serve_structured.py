"""Structured output (issue #31): ``response_format`` json_object / json_schema and vLLM's
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` through llguidance; the
mask is applied in the engine's sampler, batched over every guided row of a forward. Every response
parses (and validates against its schema), greedy or sampled, whatever else shares the batch."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest

from serve_cases import ServerProcess, build_model_dir, serve_argv

pytestmark = pytest.mark.timeout(180)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "color", "size"],
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                         "size": {"type": "integer", "minimum": 0, "maximum": 99}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_model_dir(tmp_path_factory.mktemp("serve_structured") / "tiny-llama")
    srv = ServerProcess(serve_argv(model_dir, "--served-model-name", "tiny", "--num-blocks", "96",
                                   "--block-size", "8"))
    yield srv
    assert srv.stop() == 0, srv.output


def valid(obj):
    assert set(obj) == {"ok", "color", "size"} and isinstance(obj["ok"], bool)
    assert obj["color"] in ("red", "green", "blue") and isinstance(obj["size"], int) and 0 <= obj["size"] <= 99


def test_json_schema_through_the_openai_client_always_parses(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}

    async def main():
        chats = [client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"thing {i}"}], max_tokens=60,
            temperature=0 if i == 0 else 1.2, seed=i, response_format=fmt) for i in range(6)]
        free = [client.completions.create(model="tiny", prompt="free", max_tokens=20, temperature=1.0,
                                          seed=9)]  # an unguided request in the same batches
        objects = [client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "obj"}], max_tokens=60, seed=3,
            response_format={"type": "json_object"}, n=2)]
        return await asyncio.gather(*chats, *free, *objects)

    *chats, free, obj = asyncio.run(main())
    for r in chats:
        assert r.choices[0].finish_reason == "stop"
        valid(json.loads(r.choices[0].message.content))
    assert free.choices[0].text
    for c in obj.choices:
        assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict)


def test_guided_regex_choice_grammar_and_streaming(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    r = client.completions.create(model="tiny", prompt="id:", max_tokens=20, temperature=1.0, seed=1,
                                  extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt="answer:", max_tokens=20, n=3, temperature=1.5, seed=2,
                                  extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert all(c.text in ("yes", "no", "maybe") for c in r.choices)
    r = client.completions.create(model="tiny", prompt="g:", max_tokens=20, temperature=1.0, seed=4,
                                  extra_body={"guided_grammar": 'start: "a" ("b" | "c")+ "d"'})
    text = r.choices[0].text
    assert re.fullmatch(r"a[bc]+d", text) or (r.choices[0].finish_reason == "length" and re.fullmatch(r"a[bc]+", text))
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "s"}], max_tokens=60, stream=True, seed=5,
        extra_body={"guided_json": SCHEMA}))
    valid(json.loads(text))


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}}, "response_format"),
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_grammar": "start: ("}, "guided_grammar"),
])
def test_bad_structured_output_requests_name_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("vocab_size", [300, 301])  # a whole number of 32-bit words, and a partial last word
def test_batched_mask_refuses_exactly_what_each_matcher_refuses(tmp_path, vocab_size):
    """Guides.mask (bitmask bytes -> table of additive 0 / -inf terms -> one index_add_) against
    llguidance's own per-matcher logit bias, on guided rows that are not contiguous in the batch;
    unguided rows and allowed entries keep their exact values."""
    import torch

    from serve_cases import build_tokenizer
    from zerospeed.inference.constraints import Guides, grammar_for

    tok = build_tokenizer(tmp_path, vocab_size=300)
    guides = Guides(tok, vocab_size, [tok.token_to_id("</s>")])
    matchers = [guides.matcher(grammar_for("choice", ["red", "green", "blue"])),
                guides.matcher(grammar_for("json_schema", SCHEMA)),
                guides.matcher(grammar_for("regex", r"[0-9]{2,4}"))]
    for t in tok.encode('{"ok": ', add_special_tokens=False).ids:
        assert matchers[1].try_consume_tokens([t]) == 1
    logits = torch.randn(5, vocab_size, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    rows = [4, 0, 2]
    guides.mask(logits, rows, matchers)
    for row, m in zip(rows, matchers):
        bias = m.compute_logit_bias()  # one byte per token: non-zero where allowed
        allowed = torch.tensor([bias[t] != 0 for t in range(vocab_size)])
        assert 0 < int(allowed.sum()) < vocab_size
        assert torch.equal(logits[row][allowed], before[row][allowed])
        assert bool((logits[row][~allowed] == float("-inf")).all())
    for row in (1, 3):
        assert torch.equal(logits[row], before[row])
