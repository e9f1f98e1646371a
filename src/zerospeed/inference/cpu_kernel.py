"""A C kernel for decode attention straight from the paged KV cache, on CPU in float32.

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
vectorise the dot products. Threads: the (sequence, KV head) pairs are split over
``torch.get_num_threads()`` POSIX threads.

When it is used: :func:`available` says whether it compiled (and why not); the engine uses it for
float32 on CPU unless ``attention_backend="torch"``, and ``attention_backend="cpu_kernel"`` makes a
failed build an error instead of a logged fallback. The torch path stays the reference: the tests
compare both on the same cache (fp32, 1e-5).

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

log = logging.getLogger(__name__)

C_SOURCE = r"""
#include <math.h>
#include <string.h>
#include <stdint.h>
#include <stdlib.h>
#include <pthread.h>

typedef struct {
    const float *q, *k, *v; float *out;
    const int64_t *tables, *lens;
    int64_t max_blocks, block_size, hq, hkv, d, window, lo, hi, max_ctx;
    float scale;
    int err;
} job_t;

/* exp(x) for x <= 0 (scores minus their maximum), branch-free so that the compiler vectorises the
   loop that calls it: Cody-Waite reduction by ln 2 and Cephes' degree-6 polynomial for expf
   (relative error about 1e-7, as libm's expf, whose calls kept the loop scalar). With the token
   loops free of integer divisions (below), 135 -> 109 ns per context token on the bench's shapes
   (32 sequences, 4 heads of 64; 10 MB of K/V per layer): the rest is memory traffic, since every
   K/V row is read once. Below -87 it returns about 1.6e-38 instead of a denormal or 0, which is
   nothing beside the maximum's 1. */
static inline float exp_nonpos(float x) {
    x = x < -87.f ? -87.f : x;
    const float fx = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - fx * 0.693359375f;
    r = r - fx * -2.12194440e-4f;
    const float z = r * r;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.f;
    const int32_t bits = ((int32_t)fx + 127) << 23;
    float p; memcpy(&p, &bits, sizeof p);
    return y * p;
}

static void run(job_t *a) {
    /* one work item per sequence: its keys are read block by block, all heads of a token at once
       (one contiguous row of hkv * d floats), so the cache is streamed once in address order */
    const int64_t hq = a->hq, hkv = a->hkv, g_per = hq / hkv, d = a->d, bs = a->block_size;
    float *sc = (float *)malloc(sizeof(float) * (size_t)(hq * a->max_ctx + hq * d + 2 * hq));
    if (!sc) { a->err = 1; return; }
    float *acc = sc + hq * a->max_ctx, *mx = acc + hq * d, *sum = mx + hq;
    for (int64_t b = a->lo; b < a->hi; ++b) {
        const int64_t L = a->lens[b];
        const int64_t start = (a->window > 0 && L > a->window) ? L - a->window : 0;
        const int64_t n = L - start;
        const int64_t *table = a->tables + b * a->max_blocks;
        const float *qb = a->q + b * hq * d;
        for (int64_t h = 0; h < hq; ++h) mx[h] = -INFINITY;
        /* no division in the token loops: (block, offset) advance by one, heads go by KV group */
        int64_t blk = start / bs, off = start % bs;
        for (int64_t t = 0; t < n; ++t) {
            const float *kr = a->k + (table[blk] * bs + off) * hkv * d;
            if (++off == bs) { off = 0; ++blk; }
            for (int64_t g = 0, h = 0; g < hkv; ++g) {
                const float *kv = kr + g * d;
                for (int64_t j = 0; j < g_per; ++j, ++h) {
                    const float *qv = qb + h * d;
                    float s = 0.f;
                    for (int64_t i = 0; i < d; ++i) s += qv[i] * kv[i];
                    s *= a->scale;
                    sc[h * n + t] = s;
                    if (s > mx[h]) mx[h] = s;
                }
            }
        }
        for (int64_t h = 0; h < hq; ++h) {
            float tot = 0.f, m = mx[h];
            float *row = sc + h * n;
            for (int64_t t = 0; t < n; ++t) { float e = exp_nonpos(row[t] - m); row[t] = e; tot += e; }
            sum[h] = tot;
        }
        for (int64_t i = 0; i < hq * d; ++i) acc[i] = 0.f;
        blk = start / bs, off = start % bs;
        for (int64_t t = 0; t < n; ++t) {
            const float *vr = a->v + (table[blk] * bs + off) * hkv * d;
            if (++off == bs) { off = 0; ++blk; }
            for (int64_t g = 0, h = 0; g < hkv; ++g) {
                const float *vv = vr + g * d;
                for (int64_t j = 0; j < g_per; ++j, ++h) {
                    const float w = sc[h * n + t];
                    float *ac = acc + h * d;
                    for (int64_t i = 0; i < d; ++i) ac[i] += w * vv[i];
                }
            }
        }
        float *o = a->out + b * hq * d;
        for (int64_t h = 0; h < hq; ++h) {
            const float inv = 1.f / sum[h];
            for (int64_t i = 0; i < d; ++i) o[h * d + i] = acc[h * d + i] * inv;
        }
    }
    free(sc);
}

static void *run_thread(void *p) { run((job_t *)p); return NULL; }

/* q [B, hq, d], k/v caches [slots, hkv, d], tables [B, max_blocks], lens [B], out [B, hq, d];
   all contiguous float32 / int64. Returns 0 on success. */
