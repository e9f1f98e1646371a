"""C kernels for a CPU float32 decode step: decode attention straight from the paged KV cache, each
attention layer's glue in one call (rotary, cache writes, decodes: :func:`attention_layer`), RMSNorm,
SwiGLU's gate, a skinny GEMM over packed weights (:func:`skinny_linear`), and the int8 greedy LM
head's activation side and candidate selection (:func:`int8_rows`, :func:`greedy_refine`).

Why so many small kernels: a decode step of a small model on one CPU core reads its weights and
K/V from memory once and does little arithmetic; each torch op costs ~2-5 us of dispatch, and a
step made of ~200 of them spent about a third of its time there. The same step with these kernels
(bench model, 8-12 sequences, one thread) went from ~7.5 to ~4.5 CPU ms (see bench/results).

Why: on CPU, decode attention through torch (gather each sequence's blocks into a padded buffer,
then SDPA with a key-padding mask; see :mod:`zerospeed.inference.attention`) moves every cached
key and value three times (read and written by the gather, read again by SDPA) plus the padding.
This kernel reads each key and value row once, through the block table, for all decoding
sequences of a layer in one call. On the bench model (2-core CPU, one thread) it made the whole
engine's decode steps about twice as fast (see bench/results).

How it is built: plain C (no torch headers), compiled on first use with the system C compiler
(``$CC`` or ``cc``) into ``$ZEROSPEED_KERNEL_CACHE`` (default ``~/.cache/zerospeed/kernels``),
keyed by a hash of the source, the flags, the compiler and the CPU's feature flags, and called through
``ctypes`` with the tensors' data pointers. Compiling takes about a second; a
``torch.utils.cpp_extension`` build of the same kernel took two minutes on this machine because of
the torch headers. The instruction set comes from ``ZEROSPEED_KERNEL_ISA`` (:data:`ISA_FLAGS`):
``native`` (default, ``-march=native``: whatever the building CPU has), ``avx2`` (x86-64-v3, as a CPU
without AVX-512) or ``scalar`` (the architecture's baseline, the auto-vectoriser off: runs anywhere);
each level is its own cached library and :func:`load` gives any of them (the tests compare all with
their torch twins). Reassociation of sums (``-fassociative-math``, not ``-ffast-math``, which would
change the floating-point mode of the whole process) lets the compiler vectorise the dot products.
Threads: decode attention splits its sequences over ``torch.get_num_threads()`` POSIX threads; the
skinny GEMM and SwiGLU's gate are single-threaded; the rest are small.

When it is used: :func:`available` says whether the process's build compiled (and why not). Whether a
kernel runs is the engine's ``cpu_kernels`` switch (:mod:`zerospeed.inference.fast_path_choice`):
``off`` never; ``on`` wherever it applies (a failed build is then an error); ``auto`` (default) per
kernel family and shape class, where it builds and was timed faster than its torch twin on this
machine (a CPU flag says nothing about which is faster). ``attention_backend`` sets the attention
kernels alone (``torch``: never, ``cpu_kernel``: always). The torch path stays the reference: the
tests compare every kernel with its torch twin within float32 rounding bounds and both paths' tokens
with HF's.

Numerics: per query head, scores ``q . k * scale`` in float32, softmax with the maximum
subtracted (``expf``), then the probability-weighted sum of values, normalised at the end; the
order of additions differs from SDPA's, so results match it to float32 rounding, not bitwise.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from zerospeed.inference.cpu_kernel_source import C_SOURCE
from zerospeed.ops import c_build

log = logging.getLogger(__name__)


#: Flags of every build; the instruction set comes from :data:`ISA_FLAGS`.
BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
              "-fno-trapping-math", "-pthread"]

#: ``ZEROSPEED_KERNEL_ISA`` -> the compiler's instruction-set flags (:mod:`zerospeed.ops.c_build`, shared with
#: ZeRO++'s quantizer). ``native``: whatever the CPU that builds has (the default). ``avx2``: x86-64-v3 (AVX2,
#: FMA, no AVX-512), as on a CPU without AVX-512. ``scalar``: the architecture's baseline (x86-64: SSE2) with the
#: auto-vectoriser off, a build that runs on any CPU of the architecture (the kernels' vector-extension loops are
#: then lowered to SSE2 on x86, to scalar code or the baseline's SIMD elsewhere).
ISA_FLAGS = c_build.ISA_FLAGS
ISA_ENV = c_build.ISA_ENV
kernel_isa = c_build.kernel_isa

# kept for readers of the old name: the flags of the default (native) build
FLAGS = c_build.isa_flags("native", BASE_FLAGS)


def isa_flags(isa: str) -> list[str]:
    """The compiler flags of the ``isa`` build (see :data:`ISA_FLAGS`)."""
    return c_build.isa_flags(isa, BASE_FLAGS)


_lock = threading.Lock()
_state: dict = {}
_loaded: dict[str, "Kernels"] = {}


_P, _I, _D, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_float
_SIGNATURES = {
    "zs_paged_decode_attention": ([_P] * 6 + [_I] * 8 + [_F, _I], ctypes.c_int),
    "zs_attention_layer": ([_P] + [_I] * 7 + [_P] * 9 + [_I] * 4 + [_F, _I, _P], ctypes.c_int),
    "zs_rms_norm": ([_P, _P, _P, _I, _I, _F], None),
    "zs_skinny_gemm": ([_P, _I, _I, _P, _I, _P, _P, _P], None),
    "zs_silu_mul": ([_P, _I, _I, _P], None),
    "zs_int8_rows": ([_P, _I, _I, _D, _D, _D, _D, _P, _P, _P], None),
    "zs_greedy_refine": ([_P, _P, _P, _P, _I, _I, _I, _I, _P], None),
    "zs_greedy_refine_f32": ([_P, _P, _P, _P, _I, _I, _I, _I, _P], None),
}


def _build(flags: list[str]) -> ctypes.CDLL:
    return c_build.build("paged_attention", C_SOURCE, flags, _SIGNATURES)


class Kernels:
    """One build of the kernels (one instruction-set level, :func:`load`), with a torch-tensor wrapper
    per entry point. The module-level functions of the same names call the process's build."""

    def __init__(self, isa: str, flags: list[str], dll: ctypes.CDLL) -> None:
        self.isa, self.flags, self.dll = isa, flags, dll

    def describe(self) -> str:
        return f"C kernels built, {' '.join(f for f in self.flags if f.startswith(('-march', '-mcpu')) or 'vectorize' in f)}"

    def decode_attention(self, q, k_cache, v_cache, tables, lens, block_size, max_ctx, scale, window, out=None):
        B, hq, d = q.shape
        hkv = k_cache.shape[1]
        if out is None:
            out = torch.empty_like(q)
        q = q.contiguous()
        rc = self.dll.zs_paged_decode_attention(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            B, tables.shape[1], block_size, hq, hkv, d, window or 0, max_ctx,
            d ** -0.5 if scale is None else float(scale), torch.get_num_threads())
        if rc != 0:
            raise MemoryError("CPU decode-attention kernel: out of memory for its score buffer")
        return out

    def greedy_refine(self, approx, hidden, weight, err, max_candidates):
        rows, vocab = approx.shape
        out = torch.empty(rows, dtype=torch.int64)
        approx, hidden, weight, err = approx.contiguous(), hidden.contiguous(), weight.contiguous(), err.contiguous()
        if approx.dtype == torch.float32:
            fn = self.dll.zs_greedy_refine_f32
        elif approx.dtype == torch.bfloat16:
            fn = self.dll.zs_greedy_refine
        else:
            raise TypeError(f"greedy_refine: approximate logits must be bfloat16 or float32, not {approx.dtype}")
        fn(approx.data_ptr(), hidden.data_ptr(), weight.data_ptr(), err.data_ptr(), rows, vocab, hidden.shape[1],
           max_candidates, out.data_ptr())
        return out

    def attention_layer(self, qkv, num_decodes, hq, hkv, d, cos_rows, sin_rows, slots, k_cache, v_cache, tables,
                        lens, block_size, max_ctx, scale, window, want_k):
        T = qkv.shape[0]
        rot = cos_rows.shape[-1]
        q_out = torch.empty(T, hq, d)
        k_out = torch.empty(T, hkv, d) if want_k else None
        out = torch.empty(T, hq, d)
        rc = self.dll.zs_attention_layer(
            qkv.data_ptr(), qkv.stride(0), T, num_decodes, hq, hkv, d, rot, cos_rows.data_ptr(), sin_rows.data_ptr(),
            slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), q_out.data_ptr(),
            None if k_out is None else k_out.data_ptr(), None if tables is None else tables.data_ptr(),
            None if lens is None else lens.data_ptr(), 0 if tables is None else tables.shape[1], block_size,
            window or 0, max_ctx, d ** -0.5 if scale is None else float(scale), torch.get_num_threads(),
            out.data_ptr())
        if rc != 0:
            raise MemoryError("CPU decode-attention kernel: out of memory for its score buffer")
        return out, q_out, k_out

    def rms_norm(self, x, weight, eps):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.shape[-1]
        self.dll.zs_rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // n, n, eps)
        return y

    def skinny_linear(self, x, packed, bias=None, residual=None):
        m, k = x.shape
        n = packed.shape[0] * 16
        y = torch.empty(m, n)
        self.dll.zs_skinny_gemm(x.data_ptr(), m, k, packed.data_ptr(), n, None if bias is None else bias.data_ptr(),
                                None if residual is None else residual.data_ptr(), y.data_ptr())
        return y

    def int8_rows(self, hidden, consts):
        rows, h = hidden.shape
        p = torch.empty(max(rows, 2), h, dtype=torch.int8)
        a = torch.empty(rows)
        err = torch.empty(rows)
        self.dll.zs_int8_rows(hidden.data_ptr(), rows, h, *consts, p.data_ptr(), a.data_ptr(), err.data_ptr())
        if rows == 1:
            p[1] = p[0]
        return p, a, err

    def silu_mul(self, gate_up, inter):
        out = torch.empty(gate_up.shape[0], inter)
        self.dll.zs_silu_mul(gate_up.data_ptr(), gate_up.shape[0], inter, out.data_ptr())
        return out


