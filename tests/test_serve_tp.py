"""``zerospeed serve --tensor-parallel 2``: two gloo ranks started through the launcher's torchrun,
rank 0 serving HTTP; greedy output equals the one-rank ``pipeline()``, streaming works, every
block is free afterwards, and SIGTERM ends both ranks with status 0.
"""

from __future__ import annotations

import signal

import httpx
import openai
import psutil
import pytest

from serve_cases import ServerProcess, build_model_dir, metric, serve_argv

MODEL = "tiny"
pytestmark = pytest.mark.timeout(180)


def test_tensor_parallel_2_serves_the_one_rank_tokens(tmp_path):
    from zerospeed.inference import pipeline

    model_dir = build_model_dir(tmp_path / "tiny-llama")
    prompts = ["To be or not to be", "東京は"]
    expected = pipeline(str(model_dir))(prompts, max_new_tokens=10, ignore_eos=True)
    srv = ServerProcess(serve_argv(model_dir, "--tensor-parallel", "2", "--served-model-name",
                                   MODEL, "--num-blocks", "32", "--block-size", "8"),
                        start_timeout=120)
    try:
        ranks = psutil.Process(srv.proc.pid).children(recursive=True)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=60, max_retries=0)
        for prompt, ref in zip(prompts, expected):
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == ref.generated_text
            assert r.usage.completion_tokens == 10
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert chunks[-1].usage.completion_tokens == 6
        m = httpx.get(srv.url + "/metrics", timeout=10).text
        assert metric(m, "zerospeed_kv_blocks_used") == 0
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.wait(60) == 0, srv.output
        assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        srv.kill()
