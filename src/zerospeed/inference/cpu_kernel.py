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
keyed by a hash of the source, the flags and the CPU's feature flags, and called through
``ctypes`` with the tensors' data pointers. Compiling takes about a second; a
``torch.utils.cpp_extension`` build of the same kernel took two minutes on this machine because of
the torch headers. ``-march=native`` plus reassociation of sums (``-fassociative-math``, not
``-ffast-math``, which would change the floating-point mode of the whole process) let the compiler
vectorise the dot products. Threads: decode attention splits its sequences over
``torch.get_num_threads()`` POSIX threads; the skinny GEMM and SwiGLU's gate are single-threaded and
used only when torch has one thread (else torch's multi-threaded ops run); the rest are small.

When it is used: :func:`available` says whether it compiled (and why not); the engine uses it for
float32 on CPU unless ``attention_backend="torch"`` (then every forward is plain torch), and
``attention_backend="cpu_kernel"`` makes a failed build an error instead of a logged fallback. The
torch path stays the reference: the tests compare every kernel with its torch twin (fp32, 1e-5) and
both paths' tokens with HF's.

Numerics: per query head, scores ``q . k * scale`` in float32, softmax with the maximum
subtracted (``expf``), then the probability-weighted sum of values, normalised at the end; the
order of additions differs from SDPA's, so results match it to float32 rounding, not bitwise.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading

import torch

from zerospeed.inference.cpu_kernel_source import C_SOURCE

log = logging.getLogger(__name__)


FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-pthread"]

_lock = threading.Lock()
_state: dict = {}


def _cpu_tag() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256((C_SOURCE + " ".join(FLAGS) + cc + _cpu_tag()).encode()).hexdigest()[:16]
    cache = os.environ.get("ZEROSPEED_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "zerospeed",
                                                                       "kernels")
    os.makedirs(cache, exist_ok=True)
    lib = os.path.join(cache, f"paged_attention_{key}.so")
    if not os.path.exists(lib):
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src = os.path.join(tmp, "paged_attention.c")
            with open(src, "w") as f:
                f.write(C_SOURCE)
            out = os.path.join(tmp, "k.so")
            proc = subprocess.run([cc, *FLAGS, src, "-o", out, "-lm"], capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
            os.replace(out, lib)  # atomic: concurrent builders (TP ranks) never see half a file
    dll = ctypes.CDLL(lib)
    fn = dll.zs_paged_decode_attention
    P, I = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [P, P, P, P, P, P, I, I, I, I, I, I, I, I, ctypes.c_float, I]
    fn.restype = ctypes.c_int
    g = dll.zs_greedy_refine
    g.argtypes = [P, P, P, P, I, I, I, I, P]
    g.restype = None
    a = dll.zs_attention_layer
    a.argtypes = [P, I, I, I, I, I, I, I, P, P, P, P, P, P, P, P, P, I, I, I, I, ctypes.c_float, I, P]
    a.restype = ctypes.c_int
    n = dll.zs_rms_norm
    n.argtypes = [P, P, P, I, I, ctypes.c_float]
    n.restype = None
    k = dll.zs_skinny_gemm
    k.argtypes = [P, I, I, P, I, P, P, P]
    k.restype = None
    sm = dll.zs_silu_mul
    sm.argtypes = [P, I, I, P]
    sm.restype = None
    q = dll.zs_int8_rows
    D = ctypes.c_double
    q.argtypes = [P, I, I, D, D, D, D, P, P, P]
    q.restype = None
    g = dll.zs_greedy_refine_f32
    g.argtypes = [P, P, P, P, I, I, I, I, P]
    g.restype = None
    return dll


def available() -> tuple[bool, str]:
    """Whether the kernel is built (compiling it on the first call); the reason when not."""
    with _lock:
        if "ok" not in _state:
            try:
                _state["dll"] = _build()
                _state["ok"], _state["why"] = True, ""
            except Exception as exc:  # no compiler, read-only home, ...
                _state["ok"], _state["why"] = False, f"{type(exc).__name__}: {exc}"
                log.warning("zerospeed: the CPU decode-attention kernel is unavailable (%s); using the torch path",
                            _state["why"])
        return _state["ok"], _state["why"]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, block_size: int, max_ctx: int, scale: float | None,
                     window: int | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q [B, Hq, D]``; caches ``[slots, Hkv, D]``; ``tables [B, max_blocks]`` and ``lens [B]`` int64
    (``max_ctx >= lens.max()``). Returns ``[B, Hq, D]``. All float32 contiguous CPU tensors."""
    ok, why = available()
    if not ok:
        raise RuntimeError(f"CPU decode-attention kernel unavailable: {why}")
    B, hq, d = q.shape
    hkv = k_cache.shape[1]
    if out is None:
        out = torch.empty_like(q)
    q = q.contiguous()
    rc = _state["dll"].zs_paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        B, tables.shape[1], block_size, hq, hkv, d, window or 0, max_ctx,
        d ** -0.5 if scale is None else float(scale), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("CPU decode-attention kernel: out of memory for its score buffer")
    return out


def greedy_refine(approx: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, err: torch.Tensor,
                  max_candidates: int) -> torch.Tensor:
    """``approx [R, V]`` bfloat16 or float32 approximate logits, ``hidden [R, H]`` and ``weight [V, H]`` float32,
    ``err [R]`` float32 bounds on ``|approx - exact|``: the exact argmax token of each row among the
    candidates within ``2 * err`` of its best approximate logit, or -1 where a row has more than
    ``max_candidates`` of them. All contiguous CPU tensors."""
    ok, why = available()
    if not ok:
        raise RuntimeError(f"CPU kernels unavailable: {why}")
    rows, vocab = approx.shape
    out = torch.empty(rows, dtype=torch.int64)
    approx, hidden, weight, err = approx.contiguous(), hidden.contiguous(), weight.contiguous(), err.contiguous()
    if approx.dtype == torch.float32:
        fn = _state["dll"].zs_greedy_refine_f32
    elif approx.dtype == torch.bfloat16:
        fn = _state["dll"].zs_greedy_refine
    else:
        raise TypeError(f"greedy_refine: approximate logits must be bfloat16 or float32, not {approx.dtype}")
    fn(approx.data_ptr(), hidden.data_ptr(), weight.data_ptr(), err.data_ptr(), rows, vocab, hidden.shape[1],
       max_candidates, out.data_ptr())
    return out



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
    T = qkv.shape[0]
    rot = cos_rows.shape[-1]
    q_out = torch.empty(T, hq, d)
    k_out = torch.empty(T, hkv, d) if want_k else None
    out = torch.empty(T, hq, d)
    rc = _state["dll"].zs_attention_layer(
        qkv.data_ptr(), qkv.stride(0), T, num_decodes, hq, hkv, d, rot, cos_rows.data_ptr(), sin_rows.data_ptr(),
        slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), q_out.data_ptr(),
        None if k_out is None else k_out.data_ptr(), None if tables is None else tables.data_ptr(),
        None if lens is None else lens.data_ptr(), 0 if tables is None else tables.shape[1], block_size,
        window or 0, max_ctx, d ** -0.5 if scale is None else float(scale), torch.get_num_threads(),
        out.data_ptr())
    if rc != 0:
        raise MemoryError("CPU decode-attention kernel: out of memory for its score buffer")
    return out, q_out, k_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim of a contiguous float32 CPU ``x``."""
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.shape[-1]
    _state["dll"].zs_rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // n, n, eps)
    return y


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (an ``nn.Linear`` weight) -> ``[N / 16, K, 16]`` contiguous for
    :func:`skinny_linear`; ``N`` must be a multiple of 16."""
    n, k = weight.shape
    return weight.detach().reshape(n // 16, 16, k).transpose(1, 2).contiguous()


def skinny_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias) (+ residual)`` with ``W`` given by :func:`pack_weight`; contiguous float32
    CPU tensors, :func:`available` true."""
    m, k = x.shape
    n = packed.shape[0] * 16
    y = torch.empty(m, n)
    _state["dll"].zs_skinny_gemm(x.data_ptr(), m, k, packed.data_ptr(), n,
                                 None if bias is None else bias.data_ptr(),
                                 None if residual is None else residual.data_ptr(), y.data_ptr())
    return y


def int8_rows(hidden: torch.Tensor, consts: tuple[float, float, float, float]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hidden [R, H]`` contiguous float32 -> int8 rows ``p [max(R, 2), H]`` (a single row written
    twice), scales ``a [R]`` and bounds ``err [R]`` (see ``zs_int8_rows`` and models/greedy_head.py);
    ``consts`` are the head's ``(E, E2, G, G2)``."""
    rows, h = hidden.shape
    p = torch.empty(max(rows, 2), h, dtype=torch.int8)
    a = torch.empty(rows)
    err = torch.empty(rows)
    _state["dll"].zs_int8_rows(hidden.data_ptr(), rows, h, *consts, p.data_ptr(), a.data_ptr(), err.data_ptr())
    if rows == 1:
        p[1] = p[0]
    return p, a, err


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate_up[:, :inter]) * gate_up[:, inter:]`` for a contiguous float32 CPU ``[T, 2 * inter]``."""
    out = torch.empty(gate_up.shape[0], inter)
    _state["dll"].zs_silu_mul(gate_up.data_ptr(), gate_up.shape[0], inter, out.data_ptr())
    return out