def load(isa: str | None = None) -> Kernels:
    """The kernels built for ``isa`` (``native``, ``avx2`` or ``scalar``; default: ``$ZEROSPEED_KERNEL_ISA``),
    compiled on first use and cached on disk per source, flags and compiler; raises when the build fails.
    Each level is its own library, so tests can compare several in one process."""
    isa = kernel_isa() if isa is None else isa
    flags = isa_flags(isa)
    with _lock:
        if isa not in _loaded:
            _loaded[isa] = Kernels(isa, flags, _build(flags))
        return _loaded[isa]


def available() -> tuple[bool, str]:
    """Whether the process's kernels (:func:`load` at ``$ZEROSPEED_KERNEL_ISA``) are built, compiling
    them on the first call; the reason when not (no compiler, read-only cache, a bad
    ``ZEROSPEED_KERNEL_ISA``...)."""
    if "ok" not in _state:
        try:
            kernels = load()
            with _lock:
                _state["kernels"], _state["dll"] = kernels, kernels.dll
                _state["ok"], _state["why"] = True, ""
        except Exception as exc:  # no compiler, read-only home, ...
            with _lock:
                _state["ok"], _state["why"] = False, f"{type(exc).__name__}: {exc}"
            log.warning("zerospeed: the CPU kernels are unavailable (%s); using the torch path", _state["why"])
    return _state["ok"], _state["why"]


