"""Rank functions of the RL tests (tests/test_rl*.py): engine.generate over live ZeRO-3 weights (issue #32).

Each builds the same tiny random-weight HF llama on every rank, trains one step at ZeRO-3 (so the rollout reads
*updated* shards, not the initial weights), then rolls out on rank-specific prompts and returns what the test
checks: the tokens, HF's greedy tokens on the gathered model (and how many of them the arithmetic decides), the
all-gathers counted during the call, and the rollout's counted bytes.
"""

from __future__ import annotations

import copy

import torch

import zerospeed
from inference_cases import hf_greedy_decided, make_model, prompts
from zerospeed import comm, zero
from zerospeed.zero.stage3 import registry


def rl_config(world: int, **hybrid) -> dict:
    return {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "allgather_bucket_size": 20000,
                                  "stage3_param_persistence_threshold": 0},
            "hybrid_engine": {"enabled": True, "max_out_tokens": 64, "max_num_seqs": 8, **hybrid}}


def _train_step(engine, rank: int) -> None:
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(3, 300, (1, 12), generator=g)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()


def _buckets(module) -> list:
    seen = {}
    for p in module.parameters():
        found = registry.lookup(p)
        if found is not None:
            seen[id(found[0])] = found[0]
    return sorted(seen.values(), key=lambda b: b.index)


def _gathered_copy(engine, base):
    """An HF model holding the engine's current (gathered) weights."""
    ref = copy.deepcopy(base)
    with zero.GatheredParameters(list(engine.module.parameters())):
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    ref.load_state_dict(state)
    return ref.eval()


