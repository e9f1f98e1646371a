"""engine.sync_weights to a real `zerospeed serve --weight-update-group` subprocess (issue #32).

One server (a tiny llama folder) goes through: a LoRA-delta sync (only adapter bytes travel), a full sync from
ZeRO-3 shards on 2 ranks while requests keep arriving (each response names the one weights version that produced
it and equals that version's output), a LoRA-delta sync refused after the full one (clear error, old weights
kept), and a sync killed halfway (the server keeps serving the last good version and accepts the next sync)."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rl_cases import (SYNC_FAST_PATHS, bad_sync_input_case, killed_sync_case, mismatched_sync_case,
                      refused_sync_case, sync_case, tp_sync_case)
from serve_cases import FakeEngine, ServerProcess, build_model_dir, build_tokenizer, serve_argv
from zerospeed.testing import DistributedTestError, run_distributed

pytestmark = pytest.mark.timeout(900)  # the server, five trainer runs (each with its own limit)

PROMPT = [5, 17, 42, 9, 100, 7]
NEW = 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_with_update_group(folder: Path) -> tuple[str, ServerProcess]:
    """A ``zerospeed serve`` subprocess of ``folder`` with a weight-update group on a free port: (address, server)."""
    address = f"127.0.0.1:{_free_port()}"
    return address, ServerProcess(serve_argv(folder, "--weight-update-group", address, "--dtype", "fp32",
                                             "--cpu-kernels", SYNC_FAST_PATHS["cpu_kernels"],
                                             "--greedy-head", SYNC_FAST_PATHS["greedy_head"]))


def _complete(url: str, prompt: list[int] = PROMPT) -> tuple[str, str]:
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "model", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["text"], body["system_fingerprint"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("rl_sync") / "model")


def test_sync_weights_to_a_serve_subprocess(folder: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    address, server = _serve_with_update_group(folder)
    try:
        url = server.url
        text0, fp0 = _complete(url)
        assert fp0 == "weights-v0"

        # 1. LoRA delta from 2 ZeRO-3 ranks: the server's output equals the trainer's rollout (adapters applied)
        lora = run_distributed(sync_case, 2, str(folder), address, PROMPT, NEW, True, timeout=240)
        r = lora[0]
        assert r["version"] == 1 and lora[1]["version"] == 1
        assert r["payload_bytes"] == r["adapter_bytes"] == r["sent_bytes"]  # only adapter bytes travel
        assert lora[1]["sent_bytes"] == 0  # dp rank 0 alone talks to the server
        for rank in lora:  # the adapters are gathered from their ZeRO-3 buckets: one bucket at a time
            assert 0 < rank["peak_gathered_bytes"] <= rank["max_bucket_bytes"]
        text1, fp1 = _complete(url)
        assert fp1 == "weights-v1" and text1 == tok.decode(r["tokens"]) and text1 != text0

        # 2. full weights from the shards, fixed 4 KiB buckets, while requests keep coming
        seen: list[tuple[str, str]] = []
        stop = threading.Event()

        def traffic() -> None:
            while not stop.is_set():
                seen.append(_complete(url))

        t = threading.Thread(target=traffic, daemon=True)
        t.start()
        try:
            full = run_distributed(sync_case, 2, str(folder), address, PROMPT, NEW, False, timeout=240)
        finally:
            stop.set()
            t.join(60)
        r = full[0]
        assert r["version"] == 2
        assert r["payload_bytes"] == r["model_bytes"] == r["sent_bytes"]
        # two buffers of half a bucket: one on the wire while the other fills
        assert r["num_buckets"] == -(-r["payload_bytes"] // 2048) and r["send_buffer_bytes"] == 4096
        # trainer memory during a full sync: read from the shards, nothing gathered; rank 0 holds the two
        # half-bucket message buffers (one bucket), the other rank sends views of its shard
        for rank in full:
            assert rank["peak_gathered_bytes"] == 0
        # the other rank's bytes reach rank 0 once, point to point: its share of the model, no more
        assert 0 < full[1]["trainer_send_bytes"] == full[1]["own_shard_bytes"] < r["model_bytes"]
        text2, fp2 = _complete(url)
        assert fp2 == "weights-v2" and text2 == tok.decode(r["tokens"])
        by_version = {"weights-v1": text1, "weights-v2": text2}
        assert seen, "no request ran during the sync"
        for text, fp in seen:  # every response was produced by one version, the one it names
            assert text == by_version[fp], (fp, text)

        # 3. LoRA delta after a full sync: refused, the server keeps version 2
        message = run_distributed(refused_sync_case, 1, str(folder), address, timeout=180)[0]
        assert "WeightSyncError" in message and "full sync has replaced them" in message, message
        assert _complete(url) == (text2, "weights-v2")

        # 4. a model that is not the server's: the server names the mismatched tensors, keeps version 2
        message = run_distributed(mismatched_sync_case, 1, address, timeout=180)[0]
        assert "WeightSyncError" in message and "mismatched tensors" in message and "mlp" in message, message
        assert _complete(url) == (text2, "weights-v2")

        # 5. a trainer killed after its first bucket: the server serves version 2 and takes the next sync
        with pytest.raises(DistributedTestError):
            run_distributed(killed_sync_case, 1, str(folder), address, timeout=180)
        assert _complete(url) == (text2, "weights-v2")
        # (501-byte messages: float32 tensors cut mid-element at message ends, and put at unaligned offsets)
        again = run_distributed(sync_case, 1, str(folder), address, PROMPT, NEW, False, 1002, timeout=240)[0]
        assert again["version"] == 3
        assert _complete(url) == (tok.decode(again["tokens"]), "weights-v3")
        assert server.proc.poll() is None
    finally:
        server.stop()


def test_sync_weights_bad_input(folder: Path) -> None:
    errors = run_distributed(bad_sync_input_case, 2, str(folder), timeout=240)
    assert errors[0] == errors[1]  # every rank raises alike
    bad_address, nobody, bad_bucket = errors[0]
    assert bad_address.startswith("ValueError: sync_weights(address): expected HOST:PORT"), bad_address
    assert nobody.startswith("WeightSyncError: ") and "127.0.0.1:1" in nobody, nobody
    assert bad_bucket.startswith("ValueError: sync_weights(bucket_bytes=...)"), bad_bucket


@pytest.mark.timeout(60)
def test_streamed_chunks_name_the_weights_version(tmp_path: Path) -> None:
    """Every streamed chunk (completions and chat, the usage chunk too) carries ``system_fingerprint`` =
    ``weights-vN`` as the non-streamed response does: before a sync v0, after one the new version. The sync is
    the server's own swap step (``EngineLoop.request_update``, what ``--weight-update-group`` runs once the
    buckets are in), here on the deterministic engine so the test takes about a second."""
    from zerospeed.inference import serve

    build_tokenizer(tmp_path)
    handle = serve(tmp_path, engine=FakeEngine(tmp_path), port=0)
    try:
        def streamed(route: str, body: dict) -> list[dict]:
            body = dict(body, model=handle.model_name, max_tokens=6, temperature=0, stream=True,
                        stream_options={"include_usage": True})
            with httpx.stream("POST", handle.url + route, json=body, timeout=30) as r:
                r.raise_for_status()
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert len(chunks) >= 3 and chunks[-1]["usage"] is not None  # tokens, finish, usage
            return chunks

        def fingerprints() -> set[str]:
            fps = set()
            for route, body in (("/v1/completions", {"prompt": "hello"}),
                                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
                fps |= {c.get("system_fingerprint") for c in streamed(route, body)}
                whole = httpx.post(handle.url + route, timeout=30, json=dict(
                    body, model=handle.model_name, max_tokens=6, temperature=0)).json()
                fps.add(whole["system_fingerprint"])
            return fps

        assert fingerprints() == {"weights-v0"}
        applied = threading.Event()

        def apply() -> int:
            applied.set()
            return 7

        handle.engine_loop.request_update(apply)
        assert applied.wait(10)
        assert fingerprints() == {"weights-v7"}
    finally:
        handle.stop(5)


def test_pair_backend_follows_the_weights_device() -> None:
    """The pair group's backend is chosen from the device of the weights (NCCL for CUDA tensors, gloo for CPU),
    and a trainer whose weights are on the other kind of device than the server's is refused naming both."""
    from zerospeed.inference.serving.weight_sync import WeightSyncError, backend_for
    from zerospeed.rl.sync import check_backend

    assert backend_for("cpu") == backend_for(torch.device("cpu")) == "gloo"
    assert backend_for("cuda") == backend_for(torch.device("cuda", 1)) == "nccl"
    check_backend("gloo", "cpu", "h:1")  # agreeing ends: no error
    with pytest.raises(WeightSyncError, match=r"syncs over nccl \(its weights on CUDA\) but this trainer's weights "
                                              r"are on cpu \(gloo\)"):
        check_backend("nccl", "cpu", "10.0.0.2:29600")


