"""RL benchmark (issue #32): rollout tokens/s at ZeRO-3, and weight-sync time against the wire bound.

Part ``rollout`` (``--part rollout``): the same random-init Llama, the same prompts (per rank: ``--prompts``
prompts of ``--prompt-len`` tokens), greedy, ``--new-tokens`` new tokens each, EOS ignored, on ``--world`` gloo
ranks (``zerospeed.testing.run_distributed``, one torch thread per rank), each rank rolling out its own prompts
at the same time (so every system sees the same CPU contention). Systems:

* ``zerospeed``: ``engine.generate`` at ZeRO-3 (``hybrid_engine.enabled``): one gather of every bucket per rollout
  batch, straight into the kept arena the inference engine's weights are views of (``alias_weights``, the
  default; weights that are no contiguous bucket range are copied), then paged-KV ragged decoding;
* ``zerospeed_copy``: the same with ``alias_weights: false``: every weight copied from the gathered buckets into
  the inference engine's copy (the path before the arena, kept as the plain twin);
* ``trl_zero3``: TRL's ZeRO-3 generation path, ``unwrap_model_for_generation`` with its default
  ``gather_deepspeed3_params=True`` (trl/models/utils.py: ``deepspeed.zero.GatheredParameters(model.parameters())``
  around HF ``generate`` on the unwrapped module, with the ZeRO-3 hooks removed meanwhile and re-added after), run
  on zerospeed's ZeRO-3 engine (TRL's helper itself needs an Accelerate DeepSpeed plugin; its steps are reproduced:
  gather everything, remove the hooks, HF ``generate``, re-add the hooks, release);
* ``trl_zero3_nogather`` (``--nogather``): the same with ``gather_deepspeed3_params=False``: HF ``generate`` under the
  live ZeRO-3 hooks, every forward gathering every layer again (the trl #3858 pain);
* ``hf_unsharded``: HF ``generate`` on an unsharded copy (each rank its own full model, batch of its prompts);
* ``zerospeed_unsharded``: ``engine.generate`` at ZeRO stage 0 (weights whole on every rank): zerospeed's
  inference engine on unsharded weights, the reference of the "0.9x" target.

Each system: one warm-up call, then ``--repeats`` timed calls; per rank the median wall time of a call (the
gather/fill included) and its CPU time; tokens/s = new tokens of the rank / wall seconds, averaged over ranks.
The tokens are compared with ``hf_unsharded``'s (fraction of equal rows).

Part ``profile`` (``--part profile``): one process, ``engine.generate`` on unsharded weights with the same workload;
the CPU seconds of a call split into the layers' forward, the LM head, the sampler, the scheduler, the attention
metadata and the rest (each wrapped with a ``process_time`` accumulator).

Part ``sync`` (``--part sync``, root): two network namespaces on a veth pair whose both ends are capped with
``tc`` (a token-bucket filter at ``--rate-mbit``); ``zerospeed serve --weight-update-group`` runs in namespace A,
the trainer (``--world`` ZeRO-3 ranks) in namespace B calls ``engine.sync_weights`` ``--repeats`` times; the
wire bound is payload bytes x 8 / rate. Reported: sync seconds (median), ratio to the bound, bytes on the veth,
the trainer's peak gathered bytes and send buffer against one ZeRO-3 bucket.

Results: bench/results/rl_bench-<date>.{json,md} with the machine, the load average and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))

from common import command_line, write_results  # noqa: E402


def model_config(size: str):
    from transformers import LlamaConfig

    if size == "small":  # rollouts: ~6M parameters, CPU decode bound by per-token overhead and weight reads
        return LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                           initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    # sync: ~57M parameters (229 MB fp32), so the wire time dominates
    return LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                       initializer_range=0.05, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def _model(size: str):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(model_config(size)).eval()


def _prompts(rank: int, n: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def _config(world: int, stage: int, hybrid: bool, n: int, max_len: int, alias: bool = True) -> dict:
    """``n``: sequences per rank; ``alias``: hybrid_engine.alias_weights."""
    cfg = {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": stage}, "steps_per_print": 0}
    if hybrid:
        cfg["hybrid_engine"] = {"enabled": True, "max_out_tokens": max_len, "max_num_seqs": n,
                                "alias_weights": alias}
    return cfg


def rollout_worker(system: str, n: int, prompt_len: int, new_tokens: int, repeats: int, samples: int = 1,
                   temperature: float = 0.0) -> dict:
    """``n`` prompts per rank, ``samples`` completions of each (GRPO's group), sampled at ``temperature`` (0:
    greedy); every system generates ``n * samples`` sequences of ``new_tokens`` per rank."""
    import torch

    import zerospeed
    from zerospeed import comm, zero

    rank, world = comm.get_rank(), comm.get_world_size()
    model = _model("small")
    prompts = _prompts(rank, n, prompt_len, model.config.vocab_size)
    ids = torch.tensor(prompts)
    max_len = prompt_len + new_tokens
    hf_kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                     do_sample=False, eos_token_id=None, pad_token_id=0)
    sampled = temperature > 0
    if sampled:  # pure sampling on both sides (HF's default top_k=50 off), each prompt's group in one batch
        hf_kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                         num_return_sequences=samples)
    gen_kwargs = dict(max_new_tokens=new_tokens, ignore_eos=True)
    if sampled:
        gen_kwargs.update(do_sample=True, temperature=temperature, seed=rank)
    seqs = n * samples
    timing = {"gather_s": 0.0}

    if system == "hf_unsharded":
        def call():
            with torch.no_grad():
                return model.generate(ids, **hf_kwargs)[:, prompt_len:].tolist()
    else:
        stage = 0 if system == "zerospeed_unsharded" else 3
        hybrid = system in ("zerospeed", "zerospeed_copy", "zerospeed_unsharded")
        engine, *_ = zerospeed.initialize(model=model, config=_config(world, stage, hybrid, seqs, max_len,
                                                                      alias=system != "zerospeed_copy"))
        module = engine.module
        if hybrid:
            def call():
                out = engine.generate(prompts, n=samples, **gen_kwargs)
                timing["gather_s"] = engine.rl.rollout.stats.fill_s
                return out
        elif system == "trl_zero3":
            runtime = engine.strategy.runtime

            def call():
                t0 = time.perf_counter()
                with zero.GatheredParameters(list(module.parameters())), torch.no_grad():
                    runtime.remove_hooks()  # TRL's remove_hooks(model): no ZeRO-3 hook runs during generate
                    timing["gather_s"] = time.perf_counter() - t0
                    try:
                        return module.generate(ids, **hf_kwargs)[:, prompt_len:].tolist()
                    finally:  # TRL's add_hooks(model)
                        for plan in runtime.plans.values():
                            if plan.buckets:
                                runtime._install(plan.module)
                        runtime._install(runtime.root)
        else:  # trl_zero3_nogather
            def call():
                with torch.no_grad():
                    return module.generate(ids, **hf_kwargs)[:, prompt_len:].tolist()
    comm.barrier()
    call()  # warm-up (the rollout engine is built and its fast paths measured at the first call)
    walls, cpus, gathers, out = [], [], [], None
    for _ in range(repeats):
        comm.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        out = call()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        gathers.append(timing["gather_s"])
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    return {"tokens": out, "wall_s": wall, "cpu_s": cpu, "gather_s": statistics.median(gathers),
            "tokens_per_s": seqs * new_tokens / wall, "tokens_per_cpu_s": seqs * new_tokens / cpu}


def run_rollouts(args: argparse.Namespace) -> list[dict]:
    from zerospeed.testing import run_distributed

    systems = ["hf_unsharded", "zerospeed_unsharded", "zerospeed", "zerospeed_copy", "trl_zero3"] + \
        (["trl_zero3_nogather"] if args.nogather else [])
    results = {}
    for system in systems:
        res = run_distributed(rollout_worker, args.world, system, args.prompts, args.prompt_len, args.new_tokens,
                              args.repeats, args.samples, args.temperature, timeout=1800)
        results[system] = res
        print(system, [round(r["tokens_per_s"], 1) for r in res], flush=True)
    ref = results["hf_unsharded"]
    rows = []
    for system, res in results.items():
        same = sum(a == b for r, q in zip(res, ref) for a, b in zip(r["tokens"], q["tokens"]))
        total = sum(len(r["tokens"]) for r in res)
        rows.append({"part": "rollout", "workload": args.workload, "system": system, "world": args.world,
                     "tokens_per_s": round(statistics.mean(r["tokens_per_s"] for r in res), 1),
                     "tokens_per_cpu_s": round(statistics.mean(r["tokens_per_cpu_s"] for r in res), 1),
                     "wall_s": round(statistics.mean(r["wall_s"] for r in res), 3),
                     "gather_s": round(statistics.mean(r["gather_s"] for r in res), 3),
                     # sampled rows differ by RNG; then only the shape is checked
                     "rows_equal_to_hf": f"{same}/{total}" if args.temperature == 0 else
                     f"sampled ({total} rows of {args.new_tokens})"})
        if args.temperature > 0:
            assert all(len(t) == args.new_tokens for r in res for t in r["tokens"]) and \
                total == len(ref[0]["tokens"]) * len(res), system
    by = {r["system"]: r for r in rows}
    z = by["zerospeed"]
    for key in ("tokens_per_s", "tokens_per_cpu_s"):
        by["zerospeed_copy"][f"{key}_vs_zerospeed_unsharded"] = round(by["zerospeed_copy"][key] /
                                                                     by["zerospeed_unsharded"][key], 3)
        z[f"{key}_vs_trl_zero3"] = round(z[key] / by["trl_zero3"][key], 2)
        z[f"{key}_vs_zerospeed_unsharded"] = round(z[key] / by["zerospeed_unsharded"][key], 3)
        z[f"{key}_vs_hf_unsharded"] = round(z[key] / by["hf_unsharded"][key], 2)
        if "trl_zero3_nogather" in by:
            z[f"{key}_vs_trl_zero3_nogather"] = round(z[key] / by["trl_zero3_nogather"][key], 2)
    return rows


# -- profile ----------------------------------------------------------------------------------------------------


def profile_worker(n: int, prompt_len: int, new_tokens: int, repeats: int, samples: int, temperature: float) -> dict:
    """Where a zerospeed rollout call's CPU time goes: each part wrapped with a process_time accumulator."""
    import torch  # noqa: F401

    import zerospeed
    import zerospeed.inference.attention as attention
    import zerospeed.inference.engine as engine_mod

    model = _model("small")
    prompts = _prompts(0, n, prompt_len, model.config.vocab_size)
    engine, *_ = zerospeed.initialize(model=model, config=_config(1, 0, True, n * samples, prompt_len + new_tokens))
    kw = dict(max_new_tokens=new_tokens, ignore_eos=True)
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, seed=0)
    engine.generate(prompts, n=samples, **kw)  # builds the engine, measures its fast paths
    ie = engine.rl.rollout.engine
    parts: dict[str, float] = {}

    def timed(owner, name: str, key: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            t = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                parts[key] = parts.get(key, 0.0) + time.process_time() - t
        setattr(owner, name, wrapper)

    timed(ie.model, "forward", "model_forward (layers: attention, linears, norms)")
    timed(ie.model, "compute_logits", "lm_head (compute_logits)")
    timed(ie.model, "greedy_tokens", "lm_head, greedy rows (greedy_tokens: bf16 / int8 head + exact refinement)")
    timed(engine_mod, "sample", "sampler")
    timed(ie.scheduler, "schedule", "scheduler")
    timed(attention.AttentionMetadata, "build", "attention metadata")
    import zerospeed.inference.cpu_kernel as cpu_kernel
    import zerospeed.inference.models.llama as llama

    timed(cpu_kernel, "attention_layer", "of which: attention (C kernel, RoPE + KV write + decode attention)")
    timed(llama, "cpu_linear", "of which: block linears (qkv, o, gate_up, down)")
    calls = []
    for _ in range(repeats):
        c0 = time.process_time()
        engine.generate(prompts, n=samples, **kw)
        calls.append(time.process_time() - c0)
    total = statistics.median(calls)
    out = {k: v / repeats for k, v in parts.items()}
    out["rest (engine step, rollout loop)"] = sum(calls) / repeats - sum(v for k, v in out.items()
                                                                       if not k.startswith("of which"))
    return {"cpu_s_per_call": total, "parts": out, "tokens_per_cpu_s": n * samples * new_tokens / total}


def run_profile(args: argparse.Namespace) -> list[dict]:
    from zerospeed.testing import run_distributed

    r = run_distributed(profile_worker, 1, args.prompts, args.prompt_len, args.new_tokens, args.repeats,
                        args.samples, args.temperature, timeout=1800)[0]
    mean = sum(v for k, v in r["parts"].items() if not k.startswith("of which"))
    return [{"part": "profile", "workload": args.workload, "system": "zerospeed_unsharded", "world": 1,
             "component": k, "cpu_s_per_call": round(v, 4), "share": round(v / mean, 3)}
            for k, v in sorted(r["parts"].items(), key=lambda kv: -kv[1])] + \
        [{"part": "profile", "workload": args.workload, "system": "zerospeed_unsharded", "world": 1,
          "component": "total (median call)", "cpu_s_per_call": round(r["cpu_s_per_call"], 4), "share": 1.0,
          "tokens_per_cpu_s": round(r["tokens_per_cpu_s"], 1)}]


def phases_worker(alias: bool, n: int, prompt_len: int, new_tokens: int, repeats: int, samples: int,
                  temperature: float) -> dict:
    """CPU (process_time) and wall seconds of each phase of one ``engine.generate`` call at ZeRO-3, per rank:
    the fill (of which the all-gathers into the arena, and the copies), the inference engine's KV cache made
    resident (``release_inference_cache``), request admission, the engine's steps (of which rebuilding the weights'
    derived layouts: oneDNN-packed and skinny-GEMM-packed linears, the bf16 / int8 LM head), the release."""
    import zerospeed
    import zerospeed.inference.models.layers as layers
    import zerospeed.rl.rollout as rollout_mod
    from zerospeed import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    model = _model("small")
    prompts = _prompts(rank, n, prompt_len, model.config.vocab_size)
    engine, *_ = zerospeed.initialize(model=model, config=_config(world, 3, True, n * samples,
                                                                  prompt_len + new_tokens, alias=alias))
    kw = dict(max_new_tokens=new_tokens, ignore_eos=True, n=samples)
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, seed=rank)
    engine.generate(prompts, **kw)  # builds the engine, measures its fast paths
    ro = engine.rl.rollout
    parts: dict[str, list[float]] = {}

    def add(key: str, c0: float, w0: float) -> None:
        p = parts.setdefault(key, [0.0, 0.0])
        p[0] += time.process_time() - c0
        p[1] += time.perf_counter() - w0

    def timed(owner, name: str, key: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            c0, w0 = time.process_time(), time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                add(key, c0, w0)
        setattr(owner, name, wrapper)

    timed(ro, "_fill", "fill")
    if ro.arena is not None:
        timed(ro.arena, "fill", "of which: all-gathers into the arena")
    timed(rollout_mod, "run_pass", "of which: copies (with their gathers when no arena)")
    timed(ro, "_engine", "KV cache made resident")
    timed(ro, "_add", "request admission")
    timed(ro, "_run", "engine steps")
    timed(ro, "_release", "release")
    derived = layers._derived_on

    def derived_timed(owner, name, w, build):
        def b(x):
            c0, w0 = time.process_time(), time.perf_counter()
            try:
                return build(x)
            finally:
                add("of which: derived weight layouts rebuilt", c0, w0)
        return derived(owner, name, w, b)
    layers._derived_on = derived_timed
    calls = []
    for _ in range(repeats):
        comm.barrier()
        c0, w0 = time.process_time(), time.perf_counter()
        engine.generate(prompts, **kw)
        calls.append((time.process_time() - c0, time.perf_counter() - w0))
    parts["total (mean call)"] = [sum(c for c, _ in calls), sum(w for _, w in calls)]
    return {k: (v[0] / repeats, v[1] / repeats) for k, v in parts.items()}


def run_phases(args: argparse.Namespace) -> list[dict]:
    from zerospeed.testing import run_distributed

    rows = []
    for alias in (True, False):
        res = run_distributed(phases_worker, args.world, alias, args.prompts, args.prompt_len, args.new_tokens,
                              args.repeats, args.samples, args.temperature, timeout=1800)
        system = "zerospeed" if alias else "zerospeed_copy"
        for key in res[0]:
            rows.append({"part": "phases", "workload": args.workload, "system": system, "world": args.world,
                         "component": key,
                         "cpu_ms_per_call": round(statistics.mean(r[key][0] for r in res) * 1e3, 2),
                         "wall_ms_per_call": round(statistics.mean(r[key][1] for r in res) * 1e3, 2)})
    return rows


# -- sync -------------------------------------------------------------------------------------------------------


def sync_trainer_worker(folder: str, address: str, repeats: int, bucket_bytes: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    import zerospeed
    from zerospeed import comm
    from zerospeed.zero.stage3 import registry

    world = comm.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    engine, *_ = zerospeed.initialize(model=model, config=_config(world, 3, False, 1, 64))
    buckets = {id(f[0]): f[0] for p in engine.module.parameters() if (f := registry.lookup(p)) is not None}
    reports = [engine.sync_weights(address, bucket_bytes=bucket_bytes) for _ in range(repeats)]
    return {"seconds": [r.seconds for r in reports], "send_seconds": [r.send_seconds for r in reports],
            "pass_seconds": [r.pass_seconds for r in reports], "reply_seconds": [r.reply_seconds for r in reports],
            "cpu_seconds": time.process_time(),
            "payload_bytes": reports[0].payload_bytes, "num_buckets": reports[0].num_buckets,
            "versions": [r.version for r in reports], "peak_gathered_bytes": max(r.peak_gathered_bytes for r in reports),
            "send_buffer_bytes": reports[0].send_buffer_bytes,
            "max_zero_bucket_bytes": max(b.full_bytes for b in buckets.values())}


def _tc(hosts, rate_mbit: int) -> None:
    for ns, veth in zip(hosts.ns, hosts.veth):
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate",
                        f"{rate_mbit}mbit", "burst", "256kb", "latency", "100ms"], check=True, timeout=30)


