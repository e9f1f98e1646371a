"""The inference engine: requests in, tokens out, one ragged forward per ``step()``.

``build_engine(model_dir, ...)`` (:mod:`zerospeed.inference.build`) loads our own implementation of the
folder's model family (see :mod:`zerospeed.inference.models`), its tokenizer, and sizes the paged KV cache; the
:class:`InferenceEngine` then follows the contract in :mod:`zerospeed.inference.api`.

One step: the scheduler (Dynamic SplitFuse, :mod:`~zerospeed.inference.scheduler`) picks this
forward's tokens; copy-on-write block copies are applied; the model runs once over the flat token
batch (no padding) writing K/V into the cache; logits are computed only for sequences whose known
tokens are now all in the cache (decodes, last prompt chunks); the sampler picks their next tokens
(when every one of them is plain greedy, the model may return the argmax tokens straight from its
LM head instead, :meth:`CausalLM.greedy_tokens`); stop conditions are checked and finished
sequences free their blocks at once.

Fast paths (issue #25; :mod:`~zerospeed.inference.fast_path_choice`): on CPU in float32, each kernel
family (decode attention and its glue, RMSNorm, SwiGLU's gate, the skinny GEMM, the greedy head's C
passes) runs zerospeed's C kernel (:mod:`~zerospeed.inference.cpu_kernel`) or its torch twin, and
greedy rows take their tokens from a float32, bfloat16 or int8 LM head. ``cpu_kernels`` (auto|on|off),
``packed_linear`` (auto|on|off: float32 linears and LM head through oneDNN on weights packed once,
:mod:`zerospeed.ops.packed_linear`) and ``greedy_head`` (auto|float32|bf16|int8) choose: ``auto`` times the candidates once per shape class
(a few eagerly at build, the rest when first served) and keeps the fastest, a forced value is used or
is an error naming the switch. The choice is logged once at build (logger ``zerospeed``; also
``InferenceEngine.fast_path_report``). ``attention_backend`` (auto|torch|cpu_kernel, older) sets the
attention family alone: ``torch`` keeps attention in torch, ``cpu_kernel`` forces the C attention,
``auto`` follows ``cpu_kernels``. The tokens are HF's whichever path runs.

Decode batch: ``max_decode_kv_bytes`` (default ``"auto"``, see ``DECODE_KV_RATIO``) bounds the K/V
the running sequences hold at their longest, so the K/V any decode step reads; the scheduler admits
requests first-in first-out within it (and within ``max_num_seqs``).

Failure isolation: bad requests are refused by ``add_request`` with :class:`RequestError` (nothing
changes); an exception inside a forward fails only the requests of that forward (each gets a
finished output with ``error``), and the engine keeps serving the rest.

Cache sizing: ``num_blocks`` if given, else ``kv_cache_memory`` bytes (default: enough for
``max_num_seqs`` full-length sequences, capped at 25% of free host memory on CPU or 90% of free
device memory on GPU), divided by the bytes of one block,
``2 * layers * block_size * kv_heads * head_dim * element_size``. ``max_model_len`` is capped at
what the cache can hold.

Tensor parallel (``tensor_parallel > 1``, one process per rank): every rank holds its share of
heads and MLP columns; rank 0 owns the scheduler and the sampler and broadcasts each forward's
ragged batch (see :mod:`zerospeed.inference.tp_runtime`); the other ranks run
:meth:`InferenceEngine.run_worker_loop`.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import torch

from zerospeed.inference.api import EngineStats, RequestError, RequestOutput, SamplingParams
from zerospeed.inference.attention import AttentionMetadata, Workspace
from zerospeed.inference.constraints import Guides, PendingMasks
from zerospeed.inference.fast_path_choice import (CpuKernels, PackedLinears, quiet_choices, set_model_kernels,
                                                  set_model_packed)
from zerospeed.inference.forward_plan import ForwardPlanner
from zerospeed.inference.kv_cache import BlockAllocator, KVCache, kv_cache_bytes
from zerospeed.inference.models import CausalLM, ModelSpec, TPInfo
from zerospeed.inference.sampling import is_greedy, make_generator, record_prompt_logprobs, sample, validate
from zerospeed.inference.scheduler import ScheduledBatch, Scheduler
from zerospeed.inference.sequence import Sequence
from zerospeed.inference.stopping import jump_forward, stop_reason
from zerospeed.inference.tokenizer import Tokenizer
from zerospeed.ops.fast_paths import resolve_setting, size_class

log = logging.getLogger("zerospeed")

ATTENTION_BACKENDS = ("auto", "torch", "cpu_kernel")

# max_decode_kv_bytes="auto": the K/V that the running sequences hold at their longest may be at most
# this fraction of the weight bytes one decode step reads (CausalLM.decode_weight_bytes: the blocks as
# stored, the LM head as the greedy path reads it). Why: a decode step is bound by the bytes it reads,
# the weights once (shared by every running sequence) plus each sequence's K/V, and each sequence
# also brings per-row work (its matmul rows, attention arithmetic, sampling) that measured about as
# much again as its K/V read (bench model, one thread, 2026-11-24: a step costs ~2.0 ms, about the
# time to read its 19 MiB of weights, plus ~0.3 ms per sequence of ~200 tokens, whose K/V read is
# ~0.16 ms). So the fraction sets the step time relative to a weights-only step, about 1 + 2 x ratio,
# and the cost per token. Measured frontier (bench/results/inference_bench-20261124-053840.md,
# offline, tokens per CPU-second vs HF static batches of 8 / p95 inter-token latency vs HF batch 1):
# 0.5: 3.13x / 0.64x, 0.75: 4.28x / 0.70x, 1.0: 4.54x / 0.87x, no bound: 4.94x / 2.21x. 0.75 is the
# knee: from 0.5 throughput grows 37% for 9% longer gaps, past it 6% for 24%.
DECODE_KV_RATIO = 0.75


# The shape classes measured at build (the rest when first served): the greedy head and the C kernels
# of decode steps of every batch class up to this many sequences (capped by max_num_seqs; the K/V
# budget's default lets about 12 run on the bench model; this class's head sizes that budget,
# decode_weight_bytes), the kernels at EAGER_CONTEXT tokens of context.
EAGER_DECODE_ROWS = 16
# the context length (tokens) of the eager attention measurements (capped by max_model_len)
EAGER_CONTEXT = 256


def resolve_attention_backend(backend: str, dtype: torch.dtype, device: torch.device) -> str:
    """Validates ``attention_backend``: ``auto`` (attention follows ``cpu_kernels``), ``torch`` (SDPA over
    gathered blocks whatever ``cpu_kernels`` says) or ``cpu_kernel`` (the C attention, float32 on CPU
    only; an error at build when the kernels do not build). Returns it."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: {backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    fits = torch.device(device).type == "cpu" and dtype == torch.float32
    if backend == "cpu_kernel" and not fits:
        raise ValueError(f"attention_backend: 'cpu_kernel' needs float32 on CPU, not {dtype} on {device}")
    return backend