def describe() -> str:
    """One phrase for start-up reports: which build runs (``C kernels built, -march=native``) or why none."""
    ok, why = available()
    return _state["kernels"].describe() if ok else f"C kernels unavailable: {why}"


def _kernels() -> Kernels:
    ok, why = available()
    if not ok:
        raise RuntimeError(f"CPU kernels unavailable: {why}")
    return _state["kernels"]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, block_size: int, max_ctx: int, scale: float | None,
                     window: int | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q [B, Hq, D]``; caches ``[slots, Hkv, D]``; ``tables [B, max_blocks]`` and ``lens [B]`` int64
    (``max_ctx >= lens.max()``). Returns ``[B, Hq, D]``. All float32 contiguous CPU tensors."""
    return _kernels().decode_attention(q, k_cache, v_cache, tables, lens, block_size, max_ctx, scale, window, out)


def greedy_refine(approx: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, err: torch.Tensor,
                  max_candidates: int) -> torch.Tensor:
    """``approx [R, V]`` bfloat16 or float32 approximate logits, ``hidden [R, H]`` and ``weight [V, H]`` float32,
    ``err [R]`` float32 bounds on ``|approx - exact|``: the exact argmax token of each row among the
    candidates within ``2 * err`` of its best approximate logit, or -1 where a row has more than
    ``max_candidates`` of them. All contiguous CPU tensors."""
    return _kernels().greedy_refine(approx, hidden, weight, err, max_candidates)


def attention_layer(qkv: torch.Tensor, num_decodes: int, hq: int, hkv: int, d: int, cos_rows: torch.Tensor,
                    sin_rows: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    tables: torch.Tensor | None, lens: torch.Tensor | None, block_size: int, max_ctx: int,
                    scale: float | None, window: int | None, want_k: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                                     torch.Tensor | None]:
    """One attention layer's glue in one call (see ``zs_attention_layer``): ``qkv [T, (hq + 2 hkv) d]``
    (rows contiguous), ``cos_rows`` / ``sin_rows [T, rot]``, ``slots [T]``; returns the decode rows'
    attention ``[T, hq, d]`` (rows ``num_decodes:`` left for the caller), the rotated q ``[T, hq, d]``
    and, with ``want_k``, the rotated k ``[T, hkv, d]``. Caller guarantees float32 CPU tensors with
    contiguous rows, and that :func:`available` is true."""
    return _state["kernels"].attention_layer(qkv, num_decodes, hq, hkv, d, cos_rows, sin_rows, slots, k_cache,
                                             v_cache, tables, lens, block_size, max_ctx, scale, window, want_k)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim of a contiguous float32 CPU ``x``."""
    return _state["kernels"].rms_norm(x, weight, eps)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (an ``nn.Linear`` weight) -> ``[N / 16, K, 16]`` contiguous for
    :func:`skinny_linear`; ``N`` must be a multiple of 16."""
    n, k = weight.shape
    return weight.detach().reshape(n // 16, 16, k).transpose(1, 2).contiguous()


def skinny_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias) (+ residual)`` with ``W`` given by :func:`pack_weight`; contiguous float32
    CPU tensors, :func:`available` true."""
    return _state["kernels"].skinny_linear(x, packed, bias, residual)


def int8_rows(hidden: torch.Tensor, consts: tuple[float, float, float, float]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hidden [R, H]`` contiguous float32 -> int8 rows ``p [max(R, 2), H]`` (a single row written
    twice), scales ``a [R]`` and bounds ``err [R]`` (see ``zs_int8_rows`` and models/greedy_head.py);
    ``consts`` are the head's ``(E, E2, G, G2)``."""
    return _state["kernels"].int8_rows(hidden, consts)


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate_up[:, :inter]) * gate_up[:, inter:]`` for a contiguous float32 CPU ``[T, 2 * inter]``."""
    return _state["kernels"].silu_mul(gate_up, inter)
