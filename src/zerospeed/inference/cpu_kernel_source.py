"""The C source of the CPU decode-step kernels (:mod:`zerospeed.inference.cpu_kernel` compiles it,
loads it and wraps each entry point for torch tensors).

Plain C99 with GCC/Clang vector extensions, no torch headers; every function takes raw pointers and
sizes. The comment above each function states its layout and numerics; each is compared with a
torch twin in tests/test_inference_cpu_kernels.py and tests/test_inference_greedy_head.py.
"""

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

/* Software prefetch of the K or V row ZS_AHEAD tokens ahead (through the block table): the rows of a
   sequence are contiguous only within a block, and the hardware prefetcher restarts at every block,
   so a decode step stalled on each block's first loads. Measured (8 sequences of 170 tokens, 4 heads
   of 64, 4 layers, one thread, after streaming 160 MB): 0.81-0.93 -> 0.69 ms; 3 to 16 rows ahead
   all gave 0.69-0.80 (noise of the shared machine). */
#define ZS_AHEAD 6
static inline void zs_prefetch_row(const float *row, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(row + i);
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
        int64_t pblk = (start + ZS_AHEAD) / bs, poff = (start + ZS_AHEAD) % bs; /* ZS_AHEAD tokens ahead */
        for (int64_t t = 0; t < n; ++t) {
            const float *kr = a->k + (table[blk] * bs + off) * hkv * d;
            if (++off == bs) { off = 0; ++blk; }
            if (t + ZS_AHEAD < n) {
                zs_prefetch_row(a->k + (table[pblk] * bs + poff) * hkv * d, hkv * d);
                if (++poff == bs) { poff = 0; ++pblk; }
            }
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
        pblk = (start + ZS_AHEAD) / bs, poff = (start + ZS_AHEAD) % bs;
        for (int64_t t = 0; t < n; ++t) {
            const float *vr = a->v + (table[blk] * bs + off) * hkv * d;
            if (++off == bs) { off = 0; ++blk; }
            if (t + ZS_AHEAD < n) {
                zs_prefetch_row(a->v + (table[pblk] * bs + poff) * hkv * d, hkv * d);
                if (++poff == bs) { poff = 0; ++pblk; }
            }
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

/* The glue of one attention layer in a forward, fused so that it costs one call instead of a dozen
   torch ops (each ~2-5 us of dispatch on this CPU, most of a small decode step's fixed cost):
   qkv [T, (hq + 2 hkv) d] (row stride ld) -> q rotated into q_out [T, hq, d]; k rotated into the cache
   at slots[t] (and into k_out [T, hkv, d] when given); v copied into the cache; then decode
   attention for the first nd rows (their contexts through tables / lens) into attn_out [nd, hq, d].
   Rotary: rotate-half on the first rot features with the rows cos / sin [T, rot] (already looked up
   by position), the rest passed through: y_i = x_i c_i - x_{i+rot/2} s_i (i < rot/2), y_i = x_i c_i +
   x_{i-rot/2} s_i (rot/2 <= i < rot), HF's q * cos + rotate_half(q) * sin. */
static inline void rope_row(const float *x, float *y, int64_t heads, int64_t d, int64_t rot, const float *c,
                            const float *s) {
    const int64_t half = rot / 2;
    for (int64_t hh = 0; hh < heads; ++hh) {
        const float *xr = x + hh * d;
        float *yr = y + hh * d;
        for (int64_t i = 0; i < half; ++i) yr[i] = xr[i] * c[i] - xr[i + half] * s[i];
        for (int64_t i = half; i < rot; ++i) yr[i] = xr[i] * c[i] + xr[i - half] * s[i];
        for (int64_t i = rot; i < d; ++i) yr[i] = xr[i];
    }
}

int zs_attention_layer(const float *qkv, int64_t ld, int64_t T, int64_t nd, int64_t hq, int64_t hkv, int64_t d,
                       int64_t rot, const float *cos_rows, const float *sin_rows, const int64_t *slots,
                       float *k_cache, float *v_cache, float *q_out, float *k_out, const int64_t *tables,
                       const int64_t *lens, int64_t max_blocks, int64_t block_size, int64_t window, int64_t max_ctx,
                       float scale, int64_t nthreads, float *attn_out) {
    for (int64_t t = 0; t < T; ++t) {
        const float *row = qkv + t * ld;
        const float *c = cos_rows + t * rot, *s = sin_rows + t * rot;
        rope_row(row, q_out + t * hq * d, hq, d, rot, c, s);
        float *kc = k_cache + slots[t] * hkv * d;
        rope_row(row + hq * d, kc, hkv, d, rot, c, s);
        if (k_out) memcpy(k_out + t * hkv * d, kc, sizeof(float) * (size_t)(hkv * d));
        memcpy(v_cache + slots[t] * hkv * d, row + (hq + hkv) * d, sizeof(float) * (size_t)(hkv * d));
    }
    if (nd == 0) return 0;
    return zs_paged_decode_attention(q_out, k_cache, v_cache, attn_out, tables, lens, nd, max_blocks, block_size,
                                     hq, hkv, d, window, max_ctx, scale, nthreads);
}

/* RMSNorm over rows of x [T, n]: y = w * (x * 1 / sqrt(mean(x^2) + eps)), HF's LlamaRMSNorm in float32
   (the sum of squares in another order: float32 rounding apart). */
void zs_rms_norm(const float *x, const float *w, float *y, int64_t T, int64_t n, float eps) {
    for (int64_t t = 0; t < T; ++t) {
        const float *xr = x + t * n;
        float *yr = y + t * n;
        float ss = 0.f;
        for (int64_t i = 0; i < n; ++i) ss += xr[i] * xr[i];
        const float r = 1.f / sqrtf(ss / (float)n + eps);
        for (int64_t i = 0; i < n; ++i) yr[i] = w[i] * (xr[i] * r);
    }
}

/* y [M, N] = x [M, K] @ W + (bias [N] or 0) + (res [M, N] or 0), for a few rows M (decode steps): the
   weight packed as [N/16][K][16] (16 output columns, all K, contiguous) is streamed from memory once,
   each 16-column panel reused from L1 by every group of up to 8 rows, whose 16-wide accumulators stay
   in registers. A decode step of a small model reads each weight once from DRAM: there MKL's sgemm for
   4-16 rows ran at about half the memory speed (its packing and blocking are made for large M). */
typedef float zs_v16w __attribute__((vector_size(64)));
#define ZS_PANEL(R)                                                                                          \
    static void zs_panel##R(const float *x, int64_t K, const float *w, const float *bias, const float *res,   \
                            float *y, int64_t N, int pf) {                                                  \
        zs_v16w acc[R];                                                                                      \
        zs_v16w b0 = {0};                                                                                    \
        if (bias) memcpy(&b0, bias, sizeof b0);                                                              \
        for (int r = 0; r < R; ++r) acc[r] = b0;                                                             \
        for (int64_t k = 0; k < K; ++k) {                                                                    \
            zs_v16w b;                                                                                       \
            memcpy(&b, w + k * 16, sizeof b);                                                                \
            if (pf) __builtin_prefetch(w + (K + k) * 16); /* the next panel, while this one computes */     \
            for (int r = 0; r < R; ++r) acc[r] += x[r * K + k] * b;                                          \
        }                                                                                                    \
        for (int r = 0; r < R; ++r) {                                                                        \
            zs_v16w o = acc[r];                                                                              \
            if (res) { zs_v16w h; memcpy(&h, res + r * N, sizeof h); o = h + o; }                            \
            memcpy(y + r * N, &o, sizeof o);                                                                 \
        }                                                                                                    \
    }
ZS_PANEL(8)
ZS_PANEL(4)
ZS_PANEL(2)
ZS_PANEL(1)

void zs_skinny_gemm(const float *x, int64_t M, int64_t K, const float *wp, int64_t N, const float *bias,
                    const float *res, float *y) {
    for (int64_t t = 0; t < N / 16; ++t) {
        const float *w = wp + t * K * 16;
        const float *bt = bias ? bias + t * 16 : 0;
        int64_t m = 0;
        int pf = t + 1 < N / 16; /* every group of rows prefetches the next panel (lines already asked for are cheap) */
#define ZS_ROWS(R)                                                                                           \
        for (; m + R <= M; m += R)                                                                           \
            zs_panel##R(x + m * K, K, w, bt, res ? res + m * N + t * 16 : 0, y + m * N + t * 16, N, pf);
        ZS_ROWS(8) ZS_ROWS(4) ZS_ROWS(2) ZS_ROWS(1)
#undef ZS_ROWS
    }
}

/* SwiGLU's gate: out [T, I] = silu(gu[:, :I]) * gu[:, I:] for gu [T, 2I] (the fused gate/up projection),
   with silu(x) = x * sigmoid(x), sigmoid from exp(-|x|) (exp_nonpos: no overflow, vectorised):
   1 / (1 + e) for x >= 0, e / (1 + e) below; torch's silu to float32 rounding. */
void zs_silu_mul(const float *gu, int64_t T, int64_t I, float *out) {
    for (int64_t t = 0; t < T; ++t) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        for (int64_t i = 0; i < I; ++i) {
            const float x = g[i];
            const float e = exp_nonpos(-fabsf(x));
            const float s = (x >= 0.f ? 1.f : e) / (1.f + e);
            o[i] = x * s * u[i];
        }
    }
}

/* The int8 LM head's activation side (see models/greedy_head.py, whose torch code this mirrors):
   per row of h [R, H], a = max|h_i| / 127 (1 for a zero row), p = round-half-even(h / a) clamped to
   +-127, and err = [min(||h||_1 E, ||h||_2 E2) + min(||d||_inf G, ||d||_2 G2)] / a (1 + 2^-10)
   + 2^-20 127 G with d = h - a p, all in double, rounded up to a float. */
void zs_int8_rows(const float *h, int64_t R, int64_t H, double E, double E2, double G, double G2, int8_t *p,
                  float *a_out, float *err) {
    for (int64_t r = 0; r < R; ++r) {
        const float *x = h + r * H;
        int8_t *q = p + r * H;
        float m = 0.f;
        for (int64_t i = 0; i < H; ++i) { const float v = fabsf(x[i]); m = v > m ? v : m; }
        const float a = m > 0.f ? m / 127.f : 1.f;
        double l1 = 0, l2 = 0, dinf = 0, d2 = 0;
        for (int64_t i = 0; i < H; ++i) {
            float t = nearbyintf(x[i] / a);
            t = t > 127.f ? 127.f : (t < -127.f ? -127.f : t);
            q[i] = (int8_t)t;
            const double xd = (double)x[i], d = xd - (double)a * (double)t;
            l1 += fabs(xd); l2 += xd * xd;
            dinf = fabs(d) > dinf ? fabs(d) : dinf; d2 += d * d;
        }
        const double t1 = fmin(l1 * E, sqrt(l2) * E2), t2 = fmin(dinf * G, sqrt(d2) * G2);
        const double b = (t1 + t2) / (double)a * (1 + 0x1p-10) + 0x1p-20 * 127 * G;
        float bf = (float)b;
        if ((double)bf < b) bf = nextafterf(bf, INFINITY);
        a_out[r] = a;
        err[r] = bf;
    }
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
typedef float zs_v16f __attribute__((vector_size(64)));
typedef int32_t zs_v16i __attribute__((vector_size(64)));

/* GCC/Clang vector extensions (one AVX-512 register, or several narrower ones): the compiler would not
   vectorise a scalar max or compare loop over floats by itself (NaN rules) */
static inline zs_v16f zs_load16(const float *p) { zs_v16f v; memcpy(&v, p, sizeof v); return v; }

void zs_greedy_refine_f32(const float *approx, const float *hidden, const float *w, const float *err,
                          int64_t rows, int64_t vocab, int64_t h, int64_t max_cand, int64_t *tokens) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *a = approx + r * vocab;
        const float *x = hidden + r * h;
        int64_t j = 0;
        float m = -INFINITY;
        if (vocab >= 16) {
            zs_v16f mv = zs_load16(a);
            for (j = 16; j + 16 <= vocab; j += 16) {
                const zs_v16f v = zs_load16(a + j);
                const zs_v16i gt = v > mv;
                mv = (zs_v16f)(((zs_v16i)v & gt) | ((zs_v16i)mv & ~gt));
            }
            for (int k = 0; k < 16; ++k) m = mv[k] > m ? mv[k] : m;
        }
        for (; j < vocab; ++j) m = a[j] > m ? a[j] : m;
        const double thr = (double)m - 2.0 * (double)err[r];
        float tf = (float)thr;
        if ((double)tf > thr) tf = nextafterf(tf, -INFINITY);
        const zs_v16f tv = (zs_v16f){0} + tf;
        int64_t count = 0, best_j = -1;
        float best = -INFINITY;
        for (int64_t j0 = 0; j0 < vocab && count <= max_cand; j0 += 64) {
            const int64_t j1 = j0 + 64 < vocab ? j0 + 64 : vocab;
            if (j1 - j0 == 64) { /* a vectorised test of 64 tokens first: candidates are rare */
                zs_v16f v0 = zs_load16(a + j0), v1 = zs_load16(a + j0 + 16), v2 = zs_load16(a + j0 + 32),
                        v3 = zs_load16(a + j0 + 48);
                const zs_v16i ge = (v0 >= tv) | (v1 >= tv) | (v2 >= tv) | (v3 >= tv);
                uint64_t u[8];
                memcpy(u, &ge, sizeof u);
                if (!(u[0] | u[1] | u[2] | u[3] | u[4] | u[5] | u[6] | u[7])) continue;
            }
            for (j = j0; j < j1; ++j) {
                if (!(a[j] >= tf)) continue;
                if (++count > max_cand) { best_j = -1; break; }
                const float *wj = w + j * h;
                float s = 0.f;
                for (int64_t i = 0; i < h; ++i) s += x[i] * wj[i];
                if (s > best || best_j < 0) { best = s; best_j = j; }
            }
        }
        tokens[r] = count > max_cand ? -1 : best_j;
    }
}

"""
