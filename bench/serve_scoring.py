"""Loglikelihood-scoring rows of ``bench/serve_bench.py`` (issue #31): requests/s scoring long prompts.

What lm-eval's ``local-completions`` sends for a loglikelihood request (token ids as the prompt,
``echo: true``, ``logprobs: 1``, ``max_tokens: 1``, greedy) is sent to each server by ``--concurrency``
clients at once (lm-eval's ``num_concurrent``), every prompt distinct (``PROMPT_LEN`` random words,
so no prefix cache can hit); a system's rate is the number of prompts over the wall time from the
first request to the last answer, after a warm-up of two rounds of concurrent requests (hf: two requests). ``zerospeed`` is measured twice:
with lm-eval's shape and with ``max_tokens: 0`` (score the prompt, generate nothing; vLLM refuses
``max_tokens: 0``). The baseline without a server is lm-eval's own ``hf`` model backend
(``HFLM.loglikelihood`` on the same folder, in a subprocess with the same thread count, the prompt
split in half into context and continuation: its forward and ``log_softmax`` cover the whole
sequence either way), timed around the ``loglikelihood`` call only.

Every system's answers are checked against each other: per prompt, the sum of the logprobs of the
second half's tokens (the ``hf`` backend's continuation logprob) must agree between systems to
``LOGPROB_SUM_ATOL`` (fp32 over 512 terms of magnitude ~10: reduction-order differences only), so
a faster system cannot be one that computes something else.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT_LEN = 1024
LOGPROB_SUM_ATOL = 0.05  # |sum of 512 fp32 logprobs| ~ 5e3: ~1e-5 relative, reduction order only


def prompts(num: int, seed: int, vocab: int, length: int = PROMPT_LEN) -> list[list[int]]:
    """``num`` distinct prompts of ``length`` word ids (never the 4 special ids)."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(num)]


