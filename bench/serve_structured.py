"""Structured-output rows of ``bench/serve_bench.py`` (issue #31): the tokens/s cost of a JSON schema.

The same prompts go to ``zerospeed serve`` twice, with ``response_format: json_schema`` and free,
greedy and sampled, ``--structured-concurrency`` requests in flight; generated tokens/s is the
completion tokens over the wall time. A guided reply ends when its grammar is complete, so the free
run asks each prompt for exactly as many tokens as its guided reply had (``ignore_eos``): both
modes generate the same tokens per prompt and differ only by the grammar. Each mode gets a fresh server (no prefix cache carried over)
and the modes alternate over ``--structured-repeats`` rounds, so drift in the shared machine's load
hits both. Every guided reply that ended by its grammar (``finish_reason`` "stop") must parse and
validate against the schema (an object with a title and at most 4 strings of at most 24 characters).

The model needs a vocabulary that can spell JSON: a byte-level BPE of 32000 tokens (Llama 2's size)
trained on a synthetic Zipf-distributed word corpus, so llguidance's token trie is as large as a
real model's. A micro-benchmark times the mask itself per guided row: llguidance's parallel mask
computation and the application to the logits, now (a byte table lookup and one ``index_add_``,
``Guides.mask``) and before (bits unpacked with shifts and a bool ``masked_fill``).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "items"],
          "properties": {"title": {"type": "string", "maxLength": 24},
                         "items": {"type": "array", "maxItems": 4,
                                   "items": {"type": "string", "maxLength": 24}}}}


def build_bpe_tokenizer(folder: Path, vocab_size: int = 32000, seed: int = 0):
    """A byte-level BPE of ``vocab_size`` tokens (4 specials first) saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    lexicon = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(60000)]
    words = rng.choices(lexicon, weights=[1.0 / (i + 1) for i in range(len(lexicon))], k=400000)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator((" ".join(words[i:i + 20]) for i in range(0, len(words), 20)), trainer)
    tok.save(str(folder / "tokenizer.json"))
    return tok, lexicon


def prompts(num: int, seed: int, lexicon: list[str]) -> list[str]:
    rng = random.Random(seed)
    return ["Write a JSON list about " + " ".join(rng.choices(lexicon[:5000], k=rng.randint(20, 40)))
            for _ in range(num)]


async def _one(client, url: str, prompt: str, guided: bool, temperature: float, seed: int,
               max_tokens: int) -> dict[str, Any]:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "seed": seed, "ignore_eos": True}
    if guided:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "list", "schema": SCHEMA}}
    r = await client.post(url + "/v1/completions", json=body)
    if r.status_code != 200:
        return {"error": f"HTTP {r.status_code}: {r.text[:300]}"}
    reply = r.json()
    choice = reply["choices"][0]
    out = {"tokens": reply["usage"]["completion_tokens"], "finish": choice["finish_reason"]}
    if guided and choice["finish_reason"] == "stop":
        try:
            obj = json.loads(choice["text"])
            out["valid"] = (isinstance(obj, dict) and set(obj) == {"title", "items"}
                            and isinstance(obj["title"], str)
                            and all(isinstance(x, str) for x in obj["items"]))
        except ValueError:
            out["valid"] = False
    return out


async def generate(url: str, batch: list[str], guided: bool, temperature: float, concurrency: int,
                   max_tokens: int | list[int], timeout: float) -> tuple[float, list[dict[str, Any]]]:
    """``max_tokens``: one for all, or one per prompt."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout)) as client:
        async def one(i, p):
            async with sem:
                limit = max_tokens[i] if isinstance(max_tokens, list) else max_tokens
                return await _one(client, url, p, guided, temperature, 1000 + i, limit)

        t0 = time.perf_counter()
        out = await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(batch))), timeout)
        return time.perf_counter() - t0, out


def mask_microbench(model_dir: Path, vocab_size: int, rows_list=(1, 8, 32)):
    """Per guided row and token: llguidance's mask computation, and its application now and before,
    timed while ``rows`` matchers walk a valid reply token by token (a fixed state would hit
    llguidance's caches)."""
    import torch
    from tokenizers import Tokenizer

    from zerospeed.inference.constraints import Guides, grammar_for

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    guides = Guides(tok, vocab_size, [2])
    grammar = grammar_for("json_schema", SCHEMA)
    reply = tok.encode(json.dumps({"title": "sorting hat spells", "items": [
        "abra cadabra", "wingardium leviosa", "expecto patronum", "lumos maxima nox"]}),
        add_special_tokens=False).ids

    def before(logits, rows, bitmask):  # the shifts + bool masked_fill of commit 5c50357
        words = bitmask.shape[1]
        allowed = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).reshape(len(rows), words * 32)
        allowed = allowed[:, :logits.shape[1]].to(dtype=torch.bool)
        idx = torch.tensor(rows)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))

    out = []
    for n in rows_list:
        matchers = [guides.matcher(grammar) for _ in range(n)]
        logits = torch.randn(n + 2, vocab_size)
        rows = list(range(1, n + 1))  # not the whole batch: the general path
        compute = apply_now = apply_before = 0.0
        for t in reply:
            t0 = time.perf_counter()
            bitmask = guides.bitmask(matchers, vocab_size)
            t1 = time.perf_counter()
            guides.apply(logits, rows, bitmask)
            t2 = time.perf_counter()
            before(logits, rows, bitmask)
            t3 = time.perf_counter()
            compute, apply_now, apply_before = compute + t1 - t0, apply_now + t2 - t1, apply_before + t3 - t2
            for m in matchers:
                m.consume_token(t)
        per = 1e6 / (n * len(reply))
        out.append({"guided_rows": n, "vocab": vocab_size, "tokens": len(reply),
                    "compute_us_per_row": round(compute * per, 1),
                    "apply_us_per_row": round(apply_now * per, 1),
                    "apply_before_us_per_row": round(apply_before * per, 1)})
        print(out[-1], flush=True)
    return out