def run_sync(args: argparse.Namespace) -> list[dict]:
    from netns_hosts import TwoHosts, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"rl_bench --part sync: {reason}")
    from serve_cases import build_tokenizer

    work = Path(tempfile.mkdtemp(prefix="rl_bench_"))
    folder = work / "model"
    folder.mkdir()
    build_tokenizer(folder)
    _model("large").save_pretrained(str(folder), safe_serialization=True)
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + str(REPO / "tests") + os.pathsep +
               str(REPO / "bench"), OMP_NUM_THREADS="1")
    rows = []
    with TwoHosts() as hosts:
        _tc(hosts, args.rate_mbit)
        port = 29000 + os.getpid() % 1000
        address = f"{hosts.addr[0]}:{port}"
        server = hosts.start(0, [sys.executable, "-m", "zerospeed.launcher.runner", "serve", str(folder),
                                 "--host", hosts.addr[0], "--port", "0", "--weight-update-group", address,
                                 "--cpu-kernels", "off", "--greedy-head", "float32", "--max-num-seqs", "4"], env)
        deadline = time.time() + 300
        line = ""
        while "listening on" not in line:
            line = server.stdout.readline()
            if not line and server.poll() is not None or time.time() > deadline:
                raise SystemExit("rl_bench: the server did not start: " + server.stderr.read()[-2000:])
        rx0, tx0 = hosts.rx_tx_bytes(0)
        trainer = hosts.start(1, [sys.executable, str(Path(__file__).resolve()), "--sync-trainer", str(folder),
                                  address, str(args.world), str(args.repeats), str(args.bucket_bytes)], env)
        out, err = trainer.communicate(timeout=1800)
        rx1, tx1 = hosts.rx_tx_bytes(0)
        if trainer.returncode != 0:
            raise SystemExit(f"rl_bench: the trainer failed:\n{err[-4000:]}")
        res = json.loads(out.strip().splitlines()[-1])
    r = res[0]
    wire_s = r["payload_bytes"] * 8 / (args.rate_mbit * 1e6)
    secs = statistics.median(r["seconds"])
    rows.append({"part": "sync", "world": args.world, "rate_mbit": args.rate_mbit,
                 "payload_bytes": r["payload_bytes"], "bucket_bytes": args.bucket_bytes, "num_buckets": r["num_buckets"],
                 "sync_s_median": round(secs, 3), "sync_s_all": [round(s, 3) for s in r["seconds"]],
                 "rank0_send_wait_s_median": round(statistics.median(r["send_seconds"]), 3),
                 "pass_s_median": round(statistics.median(r["pass_seconds"]), 3),
                 "server_reply_s_median": round(statistics.median(r["reply_seconds"]), 3),
                 "wire_bound_s": round(wire_s, 3), "ratio_to_wire_bound": round(secs / wire_s, 3),
                 "server_rx_bytes": rx1 - rx0, "rx_over_payload": round((rx1 - rx0) / (r["payload_bytes"] * args.repeats), 4),
                 "versions": r["versions"],
                 "trainer_peak_gathered_bytes": max(x["peak_gathered_bytes"] for x in res),
                 "max_zero_bucket_bytes": r["max_zero_bucket_bytes"], "send_buffer_bytes": r["send_buffer_bytes"]})
    return rows


