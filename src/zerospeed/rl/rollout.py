"""``engine.generate``: rollouts on zerospeed's inference engine over the live training weights (issue #32).

A :class:`RolloutEngine` is attached to a training engine by the facade when ``hybrid_engine.enabled``. It owns
one rollout copy of the model in the inference family's layout (:mod:`zerospeed.inference.models`), built once
on the meta device and materialised on the training device, and one :class:`InferenceEngine` around it (paged
KV cache, ragged batching, the sampler).

One ``generate`` call (every data-parallel rank calls it, each with its own prompts):

1. *fill*: the rollout copy is filled from the training parameters in one pass over the ZeRO-3 buckets. The
   weights that are contiguous ranges of the buckets (embeddings, LM head, linears, fused QKV / gate-up where the
   pieces are adjacent) are views of one kept arena (:mod:`zerospeed.rl.arena`) that each bucket is all-gathered
   straight into, once (no copy, no per-call allocation); every other weight is copied
   (:func:`zerospeed.rl.weights.run_pass`: LoRA adapters applied on the way, never merged into the shards),
   reading arena buckets from the arena and gathering any other bucket once, releasing it at once, so at most
   the buckets one job needs are gathered beside the copy;
2. *run*: the requests run to completion on this rank's inference engine, no collective at all;
3. *release*: with ``pin_parameters: false`` the copy's storage is freed (refilled next call); with
   ``release_inference_cache: true`` the KV cache's storage is freed (re-allocated next call).

Streamed mode (``max_resident_layers: N >= 1``): only the embeddings, final norm and LM head are filled up
front; each transformer layer is filled by a pre-forward hook from its buckets when a forward reaches it, and
at most N layers of the copy hold storage at any time (least recently used is freed). That gathers every layer
once per forward, so all ranks step in lock-step (a rank with nothing left runs gather-only passes until every
rank is done, agreed by a 1-element all-reduce per step). The C kernels (which keep packed weight copies) are
off in this mode.

Tensor parallelism (``tensor_parallel.autotp_size: T`` with ``inference_tp_size: T``): each TP rank's copy holds
its own training pieces, the TP ranks run one generation together (:mod:`zerospeed.rl.tp_layout`).

Greedy tokens equal HF ``generate`` on the gathered model: the rollout copy is the inference engine's own
family implementation, whose parity with HF is the inference tests' subject.

Memory accounting: :attr:`RolloutEngine.stats` reports the copy's resident bytes (peak), the KV cache bytes and
the all-gathers of the last call; the tests assert them against the configured bound.
"""

from __future__ import annotations

import importlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from zerospeed import comm
from zerospeed.config import ConfigError, HybridEngineConfig
from zerospeed.inference.api import RequestError, SamplingParams
from zerospeed.inference.engine import InferenceEngine
from zerospeed.inference.models import build_model, spec_from_config
from zerospeed.inference.models.layers import CausalLM
from zerospeed.inference.models import prefer_cpu_matmul_layout
from zerospeed.rl import tp_layout
from zerospeed.rl.arena import GatherArena, build_arena
from zerospeed.rl.weights import PlanReader, WeightSource, order_jobs, run_pass

SAMPLING_KEYS = ("max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p", "stop_token_ids",
                 "ignore_eos", "seed")


@dataclass
class RolloutStats:
    """What the last ``generate`` call did (this rank)."""

    num_gathers: int = 0  # bucket all-gathers started by the fills
    num_forwards: int = 0
    num_generated_tokens: int = 0
    weight_bytes_peak: int = 0  # the rollout copy's resident parameter bytes, at most
    layer_bytes: list[int] = field(default_factory=list)  # per transformer layer of the copy
    other_weight_bytes: int = 0  # embeddings, final norm, LM head
    kv_cache_bytes: int = 0
    arena_extra_bytes: int = 0  # gathered-arena bytes beyond the aliased weights (bucket padding; rl/arena.py)
    max_resident_layers_seen: int = 0
    fill_s: float = 0.0  # wall seconds of the call's up-front fill (all weights, or streamed: the non-layer ones)


