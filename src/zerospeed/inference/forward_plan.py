"""``ForwardPlanner``: the :class:`~zerospeed.inference.fast_path_choice.KernelPlan` of each forward of one engine,
measured on the engine's own layers (issue #25; how choices are made: :mod:`zerospeed.inference.fast_path_choice`).

Split from ``fast_path_choice`` (issue #34): the planner times the model's layers and attention, which read their
plans and greedy-head choices from ``fast_path_choice``; here, above both, no import runs in a circle.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from zerospeed.inference import cpu_kernel
from zerospeed.inference.fast_path_choice import (ATTENTION_PROBE_BYTES, AUTO_SKINNY_MAX_ROWS, OFF, ON_SKINNY_ROWS,
                                                  CpuKernels, KernelPlan, PackedLinears, _pair, packed_pair)
from zerospeed.ops.fast_paths import Candidate, FastPathError, size_class

__all__ = ["ForwardPlanner"]


class ForwardPlanner:
    """The :class:`KernelPlan` of each forward of one engine: cached per (token class, decode class,
    context class, threads), built by measuring each kernel family once per shape class under
    ``cpu_kernels=auto`` (by fixed rules under ``on``; none under ``off``).

    ``attention_backend`` (a :func:`~zerospeed.inference.build.build_engine` argument older than this
    switch) sets the attention family alone: ``torch`` keeps attention in torch whatever
    ``cpu_kernels`` says, ``cpu_kernel`` forces the C attention (an error if the kernels do not build
    or ``cpu_kernels=off``), ``auto`` follows ``cpu_kernels``."""

    def __init__(self, model: Any, spec: Any, tp_size: int, kernels: CpuKernels, attention_backend: str,
                 block_size: int, packed: PackedLinears | None = None) -> None:
        self.model, self.spec, self.kernels = model, spec, kernels
        self.packed = packed if packed is not None else PackedLinears("off")
        self.block_size = block_size
        if attention_backend == "cpu_kernel":
            if kernels.setting == "off":
                raise FastPathError(f"attention_backend: 'cpu_kernel' contradicts {kernels.source}='off'")
            if not kernels.live:
                raise FastPathError(f"attention_backend: 'cpu_kernel' could not be built: {kernels.why}")
        self.attention_forced = {"torch": False, "cpu_kernel": True}.get(attention_backend)
        self.live = kernels.live
        self.hq, self.hkv = spec.num_heads // tp_size, spec.num_kv_heads // tp_size
        self.d = spec.head_dim
        self.window = next((w for w in spec.sliding_windows if w), None) if spec.sliding_windows else None
        block = model.layers[0] if len(getattr(model, "layers", ())) else None
        self.fused_block = block is not None and hasattr(block, "_forward_cpu")
        self.rot = spec.rotary_dim or spec.head_dim
        self.linears: list[torch.nn.Module] = []
        self.packed_linears: list[torch.nn.Module] = []  # one linear of each weight shape packed_linear may take
        self.norm = None
        self.inter = None
        from zerospeed.inference.models.layers import RMSNorm, RowLinear

        if self.fused_block:
            for lin in (block.attn.qkv, block.attn.o, block.mlp.gate_up, block.mlp.down):
                if type(lin) in (torch.nn.Linear, RowLinear) and getattr(getattr(lin, "tp", None), "size", 1) == 1:
                    if lin.weight.dtype == torch.float32 and lin.weight.device.type == "cpu" and \
                            all(o.weight.shape != lin.weight.shape for o in self.packed_linears):
                        self.packed_linears.append(lin)
                    if lin.weight.shape[0] % 16 == 0:
                        self.linears.append(lin)
            self.norm = block.input_norm
            if block.mlp.act is F.silu:
                self.inter = block.mlp.inter
        elif type(getattr(model, "norm", None)) is RMSNorm:
            self.norm = model.norm
        self._plans: dict[tuple, KernelPlan] = {}
        self._on_plans: dict[tuple, KernelPlan] = {}
        self.eager: list[tuple[str, KernelPlan]] = []

    # -- per forward -----------------------------------------------------------------------------
    def plan(self, num_tokens: int, num_decodes: int, max_ctx: int) -> KernelPlan:
        """The plan of a forward of ``num_tokens`` tokens, ``num_decodes`` of them decodes whose longest
        context is ``max_ctx``. A cache hit is a few size classes and a dict lookup."""
        if not self.live and not (self.packed.live and self.packed_linears):
            return OFF
        threads = torch.get_num_threads()
        if self.kernels.setting == "on" and self.live:
            skinny = ON_SKINNY_ROWS[0] <= num_tokens <= ON_SKINNY_ROWS[1] and threads == 1
            key = (skinny, threads == 1, size_class(num_tokens))
            hit = self._on_plans.get(key)
            if hit is None:
                packed = self._packed(size_class(num_tokens), threads, lambda w: skinny and w.shape[0] % 16 == 0)
                hit = self._on_plans[key] = KernelPlan(attention=self.attention_forced is not False, rms_norm=True,
                                                       silu_mul=threads == 1, skinny_all=skinny, packed=packed)
            return hit
        key = (size_class(num_tokens), size_class(num_decodes) if num_decodes else 0,
               size_class(max_ctx) if num_decodes else 0, threads)
        hit = self._plans.get(key)
        if hit is None:
            hit = self._plans[key] = self._measure_plan(*key)
        return hit

    def _measure_plan(self, rows: int, decodes: int, ctx: int, threads: int) -> KernelPlan:
        k = self.kernels
        if self.attention_forced is not None:
            attention = self.attention_forced
        elif decodes:
            attention = k.use("attention", (decodes, ctx, self.hq, self.hkv, self.d, self.fused_block, threads),
                              lambda: self._attention_candidates(decodes, ctx))
        elif self.fused_block:  # prompt chunks only: the C glue (rotary, cache writes) or torch's
            attention = k.use("attention", (0, rows, self.hq, self.hkv, self.d, True, threads),
                              lambda: self._glue_candidates(rows))
        else:  # prompt chunks only, attention through `attend`: no C kernel runs either way
            attention = False
        rms = False
        if self.norm is not None:
            n = self.norm
            rms = k.use("rms_norm", (rows, n.weight.shape[0], threads), lambda: self._norm_candidates(rows))
        silu = False
        if self.inter is not None:
            silu = k.use("silu_mul", (rows, self.inter, threads), lambda: self._silu_candidates(rows))
        skinny = set()
        if rows <= AUTO_SKINNY_MAX_ROWS:
            for lin in self.linears:
                shape = tuple(lin.weight.shape)
                if k.use("skinny_gemm", (rows, *shape, threads), lambda lin=lin: self._skinny_candidates(lin, rows)):
                    skinny.add(shape)
        packed = self._packed(rows, threads, lambda w: w.shape in skinny)
        return KernelPlan(attention=attention, rms_norm=rms, silu_mul=silu, skinny=frozenset(skinny), packed=packed)

    def _packed(self, rows: int, threads: int, skinny: Any) -> frozenset:
        """The weight shapes whose linears run packed for oneDNN in a forward of ``rows`` (a class) tokens:
        each timed against the path it would replace (the skinny GEMM where ``skinny(weight)``, else
        ``F.linear``), once per shape class; all of them with ``packed_linear=on``."""
        out = set()
        for lin in self.packed_linears:
            shape = tuple(lin.weight.shape)
            key = ("block", rows, *shape, threads, bool(skinny(lin.weight)))
            if self.packed.use(key, lambda lin=lin: self._packed_candidates(lin, rows, bool(skinny(lin.weight)))):
                out.add(shape)
        return frozenset(out)

    def _packed_candidates(self, lin: torch.nn.Module, rows: int, skinny: bool) -> dict[str, Candidate]:
        from zerospeed.inference.models.layers import _derived_on
        from zerospeed.ops import packed_linear

        w, b = lin.weight, lin.bias
        x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
        if skinny:
            def plain() -> torch.Tensor:
                return cpu_kernel.skinny_linear(x, _derived_on(lin, "_packed_weight", w, cpu_kernel.pack_weight), b)
        else:
            def plain() -> torch.Tensor:
                return F.linear(x, w, b)

        def packed() -> torch.Tensor:
            return packed_linear.linear(x, _derived_on(lin, "_onednn_weight", w, packed_linear.pack), b)
        return packed_pair(plain, packed, evict=rows <= AUTO_SKINNY_MAX_ROWS)

    # -- candidates ----------------------------------------------------------------------------------
    def _norm_candidates(self, rows: int) -> dict[str, Candidate]:
        norm = self.norm
        x = torch.randn(rows, norm.weight.shape[0], generator=torch.Generator().manual_seed(rows))
        return _pair(lambda: norm(x), lambda: cpu_kernel.rms_norm(x, norm.weight, norm.eps))

    def _silu_candidates(self, rows: int) -> dict[str, Candidate]:
        inter, act = self.inter, F.silu
        gu = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows))

        def twin() -> torch.Tensor:
            gate, up = gu.split(inter, dim=-1)
            return act(gate) * up
        return _pair(twin, lambda: cpu_kernel.silu_mul(gu, inter))

    def _skinny_candidates(self, lin: torch.nn.Module, rows: int) -> dict[str, Candidate]:
        from zerospeed.inference.models.layers import _derived_on

        w, b = lin.weight, lin.bias
        x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))

        def c() -> torch.Tensor:
            packed = _derived_on(lin, "_packed_weight", w, cpu_kernel.pack_weight)
            return cpu_kernel.skinny_linear(x, packed, b)
        # Where the skinny GEMM was measured faster when written (2-24 rows, one thread) it is the incumbent:
        # in isolation it and MKL time within a few percent of each other (the choice flipped between runs),
        # while in the decode step it won (bench, 2026-11-25, steady state: 2928 tokens per CPU-second with
        # the kernels on against 2662 with torch's GEMM at those rows); elsewhere MKL is.
        c_first = ON_SKINNY_ROWS[0] <= rows <= ON_SKINNY_ROWS[1] and torch.get_num_threads() == 1
        return _pair(lambda: F.linear(x, w, b), c, evict=True, c_first=c_first)

    def _attention_candidates(self, decodes: int, ctx: int) -> dict[str, Candidate]:
        """One layer's attention of ``decodes`` sequences of ``ctx`` tokens with C (the fused glue:
        rotary, cache writes, decode attention; or the decode attention alone for families that
        attend through ``attend``) or torch (rotary, ``index_copy_``, gathered SDPA), on a synthetic
        cache (random rows repeated; at most :data:`ATTENTION_PROBE_BYTES` a cache, sequences
        beyond share blocks)."""
        from zerospeed.inference.attention import AttentionMetadata, Workspace
        from zerospeed.inference.models.layers import apply_rotary

        hq, hkv, d, bs, rot, window, fused = self.hq, self.hkv, self.d, self.block_size, self.rot, self.window, \
            self.fused_block
        g = torch.Generator().manual_seed(decodes * 131 + ctx)
        per_seq = -(-ctx // bs)
        num_blocks = max(per_seq, min(per_seq * decodes, ATTENTION_PROBE_BYTES // (bs * hkv * d * 4))) + 1
        kc, vc = self._cache_pair(num_blocks, g)
        usable = num_blocks - 1  # block 0 stays out of the tables (padding)
        items = [(ctx - 1, 1, [1 + (s * per_seq + b) % usable for b in range(per_seq)]) for s in range(decodes)]
        qkv, cos, sin = self._rows(decodes, g)
        ws = Workspace()

        def run(c: bool) -> torch.Tensor:
            meta = AttentionMetadata.build(items, decodes, bs, torch.device("cpu"), ws, kernels=KernelPlan(attention=c))
            if c and fused:
                return meta.attend_qkv(qkv, hq, hkv, d, cos, sin, kc, vc, None, window)
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q = apply_rotary(q.view(decodes, hq, d), cos, sin, rot)
            k = apply_rotary(k.view(decodes, hkv, d), cos, sin, rot)
            return meta.attend(q, k, v.view(decodes, hkv, d), kc, vc, None, window)
        return _pair(lambda: run(False), lambda: run(True))

    def _glue_candidates(self, rows: int) -> dict[str, Candidate]:
        """A prompt chunk of ``rows`` tokens: what differs between the paths is the glue (rotary of q
        and k, K/V written to the cache) in one C call or in torch; the chunk's SDPA is the same."""
        from zerospeed.inference.models.layers import apply_rotary

        hq, hkv, d, bs, rot = self.hq, self.hkv, self.d, self.block_size, self.rot
        g = torch.Generator().manual_seed(rows)
        kc, vc = self._cache_pair(-(-rows // bs) + 1, g)
        slots = torch.arange(bs, bs + rows)
        qkv, cos, sin = self._rows(rows, g)
        cos_rows, sin_rows = cos.reshape(rows, -1), sin.reshape(rows, -1)

        def twin() -> torch.Tensor:
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q = apply_rotary(q.view(rows, hq, d), cos, sin, rot)
            k = apply_rotary(k.view(rows, hkv, d), cos, sin, rot)
            kc.index_copy_(0, slots, k)
            vc.index_copy_(0, slots, v.view(rows, hkv, d))
            return q

        def c() -> torch.Tensor:
            return cpu_kernel.attention_layer(qkv, 0, hq, hkv, d, cos_rows, sin_rows, slots, kc, vc, None, None, bs,
                                              0, None, self.window, want_k=True)[1]
        return _pair(twin, c)

    def _cache_pair(self, num_blocks: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        # random rows repeated: randn of a whole cache would cost more than the measurement
        pattern = torch.randn(64, self.hkv, self.d, generator=g)
        n = num_blocks * self.block_size
        reps = -(-n // 64)
        return (pattern.repeat(reps, 1, 1)[:n].contiguous(), pattern.flip(0).repeat(reps, 1, 1)[:n].contiguous())

    def _rows(self, rows: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = torch.randn(rows, (self.hq + 2 * self.hkv) * self.d, generator=g)
        emb = torch.rand(rows, self.rot, generator=g)
        return qkv, emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)

    # -- start-up --------------------------------------------------------------------------------
    def prepare(self, rows_classes: tuple[int, ...], ctx: int) -> None:
        """Measure the plans of decode-only forwards of ``rows_classes`` sequences of ``ctx`` tokens now
        (reported at start-up; other classes are measured when first served)."""
        if not (self.live or (self.packed.live and self.packed_linears)) or (self.live and self.kernels.setting == "on"):
            return
        for rows in rows_classes:
            self.eager.append((f"rows {rows}", self.plan(rows, rows, ctx)))

    def report(self) -> str:
        head = self.kernels.describe() + ", " + self.packed.describe()
        if self.attention_forced is not None and self.live:
            head += f", attention_backend={'cpu_kernel' if self.attention_forced else 'torch'}"
        if not self.eager and not (self.live and self.kernels.setting == "on"):
            return head
        if self.kernels.setting == "on":
            return head + ": every kernel where it applies (skinny GEMM 2-24 rows, one thread)"
        return head + ": " + "; ".join(f"{what}: {p.describe()}" for what, p in self.eager) + " (measured)"