class InferenceEngine:
    def __init__(self, model: CausalLM, spec: ModelSpec, tokenizer: Tokenizer | None, *, dtype: torch.dtype,
                 device: torch.device, block_size: int, num_blocks: int, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int, model_name: str = "", enable_prefix_caching: bool = True,
                 tp: TPInfo = TPInfo(), kv_cache_memory: int | None = None,
                 max_prefill_tokens_with_decodes: int | None = None, attention_backend: str = "auto",
                 prefill_first: bool = True, max_decode_kv_bytes: int | str | None = None,
                 greedy_head: str = "auto", cpu_kernels: str = "auto", packed_linear: str = "auto") -> None:
        self.model = model
        self.spec = spec
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.model_name = model_name
        self.tp = tp
        kv_heads = spec.num_kv_heads // tp.size
        self.kv = KVCache(spec.num_layers, num_blocks, block_size, kv_heads, spec.head_dim, dtype, device)
        self.kv_cache_bytes_formula = kv_cache_bytes(spec.num_layers, num_blocks, block_size, kv_heads,
                                                     spec.head_dim, dtype)
        self.kv_cache_memory = kv_cache_memory
        self.workspace = Workspace()  # attention's gather buffers, reused by every forward
        with quiet_choices():  # the start-up line below reports them
            self._setup_fast_paths(attention_backend, greedy_head, cpu_kernels, max_num_seqs, max_model_len,
                                   packed_linear)
        self.allocator = BlockAllocator(num_blocks, block_size)
        kv_token_bytes = kv_cache_bytes(spec.num_layers, 1, 1, kv_heads, spec.head_dim, dtype)
        if max_decode_kv_bytes == "auto":
            max_decode_kv_bytes = int(DECODE_KV_RATIO * model.decode_weight_bytes())
        self.max_decode_kv_bytes = max_decode_kv_bytes
        kv_tokens = None if max_decode_kv_bytes is None else max(1, max_decode_kv_bytes // kv_token_bytes)
        self.scheduler = Scheduler(self.allocator, max_num_batched_tokens, max_num_seqs, enable_prefix_caching,
                                   max_prefill_tokens_with_decodes, prefill_first, kv_tokens)
        self.max_model_len = min(max_model_len, num_blocks * block_size)
        self.eos_token_ids = list(spec.eos_token_ids)
        self._seqs: dict[str, Sequence] = {}
        self._arrival = itertools.count()
        self._num_generated = 0
        self._num_prompt = 0
        self._num_forwards = 0
        self._forward_s = 0.0
        self._prompt_parts: list[tuple[Sequence, int, int]] = []  # the last forward's prompt rows
        # the last forward's guided rows (indices among its sampled rows) and their token masks
        self._guided: PendingMasks | None = None
        self.guides = Guides(tokenizer, spec.vocab_size, list(spec.eos_token_ids))
        self._worker_hook = None  # set by tp_runtime on rank 0: broadcasts each batch
        self.spmd = False  # every rank schedules and samples the same (init_inference); no broadcast

    def _setup_fast_paths(self, attention_backend: str, greedy_head: str, cpu_kernels: str, max_num_seqs: int,
                          max_model_len: int, packed_linear: str = "auto") -> None:
        """Resolve ``cpu_kernels`` / ``greedy_head`` (config value > ``ZEROSPEED_FAST_PATHS`` > auto), measure
        the eager shape classes, log the choice once."""
        start = time.perf_counter()
        resolve_attention_backend(attention_backend, self.dtype, self.device)
        head = resolve_setting("greedy_head", greedy_head, "greedy_head")
        fits = self.device.type == "cpu" and self.dtype == torch.float32
        kernels = CpuKernels(cpu_kernels, source="cpu_kernels", applies=fits,
                             why_not_applies=f"{str(self.dtype).replace('torch.', '')} on {self.device.type}")
        # tensor-parallel ranks would time differently and round differently: auto is off there
        packed = PackedLinears("off" if self.tp.size > 1 and resolve_setting("packed_linear", packed_linear) == "auto"
                               else packed_linear, applies=fits,
                               why_not_applies=f"{str(self.dtype).replace('torch.', '')} on {self.device.type}")
        set_model_packed(self.model, packed)
        self.planner = ForwardPlanner(self.model, self.spec, self.tp.size, kernels, attention_backend, self.block_size,
                                      packed)
        self.attention_backend = "cpu_kernel" if self.planner.live and self.planner.attention_forced is not False \
            else "torch"
        set_model_kernels(self.model, kernels)
        model = self.model
        # ranks > 0 of a tensor-parallel engine never pick tokens (init_inference's SPMD mode, where they
        # do, never passes auto): nothing to measure or copy there
        model.greedy_head = "float32" if head == "auto" and self.tp.rank != 0 else head
        top = size_class(min(max_num_seqs, EAGER_DECODE_ROWS))
        model.decode_rows_hint = top
        heads = []
        w = getattr(model.lm_head, "weight", None)
        if model._greedy_applies(w):
            # every decode class up to `top`: measured (or checked, when forced) now, not mid-serving
            heads = [(r, model._greedy_choice(r).head) for r in (1 << i for i in range(top.bit_length()))]
            chosen = {h for _, h in heads}
            for name, attr in (("bf16", "_lm_head_bf16_t"), ("int8", "_lm_head_int8")):
                if name not in chosen:  # a copy made only to be measured: freed (remade if a class needs it)
                    model.__dict__.pop(attr, None)
            if not packed.packed_head_used():
                model.__dict__.pop("_lm_head_packed", None)
        self.planner.prepare(tuple(1 << i for i in range(top.bit_length())), min(max_model_len, EAGER_CONTEXT))
        self.fast_path_setup_s = time.perf_counter() - start
        if heads:
            greedy = f"greedy_head={head} -> " + ", ".join(f"rows {r}: {h}" for r, h in heads)
        else:
            greedy = f"greedy_head={head} (float32 logits: the head is not a float32 CPU head without bias)"
        self.fast_path_report = (f"zerospeed inference fast paths: {self.planner.report()}; {greedy} "
                                 f"(chosen in {self.fast_path_setup_s * 1e3:.0f} ms; other shape classes are "
                                 "measured when first served, logged by zerospeed.fast_paths)")
        log.info("%s", self.fast_path_report)

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    fork_of: str | None = None) -> None:
        """``fork_of``: the id of a waiting or running request with the same prompt whose prompt K/V this
        one shares (OpenAI's ``n`` / ``best_of``): its prompt is computed once, the blocks are shared and
        copied on write."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError("params", f"expected SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise RequestError("request_id", f"must be a non-empty string, got {request_id!r}")
        if request_id in self._seqs:
            raise RequestError("request_id", f"{request_id!r} is already in use")
        try:
            prompt = [int(t) for t in prompt_token_ids]
        except (TypeError, ValueError):
            raise RequestError("prompt", "must be a list of integer token ids") from None
        if not prompt:
            raise RequestError("prompt", "is empty (a prompt needs at least one token)")
        vocab = self.spec.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        validate(params, vocab)
        if len(prompt) >= self.max_model_len and not (params.max_new_tokens == 0
                                                        and len(prompt) <= self.max_model_len):
            raise RequestError("prompt", f"{len(prompt)} tokens do not fit the context of {self.max_model_len} "
                                         "tokens (at least one new token must fit)")
        if len(prompt) + params.max_new_tokens > self.max_model_len:
            raise RequestError("max_new_tokens", f"{params.max_new_tokens} new tokens after a {len(prompt)}-token "
                                                 f"prompt exceed the context of {self.max_model_len} tokens "
                                                 f"(at most {self.max_model_len - len(prompt)})")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop", "stop strings need a tokenizer, and the model folder has none")
        parent = None
        if fork_of is not None:
            parent = self._seqs.get(fork_of)
            if parent is None or parent.tokens[:parent.prompt_len] != prompt:
                raise RequestError("fork_of", f"{fork_of!r} is not a waiting or running request with this prompt")
            if params.prompt_logprobs is not None or parent.num_generated:
                raise RequestError("fork_of", "a fork takes no prompt_logprobs and needs a parent still in its prompt")
        stop_set = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_set.update(self.eos_token_ids)
        if params.guide is not None and not isinstance(params.guide, str):
            raise RequestError("guide", f"must be a grammar string or None, got {type(params.guide).__name__}")
        matcher = self.guides.matcher(params.guide) if params.guide is not None else None
        gen = make_generator(params.seed) if params.do_sample and params.temperature > 0 else None
        seq = Sequence(request_id, prompt, params, next(self._arrival), gen, frozenset(stop_set))
        seq.matcher = matcher
        self._seqs[request_id] = seq
        if parent is not None:
            self.scheduler.add_fork(seq, parent)
        else:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        seq.finish_reason = "abort"
        self.scheduler.finish(seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    # -- the step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.items:
            return []
        try:
            logits = self._forward(batch)
        except Exception as exc:  # fail this forward's requests, keep the engine serving
            return self._fail(batch, f"{type(exc).__name__}: {exc}")
        self.scheduler.after_forward(batch)
        done = [seq for seq, _ in batch.items if seq.num_remaining == 0]
        need = [seq for seq in done if seq.params.max_new_tokens > 0]
        if self._prompt_parts:
            record_prompt_logprobs(logits[len(need):], self._prompt_parts)
            logits = logits[:len(need)]
        outputs: list[RequestOutput] = []
        for seq in done:
            if seq.params.max_new_tokens == 0:  # scored, nothing to generate
                seq.finish_reason = "length"
                self.scheduler.finish(seq)
                self._seqs.pop(seq.request_id, None)
                outputs.append(self._with_prompt_logprobs(seq, RequestOutput(
                    seq.request_id, [], finished=True, finish_reason="length",
                    num_prompt_tokens=seq.prompt_len, num_generated_tokens=0)))
        if not need:
            return outputs
        if logits.dim() == 1:  # the greedy tokens themselves (see run_forward)
            tokens, chosen, tops = logits.tolist(), [None] * len(need), [None] * len(need)
        else:
            if self._guided is not None:  # the masks computed during the forward, for every guided row
                self._guided.apply(logits)
            tokens, chosen, tops = sample(logits, need)
        for seq, tok, lp, top in zip(need, tokens, chosen, tops):
            seq.tokens.append(tok)
            self._num_generated += 1
            self._check_stop(seq, tok)
            new = [tok]
            if seq.matcher is not None and not seq.is_finished and seq.params.logprobs is None:
                new += self._jump_forward(seq)  # tokens the grammar forces: no forward of their own
            out = RequestOutput(seq.request_id, new, finished=seq.is_finished, finish_reason=seq.finish_reason,
                                num_prompt_tokens=seq.prompt_len, num_generated_tokens=seq.num_generated,
                                new_logprobs=None if lp is None else [lp],
                                new_top_logprobs=None if top is None else [top], stop_reason=seq.stop_reason)
            outputs.append(self._with_prompt_logprobs(seq, out))
            if seq.is_finished:
                self._seqs.pop(seq.request_id, None)
        return outputs

    @staticmethod
    def _with_prompt_logprobs(seq: Sequence, out: RequestOutput) -> RequestOutput:
        """Attach the prompt's logprobs to the request's first output (once)."""
        if seq.params.prompt_logprobs is not None and not seq.prompt_sent:
            seq.prompt_sent = True
            out.prompt_logprobs = list(seq.prompt_lps)
            out.prompt_top_logprobs = list(seq.prompt_tops)
        return out

    def _jump_forward(self, seq: Sequence) -> list[int]:
        out = jump_forward(seq, self.guides, self._check_stop)  # tokens the grammar forces (stopping.py)
        self._num_generated += len(out)
        return out

    def _check_stop(self, seq: Sequence, tok: int) -> None:
        reason = stop_reason(seq, tok, self.tokenizer)
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq)

    def _fail(self, batch: ScheduledBatch, message: str) -> list[RequestOutput]:
        if self._guided is not None:  # the mask worker may still read these sequences' matchers
            self._guided.wait()
        outs = []
        for seq, _ in batch.items:
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)
            self._seqs.pop(seq.request_id, None)
            outs.append(RequestOutput(seq.request_id, [], finished=True, finish_reason="abort",
                                      num_prompt_tokens=seq.prompt_len, num_generated_tokens=seq.num_generated,
                                      error=message))
        return outs

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run the model over ``batch``; logits ``[N, V]`` (float32) for the sequences that sample."""
        # decodes longest context first: attention groups them by similar length (less key padding)
        nd = batch.num_decodes
        batch.items[:nd] = sorted(batch.items[:nd], key=lambda item: -item[0].num_computed)
        items = [(seq.num_computed, n, seq.blocks) for seq, n in batch.items]
        ids: list[int] = []
        for seq, n in batch.items:
            ids.extend(seq.tokens[seq.num_computed:seq.num_computed + n])
        rows = []
        prompt_rows: list[int] = []
        # prompt_logprobs: positions p of this forward with p + 1 < prompt_len score token p + 1; their
        # logits follow the sampled rows (at most this forward's tokens x vocab, never the whole prompt)
        self._prompt_parts = []
        t = 0
        for seq, n in batch.items:
            if seq.needs_prompt_logits:
                first = max(seq.num_computed, len(seq.prompt_lps) - 1)
                end = min(seq.num_computed + n, seq.prompt_len - 1)
                if end > first:
                    prompt_rows.extend(range(t + first - seq.num_computed, t + end - seq.num_computed))
                    self._prompt_parts.append((seq, first, end - first))
            t += n
            if seq.num_computed + n == len(seq.tokens) and seq.params.max_new_tokens > 0:
                rows.append(t - 1)
        rows += prompt_rows
        if self._worker_hook is not None:
            self._worker_hook(ids, items, batch.num_decodes, batch.copies, rows)
        sampling = [s for s, n in batch.items if s.num_computed + n == len(s.tokens) and s.params.max_new_tokens > 0]
        # structured output: the token masks of this forward's guided rows (their matchers have consumed
        # every token so far), computed on a worker thread while the model runs, so the greedy head below
        # can use them too
        self._guided = None
        guided = [(i, s.matcher) for i, s in enumerate(sampling) if s.matcher is not None]
        if guided:
            self._guided = self.guides.start([i for i, _ in guided], [m for _, m in guided], self.spec.vocab_size)
        # every sampled row greedy, no logprobs, no stop token masked by min_new_tokens: the model may
        # give the argmax tokens without all the logits (guided rows too: their masks are applied to the
        # approximate logits before the exact candidates are chosen, CausalLM.greedy_tokens)
        greedy = not prompt_rows and all(is_greedy(s.params) and s.params.logprobs is None
                                         and not (s.stop_set and s.num_generated < s.params.min_new_tokens)
                                         for s in sampling)
        refuse = None if self._guided is None else self._guided.apply
        # run_forward counts every chunk's tokens as prompt tokens: not the generated ones jump-forward left to compute
        self._num_prompt -= sum(max(0, seq.num_computed + n - max(seq.num_computed, seq.prompt_len))
                                for seq, n in batch.items[nd:] if seq.matcher is not None)
        return self.run_forward(ids, items, batch.num_decodes, batch.copies, rows, greedy=greedy, refuse=refuse)

    @torch.inference_mode()
    def run_forward(self, ids: list[int], items: list[tuple[int, int, list[int]]], num_decodes: int,
                    copies: list[tuple[int, int]], rows: list[int], all_ranks: bool = False,
                    greedy: bool = False, refuse: Any = None) -> torch.Tensor:
        """The part every tensor-parallel rank runs identically. Returns the logits ``[N, V]`` of
        ``rows`` (None on ranks that do not sample), or with ``greedy`` possibly their argmax tokens
        ``[N]`` instead (:meth:`CausalLM.greedy_tokens`, when it applies; ``refuse`` masks the tokens
        guided rows may not take, see there)."""
        start = time.perf_counter()
        for src, dst in copies:
            self.kv.copy_block(src, dst)
        plan = self.planner.plan(len(ids), num_decodes, max(c for c, _, _ in items[:num_decodes]) + 1
                                 if num_decodes else 0)
        meta = AttentionMetadata.build(items, num_decodes, self.block_size, self.device, self.workspace,
                                       kernels=plan)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, meta, self.kv)
        logits = None
        if rows and (self.tp.rank == 0 or all_ranks or self.spmd):
            idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
            last = hidden.index_select(0, idx)
            logits = None
            if greedy:
                logits = self.model.greedy_tokens(last) if refuse is None else self.model.greedy_tokens(last, refuse)
            if logits is None:
                logits = self.model.compute_logits(last)
        self._num_forwards += 1
        self._num_prompt += sum(n for c, n, _ in items[num_decodes:])
        self._forward_s += time.perf_counter() - start
        return logits

    # -- introspection ------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting), num_blocks_total=self.allocator.num_blocks,
            num_blocks_free=self.allocator.num_free, block_size=self.block_size, kv_cache_bytes=self.kv.nbytes,
            num_generated_tokens=self._num_generated, num_prompt_tokens=self._num_prompt,
            num_preemptions=s.num_preemptions,
            extra={"kv_cache_bytes_formula": float(self.kv_cache_bytes_formula),
                   "prefix_cache_hit_blocks": float(self.allocator.num_prefix_hits),
                   "num_forwards": float(self._num_forwards), "forward_seconds": float(self._forward_s),
                   "max_decode_kv_bytes": float(self.max_decode_kv_bytes or 0)})

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[list[int]]:
        """Convenience: run ``prompts`` to completion, return each one's generated token ids."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"_gen{next(self._arrival)}_{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        errors: dict[str, str] = {}
        while any(rid in self._seqs for rid in ids):
            for o in self.step():
                if o.request_id in out:
                    out[o.request_id].extend(o.new_token_ids)
                    if o.error:
                        errors[o.request_id] = o.error
        if errors:
            raise RuntimeError(f"requests failed: {errors}")
        return [out[rid] for rid in ids]

    # -- tensor parallel ----------------------------------------------------------------------
    def run_worker_loop(self) -> None:
        if self.tp.size == 1:
            raise RuntimeError("run_worker_loop is for ranks > 0 of a tensor-parallel engine")
        from zerospeed.inference.tp_runtime import worker_loop

        worker_loop(self)

    def shutdown(self) -> None:
        if self.tp.size > 1 and self.tp.rank == 0:
            from zerospeed.inference.tp_runtime import send_shutdown

            send_shutdown(self)

