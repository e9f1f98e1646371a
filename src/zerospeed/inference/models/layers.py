"""Building blocks shared by our model families: norms, rotary embeddings, activations, and the
tensor-parallel layout (which rank holds which heads / MLP columns).

Numerics follow HF's reference implementations operation by operation where it matters for greedy
parity in fp32 (RMSNorm in float32, rotary tables from float32 ``positions * inv_freq``,
``q * cos + rotate_half(q) * sin``, GPT-2's tanh GELU formula).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerospeed.inference import cpu_kernel, fast_path_choice
from zerospeed.inference.models import greedy_head as int8_head
from zerospeed.inference.models.spec import ModelLoadError, ModelSpec
from zerospeed.ops import packed_linear
from zerospeed.ops.fast_paths import FastPathError, size_class


@dataclass(frozen=True)
class TPInfo:
    """Tensor-parallel placement of one rank: attention heads and MLP columns are split evenly;
    embeddings, norms and the LM head are replicated. ``group`` is the TP process group (None: the
    default group)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def split(self, total: int, what: str) -> int:
        if total % self.size:
            raise ModelLoadError(f"{what} ({total}) is not divisible by tensor_parallel size {self.size}")
        return total // self.size

    def shard(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous 1/size slice of ``t`` along ``dim``."""
        if self.size == 1:
            return t
        n = t.shape[dim] // self.size
        return t.narrow(dim, self.rank * n, n)


def all_reduce_tp(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    if tp.size > 1:
        from zerospeed.comm import collectives

        collectives.all_reduce(x, group=tp.group)
    return x


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _gelu_tanh_formula(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_new": _gelu_tanh_formula,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ModelLoadError(f"activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class RotaryTable(nn.Module):
    """cos/sin for every position up to ``max_positions``: ``[P, rotary_dim]`` in float32, looked up
    once per forward by the batch's positions and shared by every layer."""

    def __init__(self, spec: ModelSpec, max_positions: int) -> None:
        super().__init__()
        self.spec, self.max_positions = spec, max_positions
        self.rotary_dim = spec.rotary_dim
        self.fill()

    def fill(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the tables in float32 (after the model was materialised from meta / cast)."""
        inv = self.spec.inv_freq()
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        emb = torch.outer(pos, inv)
        emb = torch.cat((emb, emb), dim=-1)
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """``x [T, H, D]``; rotate-half convention on the first ``rotary_dim`` features."""
    if rotary_dim == x.shape[-1]:
        half = rotary_dim // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos) + (rot * sin)
    xr, xp = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rot = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
    return torch.cat(((xr * cos) + (rot * sin), xp), dim=-1)


# The LM head on CPU in float32 multiplies by a transposed copy of its weight (``[H, V]``, contiguous,
# made once and remade if the weight changes): MKL's GEMM is faster that way than F.linear's
# ``x @ W.t()`` over the ``[V, H]`` weight. Measured (bench/inference_step_profile.py's layout test
# and a sweep, 32000 x 256 head, one thread of this 2-core Xeon, CPU ms): 4 rows 2.34 -> 1.61,
# 8: 3.47 -> 1.78, 16: 3.81 -> 2.67, 32: 5.72 -> 4.19, 64: 10.06 -> 7.13; bitwise-identical logits from
# 12 rows up, float32 rounding (~1e-6 absolute) below; at 1-2 rows F.linear was as fast or faster, so
# those keep it. The price is one more copy of the head's weight in memory (for a tied head too).
LOGITS_TRANSPOSED_MIN_ROWS = 3


# Greedy rows on CPU (float32) may skip the float32 logits (``greedy_head``, see
# fast_path_choice.choose_greedy_head, which times the three ways on the served shape class and keeps
# the fastest; or forced): a bfloat16 copy of the LM head gives approximate logits, every token whose
# approximate logit is within twice the error bound of the row's best is a candidate, and the
# candidates' exact float32 logits pick the token (lowest id on ties, as argmax). The bound: inputs and
# weights rounded to bfloat16 (unit roundoff u = 2^-8), products accumulated in float32 (H * 2^-24),
# the result rounded to bfloat16 (u): |approx - exact| <= (3u + H 2^-24) * sum_i |h_i w_ji| <= that
# times ||h|| * max_j ||w_j||, used with a factor 2 to spare. So the token is the float32 argmax (up
# to float32 rounding of the candidates' dot products, as any change of summation order). A row with
# more than GREEDY_MAX_CANDIDATES candidates (flat logits) gets its exact logits in full. The
# selection and the candidates' dot products run in C where ``cpu_kernels`` lets them
# (cpu_kernel.greedy_refine: one pass over each row's bfloat16 logits for the maximum, one for the
# candidates; in torch, greedy_head.refine_torch, those passes cost more than the matmul saved). The
# bfloat16 weight is packed by oneDNN once (torch.mm re-packed it at every call: 3.0 ms for one row,
# against 1.6 packed). Measured on a Xeon with AMX (bench's 32000 x 256 head, one thread, caches
# flushed as in a step, LM head plus argmax): 1 row 3.1 -> 2.5 ms, 4 rows 6.1 -> 2.7, 8 rows 9.0 ->
# 2.9, 32 rows 9.8 -> 4.2. An int8 copy of the head (8 MB, models/greedy_head.py, its own proven
# bound) read by oneDNN's int8 matmul was faster still there (engine decode steps of 12 sequences
# 7.83 -> 7.44 CPU ms), and 137x slower than float32 on an AMD EPYC with VNNI (issue #25): which CPU
# feature makes a path fast is not something a flag tells, hence the measurement.
GREEDY_APPROX_MIN_ROWS = 1
GREEDY_MAX_CANDIDATES = 2048
#: the decode batch (rows) whose greedy head ``decode_weight_bytes`` counts, unless the engine sets it
DECODE_ROWS_HINT = 16


class CausalLM(nn.Module):
    """What every family implements: a ragged forward to final hidden states, then logits for the
    rows asked for (each sequence's last token). Families set ``spec``, ``tp`` and ``lm_head``."""

    spec: ModelSpec
    tp: TPInfo

    def forward(self, input_ids: torch.Tensor, meta: Any, kv: Any) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def input_embedding(self) -> nn.Embedding:  # pragma: no cover
        raise NotImplementedError

    def tie_weights(self) -> None:
        """Share the LM head with the input embedding when the config ties them (re-done after
        materialising from meta, which allocates every parameter separately)."""
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.input_embedding().weight

    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every parameter as stored except the input embedding
        (a few rows of it are read), the LM head as the greedy path of a decode batch of
        ``decode_rows_hint`` rows reads it (its int8 or bfloat16 copy where :meth:`greedy_tokens`
        chose one for that shape class, which this call may measure)."""
        emb = self.input_embedding().weight
        head = getattr(self.lm_head, "weight", None)
        total = sum(p.numel() * p.element_size() for p in self.parameters() if p is not emb and p is not head)
        if head is not None:
            per = head.element_size()
            if self._greedy_applies(head):
                per = {"int8": 1, "bf16": 2}.get(self._greedy_choice(self.decode_rows_hint).head, per)
            total += head.numel() * per
        return total

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w, rows = getattr(self.lm_head, "weight", None), hidden.shape[0]  # None: a QuantizedLinear (quant)
        if w is not None and hidden.dim() == 2 and hidden.dtype == torch.float32 and self._packed_head(rows):
            return packed_linear.linear(hidden, self._derived("_lm_head_packed", w, packed_linear.pack),
                                        self.lm_head.bias)
        return self._plain_logits(hidden)

    def _plain_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w, rows = getattr(self.lm_head, "weight", None), hidden.shape[0]
        if (w is not None and w.device.type == "cpu" and w.dtype == torch.float32 and hidden.dtype == torch.float32
                and rows >= LOGITS_TRANSPOSED_MIN_ROWS and self.lm_head.bias is None):
            return torch.mm(hidden, self._lm_head_transposed(w))
        return self.lm_head(hidden).float()

    def _packed_head(self, rows: int) -> bool:
        """Whether ``rows`` rows of float32 logits come from the LM head packed for oneDNN (``packed_linear``:
        forced, or timed against :meth:`_plain_logits` once per rows class and thread count)."""
        packed = fast_path_choice.model_packed(self)
        w = self.lm_head.weight
        if not packed.live or type(self.lm_head) is not nn.Linear or w.dtype != torch.float32 \
                or w.device.type != "cpu":
            return False
        rows_class, threads = size_class(rows), torch.get_num_threads()

        def candidates() -> dict:
            hidden = fast_path_choice.representative_hidden(self, rows_class)
            return fast_path_choice.packed_pair(
                lambda: self._plain_logits(hidden),
                lambda: packed_linear.linear(hidden, self._derived("_lm_head_packed", w, packed_linear.pack),
                                             self.lm_head.bias), evict=rows_class <= 64)
        return packed.use(("lm_head", rows_class, *w.shape, threads), candidates)

    #: the greedy LM head on CPU in float32 (``greedy_head`` of the engine): "auto" (measured per
    #: shape class, see fast_path_choice), "float32" (logits and argmax), "bf16" or "int8" (an
    #: approximate head refined to the float32 argmax; an error where its op cannot run)
    greedy_head: str = "auto"
    _greedy_source: str = "greedy_head"  # the name the user set it by, for errors
    #: the decode batch whose head :meth:`decode_weight_bytes` counts (the engine's decode class)
    decode_rows_hint: int = DECODE_ROWS_HINT

    @property
    def greedy_approx(self) -> str:
        """The older name of :attr:`greedy_head`, with "off" for "float32"."""
        return "off" if self.greedy_head == "float32" else self.greedy_head

    @greedy_approx.setter
    def greedy_approx(self, value: str) -> None:
        self.greedy_head = "float32" if value == "off" else value
        self._greedy_source = "greedy_approx"

    def _greedy_applies(self, w: torch.Tensor | None) -> bool:
        return (w is not None and w.device.type == "cpu" and w.dtype == torch.float32
                and getattr(self.lm_head, "bias", None) is None)

    def _greedy_choice(self, rows: int) -> "fast_path_choice.GreedyChoice":
        """The head for ``rows`` greedy rows: cached per setting, row class and thread count (one dict
        lookup a step), chosen on a miss by :func:`fast_path_choice.choose_greedy_head`."""
        key = (self.greedy_head, size_class(rows), torch.get_num_threads())
        cache = self.__dict__.get("_greedy_choices")
        if cache is None:
            cache = self.__dict__["_greedy_choices"] = {}
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = fast_path_choice.choose_greedy_head(self, key[1], self.greedy_head,
                                                                   self._greedy_source)
        return hit

    def greedy_tokens(self, hidden: torch.Tensor, refuse: Any = None) -> torch.Tensor | None:
        """The argmax token of each row of ``compute_logits(hidden)``, through the greedy head chosen
        for this shape class (see :attr:`greedy_head`); None where the float32 logits are the way
        (chosen, or the head is not a float32 CPU head: the caller then computes the logits).

        ``refuse``: None, or a function that adds ``-inf`` in place to the entries of a ``[rows, V]``
        logits tensor (any float dtype) that some rows may not take, ``+0`` elsewhere (structured
        output's token masks, :meth:`zerospeed.inference.constraints.Guides.apply`): applied to the
        approximate logits before the candidates are chosen, so a refused token is never a candidate,
        and to the float32 logits of rows that fall back to them; the token is then the argmax of the
        masked float32 logits, exactly as without the greedy head."""
        w, rows = getattr(self.lm_head, "weight", None), hidden.shape[0]
        if rows < GREEDY_APPROX_MIN_ROWS or hidden.dtype != torch.float32 or not self._greedy_applies(w):
            return None
        choice = self._greedy_choice(rows)
        if choice.head == "int8":
            head = self._derived("_lm_head_int8", w, int8_head.build_int8_head)
            if head is None:
                raise FastPathError(f"{self._greedy_source}: 'int8' cannot run on this head: oneDNN's int8 linear "
                                    "did not give the exact integer products")
            return self._greedy_tokens_int8(hidden, w, head, choice.c_int8_rows, choice.c_refine, refuse)
        if choice.head == "bf16":
            return self._greedy_tokens_bf16(hidden, w, choice.c_refine, refuse)
        return None

    def _greedy_tokens_int8(self, hidden: torch.Tensor, w: torch.Tensor, head: "int8_head.Int8Head",
                            c_rows: bool | None = None, c_refine: bool | None = None, refuse: Any = None
                            ) -> torch.Tensor:
        """``c_rows`` / ``c_refine``: the activation side / the candidates' pass in C (None: wherever
        the kernels are built)."""
        if c_rows is None or c_refine is None:
            c_rows = c_refine = cpu_kernel.available()[0]
        approx, err = int8_head.approx_logits(head, hidden, use_c=c_rows)
        if refuse is not None:
            refuse(approx)
        refine = cpu_kernel.greedy_refine if c_refine else int8_head.refine_torch
        return _full_rows(refine(approx, hidden, w, err, GREEDY_MAX_CANDIDATES), hidden, w, refuse)

    def _greedy_tokens_bf16(self, hidden: torch.Tensor, w: torch.Tensor, c_refine: bool | None = None,
                            refuse: Any = None) -> torch.Tensor:
        mat, packed, wmax = self._lm_head_bf16(w)
        xb = hidden.to(torch.bfloat16)
        approx = torch.ops.mkldnn._linear_pointwise(xb, mat, None, "none", [], "") if packed else torch.mm(xb, mat)
        u = 2.0 ** -8
        # the bound of |approx - exact|, times 2 to spare (the kernel rounds the threshold down)
        err = (2.0 * (3 * u + w.shape[1] * 2.0 ** -24) * (1 + 4 * u) * hidden.norm(dim=1) * wmax).float()
        if c_refine is None:
            c_refine = cpu_kernel.available()[0]
        if refuse is not None:
            refuse(approx)
        refine = cpu_kernel.greedy_refine if c_refine else int8_head.refine_torch
        return _full_rows(refine(approx, hidden, w, err, GREEDY_MAX_CANDIDATES), hidden, w, refuse)

    def _lm_head_bf16(self, w: torch.Tensor) -> tuple[torch.Tensor, bool, torch.Tensor]:
        """The head's weight in bfloat16 for the approximate logits: packed by oneDNN for its matmul
        when torch has that op (True), else transposed and contiguous for ``torch.mm`` (False); and
        ``max_j ||w_j||``. Cached like the transposed copy."""
        def build(wd: torch.Tensor) -> tuple[torch.Tensor, bool, torch.Tensor]:
            wb = wd.to(torch.bfloat16)
            try:
                mat = torch.ops.mkldnn._reorder_linear_weight(wb, 32)  # the batch size is only a hint
                probe = torch.ones(1, wb.shape[1], dtype=torch.bfloat16)
                ok = torch.equal(torch.ops.mkldnn._linear_pointwise(probe, mat, None, "none", [], ""),
                                 torch.mm(probe, wb.t()))
            except (AttributeError, RuntimeError):
                ok = False
            return (mat if ok else wb.t().contiguous()), ok, wd.norm(dim=1).max()

        return self._derived("_lm_head_bf16_t", w, build)

    def _lm_head_transposed(self, w: torch.Tensor) -> torch.Tensor:
        """``w.t().contiguous()``, cached while ``w`` is the same tensor, storage and version."""
        return self._derived("_lm_head_t", w, lambda wd: wd.t().contiguous())

    def _derived(self, name: str, w: torch.Tensor, build: Callable[[torch.Tensor], Any]) -> Any:
        """``build(w.detach())``, cached under ``name`` while ``w`` is the same tensor, storage, version
        and shape (a plain attribute: not a parameter, not in the state dict)."""
        return _derived_on(self, name, w, build)


class RotaryDecoderLM(CausalLM):
    """Embedding, a stack of ``block_cls`` decoder blocks sharing one rotary table, a final norm and
    the LM head: the body of the Llama family, Mixtral and GPT-NeoX, which differ in their blocks
    (``block_cls``) and final norm (:meth:`final_norm`)."""

    block_cls: type[nn.Module]

    def __init__(self, spec: ModelSpec, max_positions: int, tp: TPInfo = TPInfo()) -> None:
        super().__init__()
        self.spec, self.tp = spec, tp
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(self.block_cls(spec, i, tp) for i in range(spec.num_layers))
        self.norm = self.final_norm(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rotary = RotaryTable(spec, max_positions)

    def final_norm(self, spec: ModelSpec) -> nn.Module:  # pragma: no cover
        raise NotImplementedError

    def input_embedding(self) -> nn.Embedding:
        return self.embed

    def forward(self, input_ids: torch.Tensor, meta: Any, kv: Any) -> torch.Tensor:
        h = self.embed(input_ids)
        cos, sin = self.rotary.lookup(meta.positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, meta, cos, sin, kv.k[i], kv.v[i])
        if meta.kernels.rms_norm and type(self.norm) is RMSNorm:
            return cpu_kernel.rms_norm(h, self.norm.weight, self.norm.eps)
        return self.norm(h)


# Linear layers in CPU float32 decode steps (the C kernels built): for few rows, a C GEMM that streams
# a packed copy of the weight once (cpu_kernel.skinny_linear) instead of MKL's sgemm, where the
# forward's KernelPlan says so (cpu_kernels=auto: measured per rows class and weight shape;
# cpu_kernels=on: 2-24 rows with one torch thread, fast_path_choice.ON_SKINNY_ROWS). Measured when it
# was written (Xeon with AMX; bench model's 4 layers of QKV / O / gate-up / down, one thread, after
# streaming 160 MB as a step's K/V reads do; CPU ms, MKL -> C): 1 row 1.10 -> 1.19, 2: 1.41 -> 1.14,
# 4: 1.62 -> 1.25, 8: 1.99 -> 1.38, 12: 2.26 -> 1.67, 16: 2.35 -> 1.82, 24: 2.58 -> 2.24, 32: 2.83 ->
# 2.71. The kernel is single-threaded. The packed copies cost the blocks' weight bytes once more.
SKINNY_ROWS = fast_path_choice.ON_SKINNY_ROWS


def cpu_linear(x: torch.Tensor, layer: nn.Module, residual: torch.Tensor | None = None,
               plan: "fast_path_choice.KernelPlan | None" = None) -> torch.Tensor:
    """``residual + layer(x)`` (or ``layer(x)``) for a float32 CPU ``nn.Linear`` / single-rank
    :class:`RowLinear`, through :func:`cpu_kernel.skinny_linear` where ``plan`` (the forward's
    :class:`~zerospeed.inference.fast_path_choice.KernelPlan`; None: ``cpu_kernels=on``'s rules) puts
    this weight's shape on it, or through oneDNN on a packed copy of the weight
    (:func:`zerospeed.ops.packed_linear.linear`, the residual added in the same pass) where the plan puts
    it there (``packed_linear``), else ``addmm`` (the residual folded in) or the layer itself."""
    if type(layer) not in (nn.Linear, RowLinear):  # e.g. a quantized replacement (compression): its own forward
        y = layer(x)
        return y if residual is None else residual + y
    w, bias = layer.weight, layer.bias
    plain = not isinstance(layer, RowLinear) or layer.tp.size == 1
    if plan is None:
        plan = fast_path_choice.legacy_plan(True)
    if plain and plan.use_packed(w):  # oneDNN on the weight packed once (packed_linear)
        packed = _derived_on(layer, "_onednn_weight", w, packed_linear.pack)
        return packed_linear.linear(x, packed, bias, None if residual is None else residual.contiguous())
    rows = x.shape[0]
    if (plain and w.shape[0] % 16 == 0 and plan.use_skinny(w)
            and (not plan.skinny_all or SKINNY_ROWS[0] <= rows <= SKINNY_ROWS[1])):
        packed = _derived_on(layer, "_packed_weight", w, cpu_kernel.pack_weight)
        return cpu_kernel.skinny_linear(x.contiguous(), packed, bias, residual)
    if residual is None:
        return layer(x)
    if plain and bias is None:
        return torch.addmm(residual, x, w.t())
    return residual + layer(x)


def _derived_on(owner: nn.Module, name: str, w: torch.Tensor, build: Callable[[torch.Tensor], Any]) -> Any:
    """``build(w.detach())`` cached on ``owner`` under ``name`` while ``w`` is the same tensor, storage,
    version and shape (a plain attribute: not a parameter, not in the state dict)."""
    cached = owner.__dict__.get(name)
    if (cached is None or cached[0] is not w or cached[1] != w._version or cached[2] != w.data_ptr()
            or cached[3] != w.shape):
        cached = (w, w._version, w.data_ptr(), w.shape, build(w.detach()))
        owner.__dict__[name] = cached
    return cached[4]


class RowLinear(nn.Module):
    """A row-parallel linear layer (input features split across TP ranks): partial products are
    all-reduced, and the bias is added once afterwards. With one rank it is a plain ``F.linear``
    (bias inside, as HF computes it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPInfo) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        y = all_reduce_tp(F.linear(x, self.weight), self.tp)
        return y if self.bias is None else y + self.bias


def _full_rows(tokens: torch.Tensor, hidden: torch.Tensor, w: torch.Tensor, refuse: Any) -> torch.Tensor:
    """Rows the candidate pass gave up on (-1: too many near-ties) take the argmax of their float32
    logits in full (masked by ``refuse``, which works on whole ``[rows, V]`` tensors)."""
    flat = (tokens < 0).nonzero(as_tuple=True)[0]
    if flat.numel():
        if refuse is None:
            tokens[flat] = F.linear(hidden.index_select(0, flat), w).max(dim=1).indices
        else:
            full = F.linear(hidden, w)
            refuse(full)
            tokens[flat] = full.index_select(0, flat).max(dim=1).indices
    return tokens
