"""Pieces of ``zerospeed serve`` without a server process: detokenisation with stop strings, the chat
template, request validation, the command's bad flags, and the Python API (``serve()`` in this
process, its handle, and a fault injected into the engine's step, which must fail only the
requests in that step while the server keeps serving).

A graceful stop whose timeout runs out cancels the request still in flight and frees its blocks.

The fault test drives ``serve(engine=...)`` with a small deterministic engine (``FakeEngine`` in
serve_cases.py) because a real engine offers no way to make one ``step()`` raise on purpose.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from serve_cases import CHAT_TEMPLATE, FakeEngine, build_tokenizer, metric
from zerospeed.inference.api import SamplingParams
from zerospeed.inference.serving.chat_template import ChatTemplate
from zerospeed.inference.serving.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from zerospeed.inference.serving.text import TextStream, TokenizerAdapter
from zerospeed.launcher.runner import main as launcher_main

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve_units")
    build_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def adapter(tok_dir):
    from tokenizers import Tokenizer

    return TokenizerAdapter(Tokenizer.from_file(str(tok_dir / "tokenizer.json")))


# -- text ----------------------------------------------------------------------------------------------


def _feed(stream: TextStream, ids: list[int]) -> list[str]:
    return [stream.add([t]) for t in ids]


def test_text_stream_holds_back_partial_characters_and_stop_prefixes(adapter):
    text = "Das ist gut. 東京は大きい"
    ids = adapter.encode(text, add_special_tokens=False)
    s = TextStream(adapter)
    deltas = _feed(s, ids) + [s.finish()]
    assert "".join(deltas) == text and s.text == text
    assert all("\ufffd" not in d for d in deltas)  # split UTF-8 characters are never sent

    s = TextStream(adapter, stops=["は大"])
    deltas = _feed(s, ids) + [s.finish()]
    assert "".join(deltas) == "Das ist gut. 東京" and s.stopped
    assert not any("は" in d for d in deltas)

    s = TextStream(adapter, stops=["gut. X"])  # a prefix that never completes is released
    deltas = _feed(s, ids)
    assert "".join(deltas) + s.finish() == text and not s.stopped


def test_tokenizer_adapter_accepts_id_list_tokenizers(adapter):
    class Wrapper:  # an engine tokenizer that returns plain lists and takes no kwargs
        def encode(self, text):
            return adapter.encode(text)

        def decode(self, ids):
            return adapter.decode(ids)

    w = TokenizerAdapter(Wrapper())
    assert w.encode("hello", add_special_tokens=False) == adapter.encode("hello")
    assert w.decode(adapter.encode("hello")) == "hello"


# -- chat template ---------------------------------------------------------------------------------


def test_chat_template_sources_and_errors(tok_dir, tmp_path):
    t = ChatTemplate.from_model_dir(tok_dir)
    assert t.adds_bos
    assert t.render([{"role": "user", "content": "hi"}]) == "<s><|user|>hi</s><|assistant|>"
    assert t.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == \
        "<s><|user|>hi</s>"
    with pytest.raises(ApiError) as e:
        t.render([{"role": "robot", "content": "hi"}])
    assert e.value.status == 400 and e.value.param == "messages" and "unknown role robot" in \
        e.value.message

    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "</s>"},
         "chat_template": [{"name": "tool_use", "template": "T"},
                           {"name": "default", "template": "{{ messages[0]['content'] }}{{ eos_token }}"}]}))
    named = ChatTemplate.from_model_dir(tmp_path)
    assert named.render([{"role": "user", "content": "x"}]) == "x</s>" and not named.adds_bos

    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert ChatTemplate.from_model_dir(tmp_path) is None
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    assert ChatTemplate.from_model_dir(tmp_path) is not None
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ValueError, match="chat_template: invalid jinja2"):
        ChatTemplate.from_model_dir(tmp_path)


# -- request validation ----------------------------------------------------------------------------


def test_openai_parameters_map_to_sampling_params():
    req = CompletionRequest(prompt="x", temperature=0, top_k=-1, stop="##", seed=3)
    req.check()
    p = req.sampling_params(5, None)
    assert p == SamplingParams(max_new_tokens=5, do_sample=False, temperature=1.0, top_k=0,
                               stop=("##",), seed=3)
    p = CompletionRequest(prompt="x", temperature=0.7, top_p=0.9, top_k=40, min_tokens=2,
                          ignore_eos=True, stop_token_ids=[5]).sampling_params(8, 0)
    assert (p.do_sample, p.temperature, p.top_p, p.top_k, p.min_new_tokens, p.ignore_eos,
            p.stop_token_ids, p.logprobs) == (True, 0.7, 0.9, 40, 2, True, (5,), 0)
    assert CompletionRequest(prompt="x").sampling_params(16, None).do_sample  # OpenAI default T=1
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert chat.template_messages() == [{"role": "user", "content": "ab"}]
    for bad, field in ((dict(min_tokens=9), "min_tokens"), (dict(top_k=-2), "top_k"),
                       (dict(frequency_penalty=0.5), "frequency_penalty"),
                       (dict(stream_options={"include_usage": True}), "stream_options")):
        req = CompletionRequest(prompt="x", **bad)
        with pytest.raises(ApiError) as e:
            req.check()
            req.sampling_params(8, None)
        assert e.value.param == field and e.value.status == 400
    with pytest.raises(ApiError) as e:
        ChatCompletionRequest(messages=[{"role": "user", "content": [
            {"type": "image_url"}]}]).template_messages()
    assert e.value.param == "messages[0].content[0]"


# -- the command's bad input -----------------------------------------------------------------------


@pytest.mark.parametrize("argv,needle", [
    (["serve"], "MODEL_DIR"),
    (["serve", "/no/such/dir"], "MODEL_DIR: no such folder: /no/such/dir"),
    (["serve", ".", "--port", "-1"], "--port: must be at least 0"),
    (["serve", ".", "--max-num-seqs", "0"], "--max-num-seqs: must be at least 1"),
    (["serve", ".", "--num-blocks", "8", "--kv-cache-memory", "1GiB"], "not allowed with"),
    (["serve", ".", "--kv-cache-memory", "lots"], "--kv-cache-memory: expected bytes"),
    (["serve", ".", "--bogus"], "unrecognized arguments: --bogus"),
    (["serve", ".", "--tensor-parallel", "0"], "--tensor-parallel: must be at least 1"),
    (["serve", ".", "--max-waiting", "0"], "--max-waiting: must be at least 1"),
    (["serve", ".", "--max-prefill-tokens-with-decodes", "0"], "--max-prefill-tokens-with-decodes: must be at least 1"),
    (["serve", ".", "--max-decode-kv-bytes", "lots"], "--max-decode-kv-bytes: expected auto, none or bytes"),
    (["serve", ".", "--max-prefill-tokens-with-decodes", "few"],
     "--max-prefill-tokens-with-decodes: expected an integer"),
])
def test_command_bad_flags_exit_2_naming_the_flag(argv, needle, capsys):
    assert launcher_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerospeed serve: error:") and needle in err and err.count("\n") == 1


def test_command_bad_model_folder_exits_1(tmp_path, capsys):
    assert launcher_main(["serve", str(tmp_path), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("zerospeed serve: error:") and str(tmp_path) in err and "config.json" in err
    assert err.count("\n") == 1


# -- the Python API --------------------------------------------------------------------------------


def test_serve_handle_fault_injection_and_port_errors(tok_dir):
    from zerospeed.inference import serve
    from zerospeed.inference.serving import ServeError

    with pytest.raises(ServeError, match="max_num_sequences: not an argument"):
        serve(tok_dir, engine=FakeEngine(tok_dir), max_num_sequences=2)
    engine = FakeEngine(tok_dir, fail_on="poison", max_num_seqs=8)
    with serve(tok_dir, engine=engine, host="127.0.0.1", port=0) as handle:
        assert handle.url == f"http://127.0.0.1:{handle.port}"
        with pytest.raises(ServeError, match=f"port: 127.0.0.1:{handle.port} is already in use"):
            serve(tok_dir, engine=FakeEngine(tok_dir), port=handle.port)
        body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
        ok = httpx.post(handle.url + "/v1/completions", json=body, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        # a step that raises fails the requests in it; the request id carries the marker
        engine._fail_on = "cmpl-"
        bad = httpx.post(handle.url + "/v1/completions", json=body, timeout=30)
        assert bad.status_code == 500
        err = bad.json()["error"]
        assert err["code"] == "engine_error" and "injected fault" in err["message"]
        engine._fail_on = None
        again = httpx.post(handle.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0})
        assert again.status_code == 200 and again.json()["choices"][0]["finish_reason"] == "length"
        m = httpx.get(handle.url + "/metrics", timeout=10).text
        assert metric(m, "zerospeed_kv_blocks_used") == 0
        assert 'zerospeed_requests_finished_total{finish_reason="error"} 1.0' in m
        port = handle.port
    assert not handle.is_running()
    with socket.create_server(("127.0.0.1", port)):  # the port is free again
        pass


def test_stop_cancels_in_flight_requests_after_the_shutdown_timeout(tok_dir):
    """A graceful stop waits ``timeout`` seconds for in-flight requests, then cancels them: the
    stop is bounded, the stream ends unfinished, and the engine holds no request or block."""
    from zerospeed.inference import serve

    engine = FakeEngine(tok_dir, num_blocks=400, max_model_len=2000, step_delay=0.01)
    handle = serve(tok_dir, engine=engine, port=0, shutdown_timeout=30)
    first = threading.Event()
    result: dict = {"events": []}

    def client() -> None:
        body = {"prompt": "hello", "max_tokens": 1500, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", handle.url + "/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        result["events"].append(line[6:])
                        first.set()
        except httpx.HTTPError as e:  # the connection cut by the shutdown
            result["error"] = e

    t = threading.Thread(target=client)
    t.start()
    try:
        assert first.wait(20)
        start = time.monotonic()
        handle.stop(timeout=0.5)  # 1500 tokens at >= 10 ms a step need 15 s or more
        took = time.monotonic() - start
    finally:
        handle.stop(0)
        t.join(30)
    assert not t.is_alive() and not handle.is_running()
    assert took < 8, took
    chunks = [json.loads(e) for e in result["events"] if e != "[DONE]"]
    assert chunks and all(c["choices"][0]["finish_reason"] != "length" for c in chunks)
    assert 0 < engine._generated < 1500
    assert not engine.has_unfinished() and engine._free == 400