def rollout_case(max_resident_layers: int = 0, lora: bool = False, max_new_tokens: int = 10,
                 family: str = "llama", **hybrid) -> dict:
    rank, world = comm.get_rank(), comm.get_world_size()
    base = make_model(family, seed=3)
    model = copy.deepcopy(base)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                                                 lora_dropout=0.0, init_lora_weights=False))
        base = copy.deepcopy(model)  # the reference's template: the same PEFT wrapping, unpartitioned
    engine, *_ = zerospeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=rl_config(world, max_resident_layers=max_resident_layers, **hybrid))
    _train_step(engine, rank)
    ps = prompts([5 + rank, 9, 3 + 2 * rank], seed=10 + rank)
    buckets = _buckets(engine.module)
    owner = buckets[0].owner
    owner.live_peak_bytes = owner.live_bytes
    shards = [b.shard.clone() for b in buckets]
    before = comm.COUNTER.snapshot().get("all_gather", {"count": 0, "elements": 0})
    out = engine.generate(ps, max_new_tokens=max_new_tokens, ignore_eos=True)
    after = comm.COUNTER.snapshot()["all_gather"]
    rollout = engine.rl.rollout
    stats = rollout.stats
    result = {
        "tokens": out, "num_forwards": stats.num_forwards, "num_gathers": stats.num_gathers,
        "all_gathers": after["count"] - before["count"], "gather_elements": after["elements"] - before["elements"],
        "bucket_numels": [b.padded_numel for b in buckets], "bucket_bytes": [b.full_bytes for b in buckets],
        "live_peak_bytes": owner.live_peak_bytes, "weight_bytes_peak": stats.weight_bytes_peak,
        "layer_bytes": stats.layer_bytes, "other_weight_bytes": stats.other_weight_bytes,
        "kv_cache_bytes": stats.kv_cache_bytes, "max_resident_layers_seen": stats.max_resident_layers_seen,
        "resident_after": rollout._resident_bytes(),
        "shards_unchanged": all(torch.equal(a, b.shard) for a, b in zip(shards, buckets)),
    }
    # the reference: HF generate on the gathered (trained) model
    if lora:
        ref = _gathered_copy(engine, base).merge_and_unload()
        plain = _gathered_copy(engine, base).unload()  # the same base weights, adapters dropped
        result["hf_without_lora"] = [hf_greedy_decided(plain, p, max_new_tokens)[0] for p in ps]
    else:
        ref = _gathered_copy(engine, base)
    result["hf"] = [hf_greedy_decided(ref, p, max_new_tokens) for p in ps]
    # shards untouched by the rollout (LoRA not merged into them): a second call gives the same tokens
    result["again"] = engine.generate(ps, max_new_tokens=max_new_tokens, ignore_eos=True)
    # buckets someone holds gathered (here the user's GatheredParameters) are read from their full buffers
    with zero.GatheredParameters(list(engine.module.parameters())):
        result["inside_gathered"] = engine.generate(ps, max_new_tokens=max_new_tokens, ignore_eos=True)
    arena = rollout.arena
    result["arena"] = None if arena is None else {
        "buckets": len(arena.buckets), "aliased": len(arena.aliased), "bytes": arena.nbytes,
        "extra_bytes": stats.arena_extra_bytes,
        "padding_bytes": sum((b.padded_numel - b.layout.numel) * (b.full_bytes // b.padded_numel)
                             for b in arena.buckets)}
    # another training step: the next rollout reads the new weights (the aliased ones re-gathered in place, the
    # engine's derived layouts of them rebuilt), HF's greedy tokens on the newly gathered model
    _train_step(engine, rank)
    result["after_step"] = engine.generate(ps, max_new_tokens=max_new_tokens, ignore_eos=True)
    ref2 = _gathered_copy(engine, base).merge_and_unload() if lora else _gathered_copy(engine, base)
    result["hf_after_step"] = [hf_greedy_decided(ref2, p, max_new_tokens) for p in ps]
    return result


def sampling_case() -> dict:
    """n samples per prompt with per-prompt seeds: reproducible, independent of the other requests."""
    world = comm.get_world_size()
    engine, *_ = zerospeed.initialize(model=make_model("llama", seed=3), config=rl_config(world))
    ps = prompts([4, 6], seed=5)
    kw = dict(max_new_tokens=8, do_sample=True, temperature=1.0, top_k=50, ignore_eos=True)
    a = engine.generate(ps, n=3, seeds=[11, 22], **kw)
    b = engine.generate(ps[1:], n=3, seeds=[22], **kw)
    c = engine.generate(ps, n=3, seeds=[11, 23], **kw)
    errors = []
    for bad in (dict(n=0), dict(seeds=[1, 2, 3]), dict(bogus=1), dict(prompts_override="x")):
        try:
            if "prompts_override" in bad:
                engine.generate("not a list", max_new_tokens=2)
            else:
                engine.generate(ps, max_new_tokens=2, **bad)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    # the engine still works after refused calls (nothing half-done)
    d = engine.generate(ps, n=3, seeds=[11, 22], **kw)
    return {"a": a, "b": b, "c": c, "d": d, "errors": errors}


def release_case() -> dict:
    """release_inference_cache: true frees the KV cache after the call; pin_parameters: false frees the copy."""
    world = comm.get_world_size()
    engine, *_ = zerospeed.initialize(model=make_model("llama", seed=3),
                                      config=rl_config(world, release_inference_cache=True, pin_parameters=False))
    ps = prompts([4, 6], seed=5)
    a = engine.generate(ps, max_new_tokens=6, ignore_eos=True)
    rollout = engine.rl.rollout
    kv_after = rollout.engine.kv.data.untyped_storage().nbytes()
    resident_after = rollout._resident_bytes()
    b = engine.generate(ps, max_new_tokens=6, ignore_eos=True)
    return {"a": a, "b": b, "kv_after": kv_after, "resident_after": resident_after,
            "peak": rollout.stats.weight_bytes_peak, "kv": rollout.stats.kv_cache_bytes}


def bad_config_case(hybrid: dict) -> str:
    from zerospeed.config import ConfigError

    try:
        zerospeed.initialize(model=make_model("gpt2", seed=3) if "max_out_tokens" in hybrid else make_model("llama"),
                             config=rl_config(1, **hybrid))
    except ConfigError as exc:
        return str(exc)
    return "no error"


# -- weight sync to a `zerospeed serve` subprocess (tests/test_rl_sync.py) ------------------------------------

SYNC_FAST_PATHS = {"cpu_kernels": "off", "greedy_head": "float32"}  # the server runs the same (its flags)


def tp_sync_case(folder: str, address: str, prompt: list[int], max_new_tokens: int) -> dict:
    """sync_weights from an AutoTP (tp 2) x ZeRO-3 trainer: whole tensors assembled over the TP group from the
    pieces, TP rank 0 of dp rank 0 alone talks to the server; every rank returns the server's version."""
    from transformers import AutoModelForCausalLM

    world = comm.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    cfg = rl_config(world // 2, max_out_tokens=96, inference_tp_size=2)
    cfg["tensor_parallel"] = {"autotp_size": 2}
    cfg["fast_paths"] = dict(SYNC_FAST_PATHS)
    cfg["optimizer"]["params"]["lr"] = 0.05  # a visible change of the greedy output after one step
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    mesh = comm.get_mesh()
    g = torch.Generator().manual_seed(11 + mesh.dp_rank)
    ids = torch.randint(3, 250, (1, 12), generator=g)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    tokens = engine.generate([prompt], max_new_tokens=max_new_tokens, ignore_eos=True)[0]  # the TP rollout
    sends0 = comm.COUNTER.snapshot().get("send", {"bytes": 0})["bytes"]
    report = engine.sync_weights(address, bucket_bytes=8192)
    sent = comm.COUNTER.snapshot().get("send", {"bytes": 0})["bytes"] - sends0
    return {"tokens": tokens, "version": report.version, "payload_bytes": report.payload_bytes, "sent_bytes": sent,
            "tp_rank": mesh.tp_rank, "dp_rank": mesh.dp_rank,
            "model_bytes": sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(folder).parameters())}


def _folder_engine(folder: str, lora: bool, world: int, seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                                                 lora_dropout=0.0, init_lora_weights=False))
    cfg = rl_config(world, max_out_tokens=96)
    cfg["fast_paths"] = dict(SYNC_FAST_PATHS)
    cfg["optimizer"]["params"]["lr"] = 0.05  # a visible change of the greedy output after one step
    engine, *_ = zerospeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=cfg)
    g = torch.Generator().manual_seed(seed + comm.get_rank())
    ids = torch.randint(3, 250, (1, 12), generator=g)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    return engine