def sync_trainer_main(argv: list[str]) -> None:
    folder, address, world, repeats, bucket_bytes = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    from zerospeed.testing import run_distributed

    res = run_distributed(sync_trainer_worker, world, folder, address, repeats, bucket_bytes, timeout=1500)
    print(json.dumps(res))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--sync-trainer":
        sync_trainer_main(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("rollout", "sync", "profile", "phases", "all"), default="all",
                   help="profile: one process, zerospeed's engine.generate on unsharded weights, CPU time per part; "
                        "phases: --world ZeRO-3 ranks, CPU and wall time of each phase of a call, with "
                        "hybrid_engine.alias_weights true and false")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16, help="prompts per rank")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--samples", type=int, default=1, help="completions per prompt (GRPO's group size)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: pure sampling")
    p.add_argument("--workload", choices=("default", "grpo"), default="default",
                   help="grpo: a GRPO rollout batch per rank, 8 prompts x 8 samples of 128 new tokens after a "
                        "64-token prompt, sampled at temperature 1 (sets --prompts/--samples/--prompt-len/"
                        "--new-tokens/--temperature)")
    p.add_argument("--nogather", action="store_true", help="also time TRL's gather_deepspeed3_params=False path")
    p.add_argument("--rate-mbit", type=int, default=1000)
    p.add_argument("--bucket-bytes", type=int, default=32 << 20)
    args = p.parse_args()
    if args.workload == "grpo":
        args.prompts, args.samples, args.prompt_len, args.new_tokens, args.temperature = 8, 8, 64, 128, 1.0
    load0 = os.getloadavg()
    rows = []
    if args.part in ("rollout", "all"):
        rows += run_rollouts(args)
    if args.part in ("sync", "all"):
        rows += run_sync(args)
    if args.part == "profile":
        rows += run_profile(args)
    if args.part == "phases":
        rows += run_phases(args)
    load1 = os.getloadavg()
    notes = [f"load average (1, 5, 15 min) at start {tuple(round(x, 2) for x in load0)}, at end "
             f"{tuple(round(x, 2) for x in load1)} on a shared 2-core machine: wall-clock figures are noisy, "
             "tokens per CPU-second less so",
             "trl_zero3 reproduces TRL's unwrap_model_for_generation (gather_deepspeed3_params=True) on zerospeed's "
             "ZeRO-3 engine: GatheredParameters over every parameter, the ZeRO-3 hooks removed during HF generate and "
             "re-added after, as TRL's remove_hooks/add_hooks do (TRL's helper needs an Accelerate DeepSpeed plugin, "
             "not available on this machine)",
             "gather_s: the median call's weight-gather time, inside wall_s: zerospeed's one pass over the ZeRO-3 "
             "buckets into the rollout copy (RolloutStats.fill_s), trl_zero3's GatheredParameters enter + hook "
             "removal; 0 for the systems that gather nothing",
             f"workload {args.workload}: per rank {args.prompts} prompts x {args.samples} samples = "
             f"{args.prompts * args.samples} sequences, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
             + ("greedy" if args.temperature == 0 else f"sampled at temperature {args.temperature} (top_k 0, top_p 1;"
                " HF with num_return_sequences, zerospeed with n= sharing each prompt's prefill)")]
    for r in rows:
        print(r)
    json_path, md_path = write_results("rl_bench", rows, params=vars(args), notes=notes, command=command_line())
    print(f"results: {json_path} {md_path}")


if __name__ == "__main__":
    main()
