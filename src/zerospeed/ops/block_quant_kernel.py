"""A C twin of :mod:`zerospeed.ops.block_quant` for ZeRO++'s wire format, bit for bit the same results.

Why: the torch reference makes about ten passes over a tensor and allocates a new buffer for most of them; on
this project's 2-core VM a fresh 4 MiB buffer costs ~1000 page faults, and quantizing 1 Mi fp32 elements took
18-29 ms (profile: ``round``, ``amax``, ``div`` and ``copy_`` at 4-5 ms each, where one streaming pass takes
~0.3 ms). ZeRO++ quantizes about 1.5 Ψ elements per rank and step (qwZ's shard, qgZ's two levels), so at 2M
parameters that is ~100 ms a step: more than the 200 Mbit/s link saves. This kernel does each block in one pass
(absmax, then codes) and writes the wire payload in place: codes, then one fp32 scale per block.

Exactness (what the tests check against the torch twin, on every block size and both widths): the same
operations in the same order and precision: ``s = absmax / qmax`` (an fp32 division, as torch's tensor-scalar
division), ``q = nearbyintf(x / s)`` (round half to even, as ``torch.round``), clamped to ``[-qmax, qmax]``; a
zero block has scale 0 and codes 0; dequantization is ``(float) q * s`` and a sum adds rows in order,
``acc + q s``. The build uses ``-ffp-contract=off`` (no fused multiply-add, which would round once where torch
rounds twice) and none of the fast-math flags, so the results are identical on every CPU; whichever path a rank
takes, every rank computes the same numbers. Non-finite inputs: a block holding an inf or NaN dequantizes to
all-NaN on both paths (the fp16 overflow check then sees it); only those blocks' code bytes may differ.

Build: plain C compiled on first use with ``$CC`` (default ``cc``) into ``$ZEROSPEED_KERNEL_CACHE`` (default
``~/.cache/zerospeed/kernels``), keyed by a hash of the source, flags, compiler and CPU flags, loaded with
``ctypes`` (about a second; no torch headers). :func:`available` says whether it built and why not.

Which path runs: the ``block_quant`` fast path (:mod:`zerospeed.ops.fast_paths`; ``ZEROSPEED_FAST_PATHS=
block_quant=torch`` or ``=c`` forces one, ``auto`` times both once per process on a 256 Ki-element tensor and
keeps the torch reference unless C is faster by the chooser's margin). :func:`choose` returns the name.
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

from zerospeed.ops import fast_paths

__all__ = ["C_SOURCE", "available", "choose", "dequantize_payload", "quantize_payload"]

log = logging.getLogger(__name__)

C_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

/* x: n floats; codes: ceil(n/block)*block codes (int8 one per byte, or int4 two per byte: code+8, element 2i in
   the low nibble); scales: one float per block, written with memcpy (the payload may not be 4-byte aligned). */
void zs_block_quantize(const float *x, int64_t n, int64_t block, int bits, uint8_t *codes, uint8_t *scales) {
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    const int64_t nblocks = (n + block - 1) / block;
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t start = b * block;
        const int64_t len = n - start < block ? n - start : block;
        const float *xb = x + start;
        float m = 0.0f;
        int bad = 0;
        for (int64_t i = 0; i < len; i++) {
            float a = fabsf(xb[i]);
            m = a > m ? a : m;
            bad |= !(a <= 3.4028234663852886e38f);  /* inf or NaN */
        }
        float s = bad ? NAN : m / qmax;
        memcpy(scales + 4 * b, &s, 4);
        const float safe = s > 0.0f ? s : 1.0f;
        if (bits == 8) {
            int8_t *cb = (int8_t *)codes + start;
            for (int64_t i = 0; i < len; i++) {
                float q = nearbyintf(xb[i] / safe);
                q = q < -qmax ? -qmax : (q > qmax ? qmax : q);
                cb[i] = bad ? 0 : (int8_t)q;
            }
            for (int64_t i = len; i < block; i++) cb[i] = 0;
        } else {
            uint8_t *cb = codes + start / 2;
            for (int64_t i = 0; i < block; i += 2) {
                int c[2];
                for (int k = 0; k < 2; k++) {
                    if (i + k >= len || bad) { c[k] = 0; continue; }
                    float q = nearbyintf(xb[i + k] / safe);
                    q = q < -qmax ? -qmax : (q > qmax ? qmax : q);
                    c[k] = (int)q;
                }
                cb[i / 2] = (uint8_t)((c[0] + 8) | ((c[1] + 8) << 4));
            }
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
            for (int64_t i = 0; i < len; i++) {
                int c = ((cb[i >> 1] >> ((i & 1) * 4)) & 15) - 8;
                float v = (float)c * s;
                ob[i] = accumulate ? ob[i] + v : v;
            }
        }
    }
}
"""

FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=off"]

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
    flags = FLAGS if platform.machine().lower() in ("x86_64", "amd64") else [f for f in FLAGS if f != "-march=native"]
    key = hashlib.sha256((C_SOURCE + " ".join(flags) + cc + _cpu_tag()).encode()).hexdigest()[:16]
    cache = os.environ.get("ZEROSPEED_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "zerospeed",
                                                                       "kernels")
    os.makedirs(cache, exist_ok=True)
    lib = os.path.join(cache, f"block_quant_{key}.so")
    if not os.path.exists(lib):
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src = os.path.join(tmp, "block_quant.c")
            with open(src, "w") as f:
                f.write(C_SOURCE)
            out = os.path.join(tmp, "k.so")
            proc = subprocess.run([cc, *flags, src, "-o", out, "-lm"], capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} {' '.join(flags)} failed: {proc.stderr.strip()[-500:]}")
            os.replace(out, lib)  # atomic: ranks building at once never load half a file
    dll = ctypes.CDLL(lib)
    P, I = ctypes.c_void_p, ctypes.c_int64
    dll.zs_block_quantize.argtypes, dll.zs_block_quantize.restype = [P, I, I, ctypes.c_int, P, P], None
    dll.zs_block_dequantize.argtypes = [P, P, I, I, ctypes.c_int, P, ctypes.c_int]
    dll.zs_block_dequantize.restype = None
    return dll


def _dll() -> ctypes.CDLL | None:
    with _lock:
        if "dll" not in _state:
            try:
                _state["dll"], _state["why_not"] = _build(), None
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
    setting = fast_paths.resolve_setting("block_quant", setting)
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
    return _CHOOSER.choose("block_quant", "wire", candidates, setting, "ZEROSPEED_FAST_PATHS: block_quant",
                           measure=fast_paths.thread_cpu_clock)