def sync_case(folder: str, address: str, prompt: list[int], max_new_tokens: int, lora: bool = False,
              bucket_bytes: int = 4096) -> dict:
    engine = _folder_engine(folder, lora, comm.get_world_size(), seed=7 if lora else 5)
    tokens = engine.generate([prompt], max_new_tokens=max_new_tokens, ignore_eos=True)[0]
    buckets = _buckets(engine.module)
    sends0 = comm.COUNTER.snapshot().get("send", {"bytes": 0})["bytes"]
    report = engine.sync_weights(address, lora_only=lora, bucket_bytes=bucket_bytes)
    sent = comm.COUNTER.snapshot().get("send", {"bytes": 0})["bytes"] - sends0
    adapter_bytes = 0
    if lora:  # the adapters' sizes live in the bucket layout under ZeRO-3 (the parameters are placeholders)
        adapter_bytes = 0
        for n, p in engine.module.named_parameters():
            if ".lora_A." in n or ".lora_B." in n:
                bucket, pos = registry.lookup(p)
                adapter_bytes += bucket.layout.slots[pos].numel * 4
    model_bytes = sum(b.layout.slots[i].numel * 4 for b in buckets for i in range(len(b.layout.slots)))
    own = 0  # bytes of the model inside this rank's shards (persistent buckets are whole everywhere)
    for b in (b for b in buckets if not b.persistent):
        lo, hi = b.shard_start, b.shard_end
        own += sum(max(0, min(hi, s.offset + s.numel) - max(lo, s.offset)) * 4 for s in b.layout.slots)
    return {"tokens": tokens, "version": report.version, "payload_bytes": report.payload_bytes,
            "sent_bytes": sent, "num_buckets": report.num_buckets, "bucket_bytes": report.bucket_bytes,
            "peak_gathered_bytes": report.peak_gathered_bytes, "max_bucket_bytes": max(b.full_bytes for b in buckets),
            "adapter_bytes": adapter_bytes, "model_bytes": model_bytes, "send_buffer_bytes": report.send_buffer_bytes,
            "own_shard_bytes": own, "trainer_send_bytes": sent}


def refused_sync_case(folder: str, address: str) -> str:
    engine = _folder_engine(folder, True, comm.get_world_size(), seed=7)
    try:
        engine.sync_weights(address, lora_only=True)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def killed_sync_case(folder: str, address: str) -> None:
    """Dies (os._exit) right after the first payload bucket went out: the sync is left half done."""
    import os

    from zerospeed.rl import sync

    engine = _folder_engine(folder, False, comm.get_world_size(), seed=9)
    original = sync._Sender.flush

    def flush_then_die(self):
        original(self)
        if self.num_buckets >= 1:
            os._exit(3)

    sync._Sender.flush = flush_then_die
    engine.sync_weights(address, bucket_bytes=4096)