async def _score(client, url: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": "bench", "prompt": ids, "max_tokens": max_tokens, "echo": True, "logprobs": 1,
            "temperature": 0, "seed": 1234}
    r = await client.post(url + "/v1/completions", json=body)
    if r.status_code != 200:
        return {"error": f"HTTP {r.status_code}: {r.text[:300]}"}
    lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    if len(lps) < len(ids) or lps[0] is not None:
        return {"error": f"{len(lps)} token logprobs for a {len(ids)}-token prompt (first {lps[0]!r})"}
    return {"half_sum": sum(lps[len(ids) // 2:len(ids)])}


async def score_all(url: str, batch: list[list[int]], concurrency: int, max_tokens: int,
                    timeout: float) -> tuple[float, list[dict[str, Any]]]:
    """Wall seconds to score ``batch`` with ``concurrency`` requests in flight, and the answers."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout)) as client:
        async def one(ids):
            async with sem:
                return await _score(client, url, ids, max_tokens)

        t0 = time.perf_counter()
        out = await asyncio.wait_for(asyncio.gather(*(one(ids) for ids in batch)), timeout)
        return time.perf_counter() - t0, out


def hf_worker_main(argv: list[str]) -> int:
    """``serve_bench.py --lm-eval-hf MODEL_DIR PROMPTS_JSON BATCH_SIZE``: lm-eval's hf backend scores
    the prompts (context = first half, continuation = second half); prints one JSON line."""
    model_dir, prompts_path, batch_size = argv[0], argv[1], int(argv[2])
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "1")))
    batch = json.loads(Path(prompts_path).read_text())
    lm = HFLM(pretrained=model_dir, dtype="float32", device="cpu", batch_size=batch_size,
              max_length=2 * PROMPT_LEN, add_bos_token=False)

    def requests(items):
        out = []
        for i, ids in enumerate(items):
            words = [f"w{t - 4}" for t in ids]  # the bench tokenizer: id t <-> "w{t-4}"
            half = len(words) // 2
            out.append(Instance(request_type="loglikelihood", doc={}, idx=i,
                                arguments=(" ".join(words[:half]), " " + " ".join(words[half:]))))
        return out

    lm.loglikelihood(requests(batch[:2]), disable_tqdm=True)  # warm-up
    reqs = requests(batch[2:])
    t0, c0 = time.perf_counter(), time.process_time()
    res = lm.loglikelihood(reqs, disable_tqdm=True)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print("HFRESULT " + json.dumps({"wall_s": wall, "cpu_s": cpu, "half_sums": [float(r[0]) for r in res]}))
    return 0


def run_hf(model_dir: Path, batch: list[list[int]], batch_size: int, env: dict[str, str],
           script: Path, timeout: float) -> tuple[float, list[dict[str, Any]]]:
    path = model_dir.parent / "scoring_prompts.json"
    path.write_text(json.dumps(batch))
    proc = subprocess.run([sys.executable, str(script), "--lm-eval-hf", str(model_dir), str(path),
                           str(batch_size)], env=env, capture_output=True, text=True, timeout=timeout)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("HFRESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"lm-eval hf backend failed (status {proc.returncode}): "
                           + (proc.stderr or proc.stdout)[-1500:])
    res = json.loads(line[len("HFRESULT "):])
    return res["wall_s"], [{"half_sum": s} for s in res["half_sums"]], res.get("cpu_s")


def gemm_floor(hidden: int, intermediate: int, layers: int, vocab: int, qkv_out: int, threads: int,
               chunk: int = 512, reps: int = 3) -> dict[str, Any]:
    """CPU seconds of the matrix products alone that scoring one ``PROMPT_LEN``-token prompt needs
    (``torch.mm`` on the shapes of a 512-token chunk: fused QKV, output projection, fused gate/up,
    down, and the LM head over every prompt position), timed here with ``threads`` threads. No
    float32 implementation does less arithmetic, so ``1 / cpu_s`` bounds any system's requests per
    CPU-second on this CPU up to its GEMM efficiency: a system at X requests per CPU-second cannot be
    beaten by more than ``(1 / cpu_s) / X``."""
    import torch

    torch.set_num_threads(threads)

    def t(m, k, n, packed=False):
        a, b = torch.randn(m, k), torch.randn(k, n)
        if packed:  # oneDNN's float32 linear on a weight reordered once (what vLLM's CPU build runs)
            w = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), m)

            def f():
                return torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")
        else:
            def f():
                return a @ b
        f()
        c0 = time.process_time()
        for _ in range(reps):
            f()
        return (time.process_time() - c0) / reps

    chunks = PROMPT_LEN // chunk
    flops = 2 * PROMPT_LEN * (layers * (hidden * (qkv_out + hidden + 2 * intermediate) + intermediate * hidden)
                              + hidden * vocab)
    out: dict[str, Any] = {"gflop": flops / 1e9}
    for name, packed in (("", False), ("packed_", True)):
        try:
            body = layers * chunks * (t(chunk, hidden, qkv_out, packed) + t(chunk, hidden, hidden, packed)
                                      + t(chunk, hidden, 2 * intermediate, packed) + t(chunk, intermediate, hidden, packed))
            head = chunks * t(chunk, hidden, vocab, packed)
        except (AttributeError, RuntimeError):  # a torch without oneDNN's linear
            continue
        out.update({f"{name}cpu_s": body + head, f"{name}body_cpu_s": body, f"{name}head_cpu_s": head})
    return out


def agreement(answers: dict[str, list[dict[str, Any]]]) -> tuple[float | None, str]:
    """Largest |difference| of per-prompt half sums between any system and the first that ran."""
    ok = {s: [a["half_sum"] for a in ans] for s, ans in answers.items()
          if ans and all("half_sum" in a for a in ans)}
    if len(ok) < 2:
        return None, "fewer than two systems answered: no cross-check"
    names = list(ok)
    ref = ok[names[0]]
    worst = max(abs(x - y) for s in names[1:] for x, y in zip(ref, ok[s]))
    return worst, (f"per-prompt logprob sums of the second half agree between {', '.join(names)} to "
                   f"{worst:.2e} (bound {LOGPROB_SUM_ATOL})")


def run(args, env: dict[str, str], model_dir: Path, vocab: int, start_server, script: Path,
        load_avg) -> tuple[list[dict[str, Any]], list[str]]:
    """The scoring rows: each system of ``args.scoring_systems`` scores the same prompts.
    ``start_server(system, model_dir, env, max_model_len)`` starts a server (a ``Server``)."""
    # warm-up: two rounds of concurrent requests, so every batch shape of the measured run has been
    # served once (zerospeed measures its fast paths per shape class when a class is first served)
    num_warm = 2 * args.scoring_concurrency
    batch = prompts(args.scoring_prompts + num_warm, args.seed + 77, vocab)
    warm, measured = batch[:num_warm], batch[num_warm:]
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    answers: dict[str, list[dict[str, Any]]] = {}
    plans = []
    for system in args.scoring_systems:
        if system == "zerospeed":
            plans += [("zerospeed", 1), ("zerospeed", 0)]
        elif system == "vllm":
            plans.append(("vllm", 1))
        elif system == "hf":
            plans.append(("hf", None))
        else:
            raise ValueError(f"--scoring-systems: unknown system {system!r} (zerospeed, vllm, hf)")
    servers: dict[str, Any] = {}
    try:
        for k, (system, max_tokens) in enumerate(plans):
            name = system if max_tokens is None else f"{system} (max_tokens {max_tokens})"
            row: dict[str, Any] = {"system": name, "prompts": len(measured), "prompt_tokens": PROMPT_LEN}
            try:
                if system == "hf":
                    row["client"] = f"lm-eval HFLM batch_size {args.hf_batch_size}, in-process"
                    wall, out, cpu = run_hf(model_dir, batch[num_warm - 2:], args.hf_batch_size, env, script,
                                            args.timeout * 4)
                else:
                    if system not in servers:
                        t0 = time.perf_counter()
                        servers[system] = (start_server(system, model_dir, env, 2 * PROMPT_LEN),
                                           round(time.perf_counter() - t0, 1))
                    server, startup = servers[system]
                    if system == "vllm":
                        import re

                        m = re.search(r"LLM engine \(v([\w.+-]+)\)", "".join(server.lines))
                        row["version"] = m.group(1) if m else "unknown"
                    row["client"] = f"HTTP, {args.scoring_concurrency} in flight"
                    row["startup_s"] = startup
                    asyncio.run(score_all(server.url, warm, args.scoring_concurrency, max_tokens,
                                          args.timeout))
                    cpu0 = server.cpu_seconds()
                    wall, out = asyncio.run(score_all(server.url, measured, args.scoring_concurrency,
                                                      max_tokens, args.timeout * 4))
                    cpu1 = server.cpu_seconds()
                    cpu = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
            except (RuntimeError, asyncio.TimeoutError, subprocess.TimeoutExpired) as e:
                row["note"] = f"failed: {str(e).strip()[-1200:]}"
                notes.append(f"{name} failed: " + " / ".join(
                    x.strip() for x in str(e).splitlines() if x.strip())[-1200:])
                rows.append(row)
                print(row, flush=True)
                if system in servers:
                    servers.pop(system)[0].stop()
                continue
            errors = [a["error"] for a in out if "error" in a]
            row.update({"completed": len(out) - len(errors), "wall_s": round(wall, 2),
                        "requests_per_s": round((len(out) - len(errors)) / wall, 3),
                        "prompt_tokens_per_s": round((len(out) - len(errors)) * PROMPT_LEN / wall, 1),
                        "cpu_s": None if cpu is None else round(cpu, 2),
                        "requests_per_cpu_s": None if not cpu else round((len(out) - len(errors)) / cpu, 3),
                        "load_avg_1m": load_avg()})
            if errors:
                row["note"] = errors[0][:300]
            else:
                answers[name] = out
            rows.append(row)
            print(row, flush=True)
            if system in servers and (k + 1 == len(plans) or plans[k + 1][0] != system):
                servers.pop(system)[0].stop()  # the next system gets the cores to itself
    finally:
        for server, _ in servers.values():
            server.stop()
    floor = gemm_floor(*args.scoring_model_dims, threads=args.threads)
    rows.append({"system": "GEMM floor (the model's matmuls alone, torch.mm, no server)", "prompts": 1,
                 "prompt_tokens": PROMPT_LEN, "client": "in-process", "cpu_s": round(floor["cpu_s"], 3),
                 "requests_per_cpu_s": round(1 / floor["cpu_s"], 3), "load_avg_1m": load_avg()})
    notes.append(f"GEMM floor: the {floor['gflop']:.0f} GFLOP of matrix products one {PROMPT_LEN}-token prompt needs "
                 f"take {floor['cpu_s']:.2f} CPU-s here (body {floor['body_cpu_s']:.2f}, LM head over the prompt "
                 f"{floor['head_cpu_s']:.2f}) with {args.threads} thread(s): at most {1 / floor['cpu_s']:.3f} requests "
                 "per CPU-second for any float32 system that computes these logprobs with torch.mm")
    if "packed_cpu_s" in floor:
        notes.append(f"the same matrix products through oneDNN's float32 linear on reordered (packed) weights, as vLLM's "
                     f"CPU build runs its linears: {floor['packed_cpu_s']:.2f} CPU-s ({floor['cpu_s'] / floor['packed_cpu_s']:.2f}x "
                     f"less than torch.mm here): at most {1 / floor['packed_cpu_s']:.3f} requests per CPU-second")
    worst, line = agreement(answers)
    notes.append(line)
    if worst is not None and worst > LOGPROB_SUM_ATOL:
        notes.append("the systems do NOT agree on the scores: the rates compare different work")
    by = {r["system"]: r for r in rows if r.get("requests_per_s")}
    z = by.get("zerospeed (max_tokens 1)")
    for base in ("vllm (max_tokens 1)", "hf"):
        if z and base in by:
            notes.append(f"scoring: zerospeed/{base.split()[0]} {z['requests_per_s'] / by[base]['requests_per_s']:.2f}x "
                         f"requests/s ({z['requests_per_s']} vs {by[base]['requests_per_s']})")
    for name, r in by.items():
        if r.get("requests_per_cpu_s"):
            notes.append(f"{name}: {r['requests_per_cpu_s']} requests per CPU-second, "
                         f"{r['requests_per_cpu_s'] * floor['cpu_s']:.0%} of the GEMM floor's rate")
    zc, vc = (by.get(k, {}).get("requests_per_cpu_s") for k in ("zerospeed (max_tokens 1)", "vllm (max_tokens 1)"))
    if zc and vc:
        notes.append(f"scoring per CPU-second: zerospeed/vllm {zc / vc:.2f}x ({zc} vs {vc})")
    if z and "vllm (max_tokens 1)" in by:
        ratio = z["requests_per_s"] / by["vllm (max_tokens 1)"]["requests_per_s"]
        notes.append(f"target scoring >= 2x vLLM's CPU server: {'met' if ratio >= 2 else 'NOT met'} "
                     f"({ratio:.2f}x)")
    return rows, notes