int zs_paged_decode_attention(const float *q, const float *k, const float *v, float *out,
                              const int64_t *tables, const int64_t *lens, int64_t batch, int64_t max_blocks,
                              int64_t block_size, int64_t hq, int64_t hkv, int64_t d, int64_t window,
                              int64_t max_ctx, float scale, int64_t nthreads) {
    int64_t items = batch;
    if (nthreads > items) nthreads = items;
    if (nthreads < 1) nthreads = 1;
    job_t jobs[64];
    if (nthreads > 32) nthreads = 32;
    for (int64_t i = 0; i < nthreads; ++i) {
        job_t j = {q, k, v, out, tables, lens, max_blocks, block_size, hq, hkv, d, window,
                   items * i / nthreads, items * (i + 1) / nthreads, max_ctx, scale, 0};
        jobs[i] = j;
    }
    pthread_t th[64];
    int64_t started = 0;
    for (int64_t i = 1; i < nthreads; ++i) {
        if (pthread_create(&th[i], NULL, run_thread, &jobs[i]) != 0) { run(&jobs[i]); continue; }
        started |= (int64_t)1 << i;
    }
    run(&jobs[0]);
    int err = jobs[0].err;
    for (int64_t i = 1; i < nthreads; ++i) {
        if (started & ((int64_t)1 << i)) pthread_join(th[i], NULL);
        err |= jobs[i].err;
    }
    return err;
}

/* Greedy selection after an approximate (bfloat16) LM head, one row at a time: the row's largest
   approximate logit m; every token j with approx[j] >= m - 2 * err[r] is a candidate; its exact
   float32 logit h . w_j picks the token (largest, lowest id on ties). A row with more than
   max_cand candidates gets tokens[r] = -1 (the caller computes it in full). */
static inline float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, sizeof f); return f;
}

/* bfloat16 bits -> an unsigned key with the same order as the values (NaN aside) */
static inline uint16_t bf16_key(uint16_t b) { return (b & 0x8000) ? (uint16_t)~b : (uint16_t)(b | 0x8000); }

/* the largest bfloat16 not above f, as bits (rounds toward -inf) */
static inline uint16_t bf16_floor_bits(float f) {
    uint32_t u; memcpy(&u, &f, sizeof u);
    uint16_t hi = (uint16_t)(u >> 16);
    if ((u & 0xFFFF) && (u & 0x80000000u)) hi += 1; /* negative: truncation went up, step away from 0 */
    return hi;
}

void zs_greedy_refine(const uint16_t *approx, const float *hidden, const float *w, const float *err,
                      int64_t rows, int64_t vocab, int64_t h, int64_t max_cand, int64_t *tokens) {
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *a = approx + r * vocab;
        const float *x = hidden + r * h;
        uint16_t km = 0;
        for (int64_t j = 0; j < vocab; ++j) { uint16_t k = bf16_key(a[j]); km = k > km ? k : km; }
        const uint16_t mb = (km & 0x8000) ? (uint16_t)(km & 0x7FFF) : (uint16_t)~km;
        const uint16_t kt = bf16_key(bf16_floor_bits(bf16_to_float(mb) - 2.f * err[r]));
        int64_t count = 0, best_j = -1;
        float best = -INFINITY;
        for (int64_t j = 0; j < vocab; ++j) {
            if (bf16_key(a[j]) < kt) continue;
            if (++count > max_cand) { best_j = -1; break; }
            const float *wj = w + j * h;
            float s = 0.f;
            for (int64_t i = 0; i < h; ++i) s += x[i] * wj[i];
            if (s > best || best_j < 0) { best = s; best_j = j; }
        }
        tokens[r] = best_j;
    }
}

/* The same selection after an approximate float32 matmul (the int8 LM head, whose logits are in
   units of each row's activation scale, see models/layers.py): candidates are the tokens with
   approx[j] >= max_j approx - 2 * err[r], the threshold taken in double and rounded down to a float
   (a superset of the candidates, never fewer); exact float32 logits h . w_j of the candidates pick
   the token (largest, lowest id on ties). tokens[r] = -1 with more than max_cand candidates or none
   (NaN). The maximum is taken over 16 lanes so that the compiler vectorises the pass. */
void zs_greedy_refine_f32(const float *approx, const float *hidden, const float *w, const float *err,
                          int64_t rows, int64_t vocab, int64_t h, int64_t max_cand, int64_t *tokens) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *a = approx + r * vocab;
        const float *x = hidden + r * h;
        float lane[16];
        for (int k = 0; k < 16; ++k) lane[k] = -INFINITY;
        int64_t j = 0;
        for (; j + 16 <= vocab; j += 16)
            for (int k = 0; k < 16; ++k) lane[k] = a[j + k] > lane[k] ? a[j + k] : lane[k];
        float m = -INFINITY;
        for (int k = 0; k < 16; ++k) m = lane[k] > m ? lane[k] : m;
        for (; j < vocab; ++j) m = a[j] > m ? a[j] : m;
        const double thr = (double)m - 2.0 * (double)err[r];
        float tf = (float)thr;
        if ((double)tf > thr) tf = nextafterf(tf, -INFINITY);
        int64_t count = 0, best_j = -1;
        float best = -INFINITY;
        for (j = 0; j < vocab; ++j) {
            if (!(a[j] >= tf)) continue;
            if (++count > max_cand) { best_j = -1; break; }
            const float *wj = w + j * h;
            float s = 0.f;
            for (int64_t i = 0; i < h; ++i) s += x[i] * wj[i];
            if (s > best || best_j < 0) { best = s; best_j = j; }
        }
        tokens[r] = best_j;
    }
}

"""

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

