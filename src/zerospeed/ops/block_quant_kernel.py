"""A C twin of :mod:`zerospeed.ops.block_quant` for ZeRO++'s wire format, bit for bit the same results.

Why: the torch reference makes about ten passes over a tensor and allocates a new buffer for most of them; on
this project's 2-core VM a fresh 4 MiB buffer costs ~1000 page faults, and quantizing 1 Mi fp32 elements took
18-29 ms (profile: ``round``, ``amax``, ``div`` and ``copy_`` at 4-5 ms each, where one streaming pass takes
~0.3 ms). ZeRO++ quantizes about 1.5 Ψ elements per rank and step (qwZ's shard, qgZ's two levels), so at 2M
parameters that is tens of ms a step on a loaded machine. This kernel does each block in two streaming passes
(absmax on the float bits as unsigned integers, then the codes) and writes the wire payload in place: codes, then
one fp32 scale per block. Measured (one thread, 1 Mi elements, int4, thread CPU time, -march=native on this
project's Xeon): 0.12 ms against 2.3-3.1 ms for the torch reference with its payload; dequantize-and-add 0.07 ms.

Exactness (what the tests check against the torch twin, on every block size and both widths): the same
operations in the same order and precision: ``s = absmax / qmax`` (an fp32 division, as torch's tensor-scalar
division), ``q = rintf(x / s)`` (round half to even in the default mode, as ``torch.round``), clamped to ``[-qmax, qmax]``; a
zero block has scale 0 and codes 0; dequantization is ``(float) q * s`` and a sum adds rows in order,
``acc + q s``. The build uses ``-ffp-contract=off`` (no fused multiply-add, which would round once where torch
rounds twice) and none of the fast-math flags, so the results are identical on every CPU; whichever path a rank
takes, every rank computes the same numbers. Non-finite inputs: a block holding an inf or NaN dequantizes to
all-NaN on both paths (the fp16 overflow check then sees it); only those blocks' code bytes may differ.

Build: plain C compiled on first use with ``$CC`` (default ``cc``) into ``$ZEROSPEED_KERNEL_CACHE`` (default
``~/.cache/zerospeed/kernels``), keyed by a hash of the source, flags, compiler and CPU flags, loaded with
``ctypes`` (about a second; no torch headers). :func:`available` says whether it built and why not. The build
level is ``$ZEROSPEED_KERNEL_ISA`` (``native`` by default, ``avx2``, ``scalar``), as for the inference C kernels; the
tests compare every level's bytes with torch's.

Which path runs: the ``block_quant`` fast path (:mod:`zerospeed.ops.fast_paths`). The config's
``fast_paths.block_quant`` or ``ZEROSPEED_FAST_PATHS=block_quant=torch`` (or ``=c``) forces one; ``auto`` times
both once per process on a 256 Ki-element tensor and keeps the torch reference unless C is faster by the chooser's
margin. :func:`choose` returns the name.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import threading

import torch

from zerospeed.ops import c_build, fast_paths

__all__ = ["C_SOURCE", "available", "choose", "dequantize_payload", "quantize_payload"]

log = logging.getLogger(__name__)

C_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

/* Layout: codes (int8 one per byte, or int4 two per byte as code+8, element 2i in the low nibble) for
   ceil(n/block)*block elements (the tail padded with code 0), then one float scale per block, written with memcpy
   (the payload need not be 4-byte aligned). */

/* max |x| of a block on the integer bits: |x|'s bits order like |x| for every non-NaN float, and NaN's are above
   inf's (0x7f800000), so one unsigned max (vectorisable, exact) gives the absmax and says whether inf/NaN occur. */
static uint32_t abs_bits_max(const float *x, int64_t len) {
    uint32_t m = 0;
    for (int64_t i = 0; i < len; i++) {
        uint32_t b;
        memcpy(&b, x + i, 4);
        b &= 0x7fffffffu;
        m = b > m ? b : m;
    }
    return m;
}

static inline int code_of(float x, float safe, float qmax) {
    float q = rintf(x / safe);  /* round half to even (the default rounding mode), as torch.round */
    q = q < -qmax ? -qmax : q;
    q = q > qmax ? qmax : q;
    return (int)q;
}

void zs_block_quantize(const float *x, int64_t n, int64_t block, int bits, uint8_t *codes, uint8_t *scales) {
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    const int64_t nblocks = (n + block - 1) / block;
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t start = b * block;
        const int64_t len = n - start < block ? n - start : block;
        const float *xb = x + start;
        const uint32_t mb = abs_bits_max(xb, len);
        const int bad = mb >= 0x7f800000u;  /* an inf or NaN in the block */
        float m;
        memcpy(&m, &mb, 4);
        const float s = bad ? NAN : m / qmax;
        memcpy(scales + 4 * b, &s, 4);
        const float safe = s > 0.0f ? s : 1.0f;
        if (bits == 8) {
            int8_t *cb = (int8_t *)codes + start;
            if (bad) memset(cb, 0, (size_t)len);
            else for (int64_t i = 0; i < len; i++) cb[i] = (int8_t)code_of(xb[i], safe, qmax);
            for (int64_t i = len; i < block; i++) cb[i] = 0;
        } else {
            uint8_t *cb = codes + start / 2;
            const int64_t pairs = len / 2;
            if (bad) memset(cb, 0x88, (size_t)pairs);
            else for (int64_t i = 0; i < pairs; i++)
                cb[i] = (uint8_t)((code_of(xb[2 * i], safe, qmax) + 8) | ((code_of(xb[2 * i + 1], safe, qmax) + 8) << 4));
            int64_t i = pairs;
            if (len % 2) { cb[i] = (uint8_t)((bad ? 0 : code_of(xb[len - 1], safe, qmax)) + 8) | (8 << 4); i++; }
            for (; i < block / 2; i++) cb[i] = 0x88;
        }
    }
}

/* out[0:n] = q*s (accumulate == 0) or out[0:n] + q*s (accumulate != 0), block by block. */
void zs_block_dequantize(const uint8_t *codes, const uint8_t *scales, int64_t n, int64_t block, int bits,
                         float *out, int accumulate) {
    const int64_t nblocks = (n + block - 1) / block;
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t start = b * block;
        const int64_t len = n - start < block ? n - start : block;
        float s;
        memcpy(&s, scales + 4 * b, 4);
        float *ob = out + start;
        if (bits == 8) {
            const int8_t *cb = (const int8_t *)codes + start;
            if (accumulate) for (int64_t i = 0; i < len; i++) ob[i] = ob[i] + (float)cb[i] * s;
            else for (int64_t i = 0; i < len; i++) ob[i] = (float)cb[i] * s;
        } else {
            const uint8_t *cb = codes + start / 2;
            const int64_t pairs = len / 2;
            if (accumulate) {
                for (int64_t i = 0; i < pairs; i++) {
                    ob[2 * i] = ob[2 * i] + (float)((int)(cb[i] & 15) - 8) * s;
                    ob[2 * i + 1] = ob[2 * i + 1] + (float)((int)(cb[i] >> 4) - 8) * s;
                }
            } else {
                for (int64_t i = 0; i < pairs; i++) {
                    ob[2 * i] = (float)((int)(cb[i] & 15) - 8) * s;
                    ob[2 * i + 1] = (float)((int)(cb[i] >> 4) - 8) * s;
                }
            }
            if (len % 2) {
                float v = (float)((int)(cb[pairs] & 15) - 8) * s;
                ob[len - 1] = accumulate ? ob[len - 1] + v : v;
            }
        }
    }
}
"""