class _Storage:
    """Frees and re-allocates the storage of a set of parameters (views stay valid, as ZeRO-3's buckets do)."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list({id(p): p for p in params}.values())
        self.nbytes = [p.data.untyped_storage().nbytes() for p in self.params]
        self.resident = True

    def free(self) -> None:
        for p in self.params:
            p.data.untyped_storage().resize_(0)
        self.resident = False

    def alloc(self) -> None:
        for p, n in zip(self.params, self.nbytes):
            if p.data.untyped_storage().nbytes() != n:
                p.data.untyped_storage().resize_(n)
        self.resident = True

    @property
    def bytes(self) -> int:
        return sum(self.nbytes)


def _hf_config(module: nn.Module) -> dict[str, Any]:
    cfg = getattr(module, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        raise ConfigError("hybrid_engine.enabled", f"engine.generate needs a HuggingFace causal LM (a module with a "
                          f".config); got {type(module).__name__}")
    return cfg.to_dict()


class RolloutEngine:
    def __init__(self, train_engine: Any, cfg: HybridEngineConfig, cpu_kernels: str = "auto",
                 greedy_head: str = "auto") -> None:
        self.cfg = cfg
        self.train_engine = train_engine
        module = train_engine.module
        spec = spec_from_config(_hf_config(module), f"{type(module).__name__}.config")
        self.spec = spec
        self.tp = tp_layout.training_tp(train_engine, cfg, spec)  # TPInfo(): no tensor parallelism
        max_len = cfg.max_out_tokens
        if spec.rotary_dim == 0 and max_len > spec.max_position_embeddings:
            raise ConfigError("hybrid_engine.max_out_tokens", f"{max_len} exceeds the model's "
                              f"{spec.max_position_embeddings} learned positions")
        if cfg.max_resident_layers > spec.num_layers:
            raise ConfigError("hybrid_engine.max_resident_layers", f"{cfg.max_resident_layers} exceeds the model's "
                              f"{spec.num_layers} layers (0 gathers the whole model once per rollout batch)")
        self.max_len = max_len
        self.streamed = cfg.max_resident_layers > 0
        self.dtype = train_engine.compute_dtype
        first = next(module.parameters())
        self.device = first.device
        self.source = WeightSource(module)
        self.model: CausalLM = build_model(spec, max_len, self.dtype, self.device, self.tp)
        reader = PlanReader(self.source, self.dtype, self.device)
        importlib.import_module(f"zerospeed.inference.models.{spec.family}").load_weights(self.model, reader)
        reader.finish(self.model)
        if self.tp.size > 1:  # each job reads pieces split the way the inference layer is split
            tp_layout.check_jobs(reader, self.model, self.source, spec, max_len, self.dtype, self.tp.group)
        prefer_cpu_matmul_layout(self.model)
        # whole-model mode: parameters that are contiguous ranges of the gathered buckets alias one kept arena (under
        # TP each rank's pieces; a vocabulary-split head assembled over TP is copied)
        self.arena: GatherArena | None = None
        copy_jobs = reader.jobs
        if cfg.alias_weights and not self.streamed:
            self.arena, copy_jobs = build_arena(reader.jobs, reader, self.source, self.dtype, self.device)
        aliased = {id(p) for p in self.arena.aliased} if self.arena is not None else set()
        self._cpu_kernels = "off" if self.streamed else cpu_kernels
        self._greedy_head = greedy_head
        layer_of = {id(p): i for i, layer in enumerate(self.model.layers) for p in layer.parameters()}
        self._layer_jobs: list[list[Any]] = [[] for _ in self.model.layers]
        other = []
        for job in reader.jobs:
            i = layer_of.get(id(job.target))
            (other if i is None else self._layer_jobs[i]).append(job)
        self._all = order_jobs(copy_jobs, self.source, self.arena.ids if self.arena is not None else frozenset())
        self._other = order_jobs(other, self.source)
        self._layers = [order_jobs(j, self.source) for j in self._layer_jobs]
        layer_ids = set(layer_of)
        self._other_storage = _Storage([p for p in self.model.parameters() if id(p) not in layer_ids | aliased])
        self._layer_storage = [_Storage([p for p in layer.parameters() if id(p) not in aliased])
                               for layer in self.model.layers]
        self._resident: list[int] = []  # streamed: layer indices holding storage, least recently used first
        self._filled: set[int] = set()
        self._hooks: list[Any] = []
        self.engine: InferenceEngine | None = None
        def logical(ps: Any) -> int:  # the aliased parameters' bytes (they live in the arena)
            return sum(p.numel() * p.element_size() for p in {id(p): p for p in ps}.values() if id(p) in aliased)

        self.stats = RolloutStats(
            layer_bytes=[s.bytes + logical(layer.parameters()) for s, layer in zip(self._layer_storage,
                                                                                   self.model.layers)],
            other_weight_bytes=self._other_storage.bytes + logical(p for p in self.model.parameters()
                                                                   if id(p) not in layer_ids),
            arena_extra_bytes=self.arena.extra_bytes if self.arena is not None else 0)
        self._ids = itertools.count()
        self._in_call = False
        self._gathers = 0
        if self.streamed:
            for i, layer in enumerate(self.model.layers):
                self._hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: self._ensure_layer(i)))
            for s in self._layer_storage:
                s.free()
        if not cfg.pin_parameters:  # allocated only during calls
            if self.arena is not None:
                self.arena.free()
            self._other_storage.free()
            for s in self._layer_storage:
                if s.resident:
                    s.free()
        self.version = 0  # fills done

    # -- weights ------------------------------------------------------------------------------
    def _resident_bytes(self) -> int:
        return (self._other_storage.bytes if self._other_storage.resident else 0) + \
            sum(s.bytes for s in self._layer_storage if s.resident) + \
            (self.arena.nbytes if self.arena is not None and self.arena.resident else 0)

    def _note_peak(self) -> None:
        self.stats.weight_bytes_peak = max(self.stats.weight_bytes_peak, self._resident_bytes())
        self.stats.max_resident_layers_seen = max(self.stats.max_resident_layers_seen,
                                                  sum(1 for s in self._layer_storage if s.resident))

    def _fill(self) -> None:
        """Step 1 of a call: the whole copy in one pass (or, streamed, the non-layer weights)."""
        if self.streamed:
            self._other_storage.alloc()
            self._note_peak()
            self._gathers += run_pass(self._other)
            self._filled.clear()
            return
        self._other_storage.alloc()
        for s in self._layer_storage:
            s.alloc()
        if self.arena is None:
            self._note_peak()
            self._gathers += run_pass(self._all)
            return
        self.arena.alloc()
        self._note_peak()
        self._gathers += self.arena.fill()  # the aliased parameters are filled now
        self.source.values = self.arena.value  # copy jobs read arena-held weights from the arena
        try:
            self._gathers += run_pass(self._all)
        finally:
            self.source.values = None

    def _ensure_layer(self, i: int) -> None:
        """Streamed mode's pre-forward hook: layer ``i`` filled from its buckets, at most N layers resident."""
        if i in self._filled and self._layer_storage[i].resident:
            self._resident.remove(i)
            self._resident.append(i)
            return
        while len(self._resident) >= self.cfg.max_resident_layers:
            j = self._resident.pop(0)
            self._layer_storage[j].free()
            self._filled.discard(j)
        self._layer_storage[i].alloc()
        self._resident.append(i)
        self._note_peak()
        self._gathers += run_pass(self._layers[i])
        self._filled.add(i)

    def _begin_forward(self) -> None:
        """Streamed mode: every forward refills every layer from the shards (the gathers are collectives that
        every rank runs in the same order)."""
        self._filled.clear()

    def _release(self) -> None:
        if self.streamed:
            for j in self._resident:
                self._layer_storage[j].free()
            self._resident.clear()
            self._filled.clear()
        if not self.cfg.pin_parameters:
            if self.arena is not None:
                self.arena.free()
            self._other_storage.free()
            for s in self._layer_storage:
                if s.resident:
                    s.free()
        if self.engine is not None and self.cfg.release_inference_cache:
            self.engine.kv.data.untyped_storage().resize_(0)

    def _engine(self) -> InferenceEngine:
        if self.engine is None:
            cfg, spec = self.cfg, self.spec
            kv_heads = spec.num_kv_heads
            from zerospeed.inference.kv_cache import kv_cache_bytes

            block_size = 16
            kv_heads //= self.tp.size  # this TP rank's heads
            block_bytes = kv_cache_bytes(spec.num_layers, 1, block_size, kv_heads, spec.head_dim, self.dtype)
            memory = cfg.kv_cache_memory or cfg.max_num_seqs * -(-self.max_len // block_size) * block_bytes
            num_blocks = max(1, memory // block_bytes)
            if num_blocks * block_size < self.max_len:
                raise ConfigError("hybrid_engine.kv_cache_memory", f"{memory} bytes hold {num_blocks} blocks of "
                                  f"{block_size} tokens, fewer than one sequence of max_out_tokens={self.max_len}")
            self.engine = InferenceEngine(
                self.model, spec, None, dtype=self.dtype, device=self.device, block_size=block_size,
                num_blocks=num_blocks, max_num_seqs=cfg.max_num_seqs, max_model_len=self.max_len,
                max_num_batched_tokens=max(512, self.max_len), model_name="rollout",
                enable_prefix_caching=False,  # cached K/V would outlive the weights that computed it
                max_prefill_tokens_with_decodes=None, max_decode_kv_bytes=None,
                greedy_head=self._greedy_head, cpu_kernels=self._cpu_kernels, tp=self.tp)
            if self.tp.size > 1 and self.tp.rank == 0:
                from zerospeed.inference.tp_runtime import attach_rank0

                attach_rank0(self.engine)  # each forward's batch goes to the other TP ranks first
            if self.streamed:
                self.model.register_forward_pre_hook(lambda m, a: self._begin_forward())
        elif self.engine.kv.data.untyped_storage().nbytes() != self.engine.kv.nbytes:
            self.engine.kv.data.untyped_storage().resize_(self.engine.kv.nbytes)
        return self.engine

    # -- the call -----------------------------------------------------------------------------
    def generate(self, prompts: Any, sampling: SamplingParams | dict[str, Any] | None = None, n: int = 1,
                 seeds: Sequence[int] | None = None, **sampling_kwargs: Any) -> list[list[int]]:
        """Completions of ``prompts`` (a list of token-id lists, or a 2-D int tensor without padding): a list of
        ``len(prompts) * n`` token-id lists, prompt-major (the ``n`` samples of prompt 0 first). ``sampling``: a
        :class:`SamplingParams` or a dict of its fields (``sampling_kwargs`` likewise); ``seeds``: one per
        prompt (sample j of prompt i uses ``seeds[i] + j``) or one per completion. A collective over the
        data-parallel group: every rank calls it (with its own prompts, possibly none)."""
        prompts = _prompt_lists(prompts)
        params = _params(sampling, sampling_kwargs)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise RequestError("n", f"must be an integer >= 1, got {n!r}")
        total = len(prompts) * n
        if seeds is not None:
            seeds = list(seeds)
            if len(seeds) not in (len(prompts), total):
                raise RequestError("seeds", f"{len(seeds)} seeds for {len(prompts)} prompts x n={n}: give one per "
                                   f"prompt or one per completion ({total})")
        if self._in_call:
            raise RuntimeError("engine.generate: called again while a rollout is running")
        self._in_call = True
        self._gathers = 0
        self.stats.weight_bytes_peak = 0
        self.stats.max_resident_layers_seen = 0
        try:
            t0 = time.perf_counter()
            self._fill()
            self.stats.fill_s = time.perf_counter() - t0
            engine = self._engine()
            forwards0, gen0 = engine._num_forwards, engine._num_generated
            if self.tp.size > 1:  # TP rank 0 schedules and samples, the others follow its forwards
                out = tp_layout.run_tp_group(self, engine, prompts, params, n, seeds)
            else:
                ids = self._add(engine, prompts, params, n, seeds)
                out = self._run(engine, ids)
            self.version += 1
            self.stats.num_forwards = engine._num_forwards - forwards0
            self.stats.num_generated_tokens = engine._num_generated - gen0
            self.stats.kv_cache_bytes = engine.kv.nbytes
            return out
        finally:
            self.stats.num_gathers = self._gathers
            self._release()
            self._in_call = False

    def _add(self, engine: InferenceEngine, prompts: list[list[int]], params: SamplingParams, n: int,
             seeds: list[int] | None) -> list[str]:
        from dataclasses import replace

        ids = []
        call = next(self._ids)
        try:
            for i, prompt in enumerate(prompts):
                parent = None
                for j in range(n):
                    p = params
                    if seeds is not None:
                        seed = seeds[i * n + j] if len(seeds) == len(prompts) * n else seeds[i] + j
                        p = replace(params, seed=int(seed))
                    elif params.seed is not None and n > 1:
                        p = replace(params, seed=params.seed + i * n + j)
                    rid = f"rollout{call}_{i}_{j}"
                    engine.add_request(rid, prompt, p, fork_of=parent)
                    parent = parent or rid
                    ids.append(rid)
        except Exception:
            for rid in ids:
                engine.abort(rid)
            raise
        return ids

    def _run(self, engine: InferenceEngine, ids: list[str]) -> list[list[int]]:
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        errors: dict[str, str] = {}
        group = self.train_engine.dp_group
        lockstep = self.streamed and comm.get_world_size(group) > 1
        flag = torch.zeros(1, dtype=torch.int64)
        while True:
            busy = engine.has_unfinished()
            if lockstep:
                flag.fill_(int(busy))
                comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=group)
                if not int(flag):
                    break
            elif not busy:
                break
            before = engine._num_forwards
            for o in (engine.step() if busy else []):
                if o.request_id in out:
                    out[o.request_id].extend(o.new_token_ids)
                    if o.error:
                        errors[o.request_id] = o.error
            if lockstep and engine._num_forwards == before:  # no forward here: join the other ranks' gathers
                self._begin_forward()
                for i in range(len(self._layer_storage)):
                    self._ensure_layer(i)
        if errors:
            raise RuntimeError(f"engine.generate: requests failed: {errors}")
        return [out[rid] for rid in ids]


def _prompt_lists(prompts: Any) -> list[list[int]]:
    if torch.is_tensor(prompts):
        if prompts.dim() != 2 or prompts.is_floating_point():
            raise RequestError("prompts", f"a tensor of prompts must be 2-D integer token ids, got "
                               f"{prompts.dim()}-D {prompts.dtype}")
        return [[int(t) for t in row] for row in prompts.tolist()]
    if not isinstance(prompts, (list, tuple)):
        raise RequestError("prompts", f"must be a list of token-id lists or a 2-D tensor, got {type(prompts).__name__}")
    out = []
    for i, p in enumerate(prompts):
        if torch.is_tensor(p):
            p = p.tolist()
        if not isinstance(p, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise RequestError("prompts", f"prompt {i} is not a list of integer token ids")
        out.append(list(p))
    return out


def _params(sampling: Any, kwargs: dict[str, Any]) -> SamplingParams:
    if isinstance(sampling, SamplingParams):
        if kwargs:
            from dataclasses import replace

            return replace(sampling, **kwargs)
        return sampling
    merged = dict(sampling or {}, **kwargs) if sampling is None or isinstance(sampling, dict) else None
    if merged is None:
        raise RequestError("sampling", f"expected SamplingParams or a dict, got {type(sampling).__name__}")
    bad = sorted(set(merged) - set(SAMPLING_KEYS))
    if bad:
        raise RequestError(bad[0], f"is not a sampling parameter of engine.generate ({', '.join(SAMPLING_KEYS)})")
    if "stop_token_ids" in merged:
        merged["stop_token_ids"] = tuple(merged["stop_token_ids"])
    return SamplingParams(**merged)