def grpo_case(steps: int, lr: float) -> dict:
    """examples/grpo_toy.py's train() on this process group (the example's own code, not a copy)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import grpo_toy

    return grpo_toy.train(steps=steps, prompts_per_rank=8, group=8, lr=lr, seed=0, log=None)


def tp_refused_case(hybrid: dict, family: str = "llama") -> str:
    """hybrid_engine on a tensor-parallel (AutoTP) engine with what TP rollouts do not build: one clear line."""
    from zerospeed.config import ConfigError

    cfg = rl_config(1, **hybrid)
    cfg["tensor_parallel"] = {"autotp_size": 2}
    cfg["zero_optimization"] = {"stage": 1}
    try:
        zerospeed.initialize(model=make_model(family, seed=3), config=cfg)
    except ConfigError as exc:
        return str(exc)
    return "no error"


def tp_rollout_case(stage: int, max_new_tokens: int = 10) -> dict:
    """engine.generate on an AutoTP (tp 2) training engine, after a training step: each TP rank runs the inference
    engine on its own training pieces; the reference is HF generate on the gathered (TP-merged) model."""
    from zerospeed.module_inject.gather import gather_tp_state_dict

    world = comm.get_world_size()
    base = make_model("llama", seed=3)
    model = copy.deepcopy(base)
    cfg = rl_config(world // 2, inference_tp_size=2)
    cfg["tensor_parallel"] = {"autotp_size": 2}
    cfg["zero_optimization"]["stage"] = stage
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    mesh = comm.get_mesh()
    _train_step(engine, mesh.dp_rank)  # the TP ranks of a dp rank share its micro-batch
    ps = prompts([5 + mesh.dp_rank, 9, 3], seed=10 + mesh.dp_rank)
    before = comm.COUNTER.snapshot().get("all_reduce", {"count": 0})["count"]
    out = engine.generate(ps, max_new_tokens=max_new_tokens, ignore_eos=True)
    all_reduces = comm.COUNTER.snapshot().get("all_reduce", {"count": 0})["count"] - before
    stats = engine.rl.rollout.stats
    with zero.GatheredParameters(list(engine.module.parameters())):
        local = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    full = gather_tp_state_dict(local, engine.module, mesh)
    ref = copy.deepcopy(base)
    ref.load_state_dict(full)
    ref.eval()
    rollout = engine.rl.rollout
    qkv = rollout.model.layers[0].attn.qkv.weight
    return {"tokens": out, "hf": [hf_greedy_decided(ref, p, max_new_tokens) for p in ps],
            "tp_rank": mesh.tp_rank, "dp_rank": mesh.dp_rank, "num_forwards": stats.num_forwards,
            "all_reduces": all_reduces, "num_layers": len(rollout.model.layers),
            "qkv_rows": qkv.shape[0], "full_qkv_rows": sum(full[f"model.layers.0.self_attn.{x}_proj.weight"].shape[0]
                                                          for x in "qkv"),
            "again": engine.generate(ps, max_new_tokens=max_new_tokens, ignore_eos=True),
            "arena_aliased": 0 if rollout.arena is None else len(rollout.arena.aliased)}


def tp_mismatched_prompts_case(port: int) -> list[str]:
    """TP ranks of one group asking for different rollouts: one error, on every rank; sync_weights under TP to
    nobody (``port`` free): TP rank 0 alone connects, its error raised on both TP ranks alike."""
    cfg = rl_config(1, inference_tp_size=2)
    cfg["tensor_parallel"] = {"autotp_size": 2}
    cfg["zero_optimization"]["stage"] = 0
    engine, *_ = zerospeed.initialize(model=make_model("llama", seed=3), config=cfg)
    errors = []
    for call in (lambda: engine.generate([[5, 6, 7 + comm.get_rank()]], max_new_tokens=2),
                 lambda: engine.sync_weights(f"127.0.0.1:{port}", timeout_s=3)):
        try:
            call()
            errors.append("no error")
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {exc}")
    return errors


def hybrid_off_case() -> dict:
    """Without hybrid_engine, engine.generate is the module's own HF generate, as before issue #32."""
    world = comm.get_world_size()
    cfg = rl_config(world)
    cfg["hybrid_engine"] = {"enabled": False}
    cfg["zero_optimization"] = {"stage": 0}
    model = make_model("llama", seed=3)
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    ids = torch.tensor([prompts([6], seed=4)[0]])
    out = engine.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return {"is_tensor": torch.is_tensor(out), "shape": tuple(out.shape), "rl_enabled": engine.rl.enabled}


def bad_sync_input_case(folder: str) -> list[str]:
    """sync_weights' own errors, no server involved: a malformed address, nobody listening, a bad bucket size."""
    engine = _folder_engine(folder, False, comm.get_world_size(), seed=5)
    out = []
    for kwargs in ({"address": "no-port"}, {"address": "127.0.0.1:1", "timeout_s": 3.0},
                   {"address": "127.0.0.1:2", "bucket_bytes": 0}):
        try:
            engine.sync_weights(**kwargs)
            out.append("no error")
        except Exception as exc:  # noqa: BLE001
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def mismatched_sync_case(address: str) -> str:
    """A trainer whose model is not the server's: the server names the mismatch and keeps its weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    engine, *_ = zerospeed.initialize(model=model, config=rl_config(comm.get_world_size()))
    try:
        engine.sync_weights(address)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"