#: Base flags (the level's instruction-set flags go after -O3, :mod:`zerospeed.ops.c_build`); no fast-math and no
#: contraction, so every build computes what the torch reference computes.
BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]

_lock = threading.Lock()
_state: dict = {}

#: ``ZEROSPEED_KERNEL_ISA`` (shared with the inference C kernels) -> instruction-set flags: ``native`` (default,
#: what the building CPU has), ``avx2`` (x86-64-v3), ``scalar`` (the architecture's baseline, auto-vectoriser off);
#: ``make test-isa`` runs the tests at each. The results are the same bytes at every level (tested).
ISA_ENV = c_build.ISA_ENV
ISA_FLAGS = c_build.ISA_FLAGS
BASELINE = "scalar"
kernel_isa = c_build.kernel_isa
_is_x86 = c_build.is_x86

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {"zs_block_quantize": ([_P, _I, _I, ctypes.c_int, _P, _P], None),
               "zs_block_dequantize": ([_P, _P, _I, _I, ctypes.c_int, _P, ctypes.c_int], None)}


def _build(isa: str = "native") -> ctypes.CDLL:
    return c_build.build("block_quant", C_SOURCE, c_build.isa_flags(isa, BASE_FLAGS), _SIGNATURES)


def _dll() -> ctypes.CDLL | None:
    with _lock:
        if "dll" not in _state:
            try:
                _state["dll"], _state["why_not"] = _build(kernel_isa()), None
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _state["dll"], _state["why_not"] = None, str(exc)
        return _state["dll"]