def _nccl_pair_end(rank: int, port: int, out: Any) -> None:
    import datetime

    import torch.distributed as dist

    from zerospeed.inference.serving import weight_sync as wire

    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, datetime.timedelta(seconds=60))
    pair = wire.pair_group(store, 0, rank, 60.0, torch.device("cuda", rank))
    payload = torch.arange(1 << 20, dtype=torch.float32, device=f"cuda:{rank}")
    if rank == 1:  # the trainer's end: a header then a bucket, as sync_weights sends them
        wire.send(pair, torch.tensor([wire.MAGIC, 7], dtype=torch.int64), 0)
        pair.isend(payload.view(torch.uint8), 0).wait()
        out.put((rank, pair.backend, True))
    else:
        header = torch.zeros(2, dtype=torch.int64)
        wire.recv(pair, header, 1)
        got = pair.empty(payload.numel() * 4)
        pair.irecv(got, 1).wait()
        out.put((rank, pair.backend, header.tolist() == [wire.MAGIC, 7] and bool((got.view(torch.float32)
                                                                                 == payload).all())))


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs CUDA (two devices: NCCL runs one rank per GPU) for the NCCL weight-update pair")
@pytest.mark.timeout(120)
def test_nccl_pair_moves_cuda_buckets() -> None:
    """On CUDA the weight-update pair is an NCCL group and the buckets travel as CUDA tensors."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_nccl_pair_end, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=100) for _ in procs)
    for p in procs:
        p.join(30)
    assert results == [(0, "nccl", True), (1, "nccl", True)]


def test_sync_weights_from_a_tensor_parallel_trainer(folder: Path) -> None:
    """An AutoTP (tp 2) x ZeRO-3 (dp 2) trainer syncs to a TP-1 server: each whole tensor is assembled from the TP
    pieces, TP rank 0 of dp rank 0 alone sends it; the server's greedy output equals the trainer's TP rollout."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    address, server = _serve_with_update_group(folder)
    try:
        text0, fp0 = _complete(server.url)
        assert fp0 == "weights-v0"
        res = run_distributed(tp_sync_case, 4, str(folder), address, PROMPT, NEW, timeout=300)
        assert {r["version"] for r in res} == {1}  # every rank returns the server's new version
        talker = [r for r in res if r["tp_rank"] == 0 and r["dp_rank"] == 0]
        assert len(talker) == 1 and talker[0]["payload_bytes"] == talker[0]["model_bytes"] == \
            talker[0]["sent_bytes"]  # whole tensors: the unsplit model's bytes, once
        assert all(r["sent_bytes"] == 0 for r in res if r is not talker[0])
        text1, fp1 = _complete(server.url)
        assert fp1 == "weights-v1" and text1 != text0
        by_dp = {r["dp_rank"]: r["tokens"] for r in res if r["tp_rank"] == 0}
        assert text1 == tok.decode(by_dp[0])  # the trainer's rollout on its TP layout, the server's on whole tensors
    finally:
        server.stop()
