"""Smaller client-facing fixes of issue #31: admission as documented (``--max-waiting 2
--max-num-seqs 2`` takes 4 of 12 simultaneous requests), quiet and counted client disconnects,
the chat stream's role sent with the first token, and chat logprobs' ``bytes`` for tokens inside a
multi-byte character."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from serve_cases import ServerProcess, build_model_dir, build_tokenizer, metric, serve_argv
from zerospeed.inference.serving.text import TokenizerAdapter

pytestmark = pytest.mark.timeout(180)
NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("serve_fixes") / "tiny-llama")


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerProcess(serve_argv(model_dir, "--num-blocks", str(NUM_BLOCKS), "--block-size", "8",
                                   "--max-num-seqs", "2", "--max-waiting", "2"))
    yield srv
    assert srv.stop() == 0, srv.output
    assert "Traceback" not in srv.output, srv.output


def test_token_bytes_inside_multibyte_characters(tmp_path):
    tok = build_tokenizer(tmp_path)
    adapter = TokenizerAdapter(tok)
    for text in ("東京は大きい都市です。", "Où est la gare?", "plain"):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert b"".join(bytes(adapter.token_bytes(i)) for i in ids) == text.encode()
    assert any("\ufffd" in adapter.token_text(i) for i in tok.encode("東京", add_special_tokens=False).ids)


def test_twelve_simultaneous_requests_admit_four(server):
    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            async def one():
                return await client.post(server.url + "/v1/completions", json={
                    "prompt": "hi", "max_tokens": 120, "ignore_eos": True, "temperature": 0})
            return await asyncio.gather(*(one() for _ in range(12)))

    statuses = sorted(r.status_code for r in asyncio.run(main()))
    # 2 running slots + 2 waiting: 4 taken, the other 8 get 429 (before the fix: 2)
    assert statuses == [200] * 4 + [429] * 8, statuses


def test_disconnects_are_quiet_and_counted(server):
    before = metric(httpx.get(server.url + "/metrics").text, "zerospeed_client_disconnects_total")
    body = {"prompt": "hi", "max_tokens": 120, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=dict(body, stream=True), timeout=60) as r:
        next(r.iter_lines())  # one chunk, then hang up
    # a non-streamed request whose client hangs up as soon as it is sent: gone while its request is read or
    # generated, whichever the machine's speed makes it (a client timing out after 50 ms did not, on a quiet
    # machine: 120 tokens of this model took less); counted either way (before the body is read, as after)
    import json
    import socket
    from urllib.parse import urlparse

    url = urlparse(server.url)
    payload = json.dumps(body).encode()
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    # gone half-way through sending its body: the server's read of it fails; counted, no traceback
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        time.sleep(0.2)
    deadline = time.monotonic() + 30
    while True:
        m = httpx.get(server.url + "/metrics").text
        if (metric(m, "zerospeed_client_disconnects_total") == before + 3
                and metric(m, "zerospeed_kv_blocks_free") == NUM_BLOCKS):
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    assert "Traceback" not in server.output, server.output


def test_chat_stream_role_comes_with_the_first_token_and_bytes_add_up(server):
    import json

    body = {"messages": [{"role": "user", "content": "東京"}], "max_tokens": 12, "stream": True,
            "logprobs": True, "top_logprobs": 2, "ignore_eos": True, "seed": 5}
    chunks = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    first = chunks[0]["choices"][0]
    assert first["delta"]["role"] == "assistant" and first["logprobs"]["content"]  # a token came with it
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    content = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert len(content) == 12
    if "\ufffd" not in text:
        assert b"".join(bytes(e["bytes"]) for e in content) == text.encode()
    for e in content:
        assert len(e["top_logprobs"]) == 2


def test_streamed_ttft_measured_by_a_client_matches_the_server_metric(server):
    """The first chunk carries the first token, so a client's time to first chunk is the server's
    time to first token plus the HTTP path (request parsing before arrival, one chunk's write after):
    never less (minus the client's timer resolution: every attempt), and within a loopback HTTP round
    trip more. The upper bound is checked on the best of up to 5 attempts: on a loaded machine any one
    attempt can be descheduled between the server's clock and the client's (seen: 0.14 s at load 16),
    which says nothing about what the server sends when; a role chunk sent before the prompt's work
    (the bug) or a Nagle delay would be in every attempt."""
    import json

    def ttft_sum():
        return metric(httpx.get(server.url + "/metrics").text, "zerospeed_time_to_first_token_seconds_sum")

    resolution = time.get_clock_info("perf_counter").resolution
    gaps = []
    for attempt in range(5):
        before = ttft_sum()
        body = {"messages": [{"role": "user", "content": "The quick brown fox " * 6}], "max_tokens": 4,
                "stream": True}
        with httpx.Client(timeout=60) as client:
            client.get(server.url + "/health")  # connection made before the clock starts
            start = time.perf_counter()
            first = None
            with client.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if first is None and line.startswith("data: ") and line != "data: [DONE]":
                        first = json.loads(line[6:])
                        client_ttft = time.perf_counter() - start
        server_ttft = ttft_sum() - before
        assert first["choices"][0]["delta"]["role"] == "assistant" and "content" in first["choices"][0]["delta"]
        assert server_ttft > 0
        assert client_ttft >= server_ttft - resolution, (client_ttft, server_ttft)
        gaps.append(client_ttft - server_ttft)
        if gaps[-1] < 0.1:
            break
    assert min(gaps) < 0.1, gaps


def test_no_nagle_delay_on_responses(server):
    """A response is written as headers then body; with Nagle's algorithm on the server's socket the
    body waited for the client's delayed ACK, 40 ms on every request over loopback (measured here:
    GET /health 44 ms, a streamed chat's first chunk 52 ms against 1.5 ms of server time to first
    token). With TCP_NODELAY a loopback round trip takes about a millisecond. Nagle's delay is in every
    request (Linux's delayed ACK is at least 40 ms), load only in some: the fastest of 7 must stay under
    30 ms (the median went to 33 ms at load 36 on the shared 2-core machine, the fastest to 21 ms)."""
    with httpx.Client(timeout=30) as client:
        client.get(server.url + "/health")
        times = []
        for _ in range(7):
            start = time.perf_counter()
            client.post(server.url + "/tokenize", json={"prompt": "hi"})
            times.append(time.perf_counter() - start)
    assert min(times) < 0.030, times