def run(args, env: dict[str, str], model_dir: Path, lexicon: list[str], vocab_size: int,
        start_server, load_avg) -> tuple[list[dict[str, Any]], list[str], list[dict[str, Any]]]:
    """Free vs guided generation rows, notes, and the mask micro-benchmark rows."""
    batch = prompts(args.structured_requests, args.seed + 99, lexicon)
    rows: list[dict[str, Any]] = []
    samples: dict[tuple[str, float], list[float]] = {}
    cpu_samples: dict[tuple[str, float], list[float]] = {}
    for rep in range(args.structured_repeats):
        for temperature in (0.0, 1.0):
            lengths: list[int] = []
            for guided in (True, False):  # guided first: free generation then makes as many tokens
                mode = "json_schema" if guided else "free"
                server = start_server("zerospeed", model_dir, env, None)
                try:
                    asyncio.run(generate(server.url, batch[:2], guided, temperature, 2, 8, args.timeout))
                    cpu0 = server.cpu_seconds()
                    wall, out = asyncio.run(generate(server.url, batch, guided, temperature,
                                                     args.structured_concurrency,
                                                     lengths or args.structured_max_tokens, args.timeout))
                    cpu1 = server.cpu_seconds()
                finally:
                    server.stop()
                if guided:
                    lengths = [max(1, o.get("tokens", 1)) for o in out]
                ok = [o for o in out if "error" not in o]
                tokens = sum(o["tokens"] for o in ok)
                stops = [o for o in ok if o["finish"] == "stop"]
                row = {"mode": mode, "temperature": temperature, "round": rep + 1,
                       "requests": len(out), "completed": len(ok), "gen_tokens": tokens,
                       "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
                       "server_cpu_s": None if cpu0 is None else round(cpu1 - cpu0, 2),
                       "tokens_per_cpu_s": None if cpu0 is None else round(tokens / max(cpu1 - cpu0, 1e-9), 1),
                       "stopped_by_grammar": len(stops) if guided else None,
                       "valid_of_stopped": sum(o.get("valid", False) for o in stops) if guided else None,
                       "load_avg_1m": load_avg()}
                if len(ok) < len(out):
                    row["note"] = next(o["error"] for o in out if "error" in o)
                rows.append(row)
                samples.setdefault((mode, temperature), []).append(tokens / wall)
                if cpu0 is not None:
                    cpu_samples.setdefault((mode, temperature), []).append(tokens / max(cpu1 - cpu0, 1e-9))
                print(row, flush=True)
    notes = []
    for temperature in (0.0, 1.0):
        free = samples.get(("free", temperature), [])
        guided = samples.get(("json_schema", temperature), [])
        if free and guided:
            ratio = statistics.mean(g / f for g, f in zip(guided, free))
            notes.append(f"temperature {temperature}: json_schema / free tokens/s {ratio:.3f} (mean of "
                         f"{len(free)} rounds: {', '.join(f'{g / f:.3f}' for g, f in zip(guided, free))}); "
                         f"target >= 0.90: {'met' if ratio >= 0.9 else 'NOT met'}")
        free, guided = cpu_samples.get(("free", temperature), []), cpu_samples.get(("json_schema", temperature), [])
        if free and guided:
            ratio = statistics.mean(g / f for g, f in zip(guided, free))
            notes.append(f"temperature {temperature}: json_schema / free tokens per server CPU-second {ratio:.3f} "
                         f"(rounds: {', '.join(f'{g / f:.3f}' for g, f in zip(guided, free))}; every thread of the "
                         "server counted, the mask worker's included: the cost in core-seconds, which the "
                         "shared machine's load moves less than wall time)")
    bad = [r for r in rows if r["mode"] == "json_schema" and r["valid_of_stopped"] != r["stopped_by_grammar"]]
    notes.append("every guided reply that its grammar ended parsed and validated" if not bad
                 else f"{len(bad)} guided runs had replies that did not parse or validate")
    micro = mask_microbench(model_dir, vocab_size)
    return rows, notes, micro
