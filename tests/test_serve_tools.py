"""Tool calling (issue #31): ``tools`` / ``tool_choice`` on chat completions, with a chat template
that supports tools. A named function or "required" constrains the reply with the tool's parameters
schema (structured output), so the call always parses; "auto" parses ``<tool_call>`` blocks or a
bare call object from free text. A call round-trips through the ``openai`` client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from serve_cases import ServerProcess, build_model_dir, serve_argv
from zerospeed.inference.serving.tools import ToolPlan, parse_calls

pytestmark = pytest.mark.timeout(180)

TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}"
    "{% endfor %}{{ eos_token }}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|user|>result {{ m['content'] }}{{ eos_token }}"
    "{% elif m.get('tool_calls') %}<|assistant|>{% for c in m['tool_calls'] %}<tool_call>"
    "{{ c['function']['name'] }} {{ c['function']['arguments'] }}</tool_call>{% endfor %}{{ eos_token }}"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "required": ["zone"], "properties": {"zone": {"enum": ["UTC", "JST"]}}}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_model_dir(tmp_path_factory.mktemp("serve_tools") / "tiny-llama")
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOL_TEMPLATE
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    srv = ServerProcess(serve_argv(model_dir, "--served-model-name", "tiny", "--num-blocks", "96",
                                   "--block-size", "8"))
    yield srv
    assert srv.stop() == 0, srv.output


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_named_tool_call_round_trips(client):
    messages = [{"role": "user", "content": "weather in Paris?"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME], max_tokens=60,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       seed=1)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Tokyo") and 1 <= args["days"] <= 7
    # the call and its result go back to the model through the template
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME], max_tokens=8,
                                       tool_choice="none")
    assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)


def test_required_and_streamed_calls(client):
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}],
                                           tools=[WEATHER, TIME], tool_choice="required", max_tokens=60,
                                           temperature=1.0, seed=seed)
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name in ("get_weather", "get_time")
        json.loads(call.function.arguments)
    calls, finish = [], None
    for chunk in client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "time?"}], tools=[TIME], stream=True,
            tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=40):
        delta = chunk.choices[0].delta
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls[0].function.name == "get_time" and calls[0].index == 0
    assert json.loads(calls[0].function.arguments)["zone"] in ("UTC", "JST")
    # auto with a model that writes no call: plain content
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       tools=[TIME], max_tokens=6, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_auto_parses_the_layouts_templates_teach():
    plan = ToolPlan([WEATHER], ["get_weather"], "auto")
    content, calls = parse_calls('Let me check.<tool_call>{"name": "get_weather", "arguments": '
                                 '{"city": "Tokyo", "days": 2}}</tool_call>', plan)
    assert content == "Let me check." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Tokyo", "days": 2}
    content, calls = parse_calls('{"name": "get_weather", "parameters": {"city": "Paris", "days": 1}}', plan)
    assert content is None and json.loads(calls[0]["function"]["arguments"])["city"] == "Paris"
    assert parse_calls('{"name": "unknown", "arguments": {}}', plan) == ('{"name": "unknown", "arguments": {}}', [])
    assert parse_calls("just text", plan) == ("just text", [])


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}]}, "messages[1].tool_call_id"),
])
def test_tool_errors_name_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
