"""Online serving benchmark: ``zerospeed serve`` against HF ``generate`` behind the same server.

A workload of requests with prompt and output lengths drawn from a fixed seed arrives as a Poisson
process at several rates; each system serves it over real HTTP (streaming completions, token-id
prompts, greedy, EOS ignored so every system generates the same number of tokens). For every
rate the client records time to first token (TTFT), inter-token latency (ITL, time between
streamed chunks, one token each) and generated tokens per second, and the report names the
highest rate whose p95 TTFT stays under ``--ttft-slo`` seconds (2 s).

Systems:

* ``zerospeed``: ``zerospeed serve MODEL_DIR`` (the command, in a subprocess).
* ``hf``: what a user would write without an inference engine: HF ``model.generate`` per request,
  one request at a time, tokens streamed through a generate streamer, behind the very same
  FastAPI/uvicorn server (``run_server(..., engine=HFGenerateEngine)``), so only the engine differs.

The model is a random-init Llama (about 19M parameters, vocab 32000, fp32) saved to a temporary
folder, with a word-level tokenizer built by the ``tokenizers`` library so that every token
decodes to text (one streamed chunk per token).

    PYTHONPATH=src python bench/serve_bench.py [--rates 1 2 4 8 16] [--num-requests 24]

Results go to ``bench/results/serve_bench-<UTC>.{json,md}``. vLLM's CPU server is not measured:
it needs its own Python 3.11 environment (see the inference issue), not built for these runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import re
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


# -- the model folder -----------------------------------------------------------------------------


def build_model_dir(folder: Path, seed: int = 0) -> Path:
    """A random-init Llama and a word-level tokenizer ("w0" ... "w31995" plus 4 specials)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": len(specials) + i for i in range(VOCAB - len(specials))})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}))
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                      pad_token_id=3, tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(str(folder), safe_serialization=True)
    return folder


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
    times, usage, error = [], None, None
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
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    return {"start": start, "end": end, "times": times, "error": error,
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
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = sum(r["tokens"] for r in ok)
    return {"system": system, "rate_req_s": rate, "requests": len(results),
            "completed": len(ok), "gen_tokens": tokens,
            "throughput_tok_s": round(tokens / span, 1),
            "ttft_p50_s": round(_pct(ttft, 0.5), 3), "ttft_p95_s": round(_pct(ttft, 0.95), 3),
            "itl_p50_ms": round(1000 * _pct(itl, 0.5), 2),
            "itl_p95_ms": round(1000 * _pct(itl, 0.95), 2),
            "e2e_p95_s": round(_pct([r["end"] - r["start"] for r in ok], 0.95), 3)}


# -- servers ---------------------------------------------------------------------------------------


class Server:
    """A server subprocess that prints ``listening on URL``."""

    def __init__(self, argv: list[str], env: dict[str, str], timeout: float = 180.0) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=str(REPO))
        self.lines: list[str] = []
        self.url = None
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                m = re.search(r"listening on (http://\S+)", line)
                if m:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout) or self.url is None:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.lines[-30:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def server_argv(system: str, model_dir: Path, args: argparse.Namespace) -> list[str]:
    common = ["--port", "0", "--served-model-name", "bench", "--max-waiting", "100000",
              "--shutdown-timeout", "5"]
    if system == "zerospeed":
        return [sys.executable, "-m", "zerospeed.launcher.runner", "serve", str(model_dir),
                *common, "--max-num-seqs", str(args.max_num_seqs),
                "--kv-cache-memory", args.kv_cache_memory]
    if system == "hf":
        return [sys.executable, str(Path(__file__).resolve()), "--hf-server", str(model_dir),
                *common]
    raise ValueError(f"--systems: unknown system {system!r} (zerospeed, hf)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--hf-server"]:
        return hf_server_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", nargs="+", default=["zerospeed", "hf"])
    p.add_argument("--rates", nargs="+", type=float, default=[1, 2, 4, 8, 16])
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--prompt-len", nargs=2, type=int, default=[16, 128])
    p.add_argument("--output-len", nargs=2, type=int, default=[16, 64])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo", type=float, default=2.0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each server")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one rate may take")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)

    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "src") + (os.pathsep + env["PYTHONPATH"]
                                             if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = str(args.threads)
    workload = make_workload(args.num_requests, args.seed, tuple(args.prompt_len),
                             tuple(args.output_len))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="serve_bench_") as tmp:
        model_dir = build_model_dir(Path(tmp) / "llama-19m", seed=args.seed)
        for system in args.systems:
            server = Server(server_argv(system, model_dir, args), env)
            try:
                asyncio.run(run_rate(server.url, "bench", workload[:2], 100.0, args.seed,
                                     args.timeout))  # warm-up
                for rate in args.rates:
                    try:
                        results = asyncio.run(run_rate(server.url, "bench", workload, rate,
                                                       args.seed, args.timeout))
                    except asyncio.TimeoutError:
                        rows.append({"system": system, "rate_req_s": rate,
                                     "note": f"timed out after {args.timeout} s"})
                        print(rows[-1], flush=True)
                        break
                    rows.append(summarize(system, rate, results))
                    rows[-1]["load_avg_1m"] = round(os.getloadavg()[0], 1)  # the shared machine's
                    print(rows[-1], flush=True)
            finally:
                server.stop()

    def best(system: str) -> float | None:
        good = [r["rate_req_s"] for r in rows if r["system"] == system
                and r.get("completed") == r.get("requests") and r.get("ttft_p95_s", 1e9) < args.ttft_slo]
        return max(good) if good else None

    sustainable = {s: best(s) for s in args.systems}
    notes = [f"highest rate with p95 TTFT < {args.ttft_slo} s: "
             + ", ".join(f"{s} {v if v is not None else 'none'} req/s" for s, v in sustainable.items())]
    by = {(r["system"], r["rate_req_s"]): r for r in rows if "throughput_tok_s" in r}
    for rate in args.rates:
        z, h = by.get(("zerospeed", rate)), by.get(("hf", rate))
        if z and h and h["throughput_tok_s"]:
            notes.append(f"rate {rate}: zerospeed/hf throughput {z['throughput_tok_s'] / h['throughput_tok_s']:.2f}x, "
                         f"p95 TTFT {z['ttft_p95_s']} s vs {h['ttft_p95_s']} s")
    notes.append("machine shared with other jobs while measuring (2 cores; load_avg_1m is the 1-minute "
                 "load average at the end of each rate); one run, no repeats")
    notes.append("vLLM's CPU server not measured (its separate Python 3.11 environment was not built for this run)")
    for n in notes:
        print(n)
    if not args.no_write:
        params = {"model": "Llama 4x256, vocab 32000, fp32, random init", "num_requests":
                  args.num_requests, "prompt_len": f"{args.prompt_len[0]}-{args.prompt_len[1]}",
                  "output_len": f"{args.output_len[0]}-{args.output_len[1]}", "seed": args.seed,
                  "rates_req_s": " ".join(str(r) for r in args.rates),
                  "server_threads": args.threads, "zerospeed_max_num_seqs": args.max_num_seqs,
                  "zerospeed_kv_cache_memory": args.kv_cache_memory,
                  "sustainable_rate": json.dumps(sustainable)}
        paths = write_results("serve_bench", rows, params=params, notes=notes,
                              command=command_line())
        print("wrote", *paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