def available() -> tuple[bool, str | None]:
    """(built, why not)."""
    ok = _dll() is not None
    return ok, _state.get("why_not")


def _code_bytes(numel: int, block: int, bits: int) -> int:
    return -(-numel // block) * block * bits // 8


def quantize_payload(x: torch.Tensor, bits: int, block: int, out: torch.Tensor) -> torch.Tensor:
    """Quantize ``x`` (flat fp32, contiguous, CPU) into ``out`` (uint8, exactly the wire bytes): codes, then scales."""
    dll = _dll()
    if dll is None:
        raise RuntimeError(f"block_quant C kernel unavailable: {_state.get('why_not')}")
    x = x.reshape(-1)
    if x.dtype != torch.float32 or not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError(f"quantize_payload: x must be contiguous CPU float32, got {x.dtype} on {x.device}")
    code_bytes = _code_bytes(x.numel(), block, bits)
    need = code_bytes + 4 * -(-x.numel() // block)
    if out.dtype != torch.uint8 or out.numel() != need or not out.is_contiguous():
        raise ValueError(f"quantize_payload: out must be {need} contiguous uint8 bytes, got {out.numel()} {out.dtype}")
    dll.zs_block_quantize(x.data_ptr(), x.numel(), block, bits, out.data_ptr(), out.data_ptr() + code_bytes)
    return out


def dequantize_payload(raw: torch.Tensor, numel: int, bits: int, block: int, out: torch.Tensor,
                       accumulate: bool = False) -> torch.Tensor:
    """``out`` (flat fp32, ``numel``) = (or +=) the values of the payload ``raw`` (uint8, contiguous)."""
    dll = _dll()
    if dll is None:
        raise RuntimeError(f"block_quant C kernel unavailable: {_state.get('why_not')}")
    code_bytes = _code_bytes(numel, block, bits)
    need = code_bytes + 4 * -(-numel // block)
    if raw.dtype != torch.uint8 or raw.numel() != need or not raw.is_contiguous():
        raise ValueError(f"dequantize_payload: raw must be {need} contiguous uint8 bytes, got {raw.numel()}")
    if out.dtype != torch.float32 or out.numel() != numel or not out.is_contiguous():
        raise ValueError(f"dequantize_payload: out must be {numel} contiguous float32, got {out.numel()} {out.dtype}")
    dll.zs_block_dequantize(raw.data_ptr(), raw.data_ptr() + code_bytes, numel, block, bits, out.data_ptr(),
                            int(accumulate))
    return out


_CHOOSER = fast_paths.FastPathChooser(repeats=3, budget_s=0.05)


def choose(setting: str = "auto") -> str:
    """``"torch"`` or ``"c"``: the ``block_quant`` fast path of this process (see the module docstring)."""
    source = "fast_paths.block_quant" if setting != "auto" else "ZEROSPEED_FAST_PATHS: block_quant"
    setting = fast_paths.resolve_setting("block_quant", setting, source)
    ok, why = available()
    sample = torch.randn(256 << 10, generator=torch.Generator().manual_seed(0))
    payload = torch.empty(_code_bytes(sample.numel(), 128, 4) + 4 * (sample.numel() // 128), dtype=torch.uint8)

    def run_torch() -> None:
        from zerospeed.ops.block_quant import quantize
        q = quantize(sample, 4, 128)
        torch.cat([q.codes.view(torch.uint8), q.scales.view(torch.uint8)])

    candidates = {
        "torch": fast_paths.Candidate(run_torch),
        "c": fast_paths.Candidate((lambda: quantize_payload(sample, 4, 128, payload)) if ok else None,
                                  why_not=why or ""),
    }
    return _CHOOSER.choose("block_quant", "wire", candidates, setting, source, measure=fast_paths.thread_cpu_clock)
