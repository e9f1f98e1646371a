"""Greedy tokens from an int8 copy of the LM head, exact: approximate logits pick candidates within a
proven error bound, exact float32 logits of the candidates pick the token.

Why: a decode step on CPU is bound by the bytes it reads, and the LM head is the largest single
read (vocab x hidden: 33 MB in float32 for the bench's 32000 x 256 head, 16 MB in bfloat16, 8 MB in
int8). Where oneDNN's int8 matmul runs on int8 matrix units it reads the int8 copy at memory speed:
on the bench's head, one thread, caches flushed as in a step (CPU ms, 2 / 8 / 12 / 16 rows),
bfloat16 1.93 / 1.90 / 2.04 / 2.05, int8 1.17 / 1.28 / 1.29 / 1.30 (2026-11-24, 2-core Xeon with
AMX). Elsewhere it can be far slower than float32 (35.7 ms against 0.26 ms a call on an AMD EPYC with
VNNI, issue #25), so this head is one candidate among three, chosen by timing them
(:func:`zerospeed.inference.fast_path_choice.choose_greedy_head`), never by a CPU flag; this module
only says whether it runs correctly here (:func:`int8_available`). With one row oneDNN's int8 kernel
took 230 ms, so a single row is sent twice.

Quantisation: each vocabulary row ``w_j`` gets a scale ``s_j = max_i |w_ji| / 127`` and int8 values
``q_j = round(w_j / s_j)``; each hidden row ``h`` (one per sequence) gets ``a = max_i |h_i| / 127``
and ``p = round(h / a)``. oneDNN returns ``A_j = s_j * (p . q_j)``: the integer dot product is exact
in int32, then one or two float32 roundings. ``A_j`` approximates ``h . w_j / a``.

The bound, per hidden row, uniform over the vocabulary: write ``w_j = s_j q_j + e_j`` and
``h = a p + d`` (``d`` computed exactly in float64, where products of float32 values are exact). Then

    h . w_j - a s_j (p . q_j) = h . e_j + s_j (d . q_j),  so, by Hoelder (1, inf) and Cauchy-Schwarz,
    |h . w_j / a - s_j (p . q_j)| <= [min(||h||_1 E, ||h||_2 E2) + min(||d||_inf G, ||d||_2 G2)] / a

with ``E = max_ji |e_ji|``, ``E2 = max_j ||e_j||_2``, ``G = max_j s_j ||q_j||_1`` and
``G2 = max_j s_j ||q_j||_2``, computed once in float64 from the stored float32 values (the norms of
``h`` and ``d`` too, per step; ``(1 + 2^-10)`` covers float64 rounding). The float32 roundings of
``A_j`` add at most a few units of ``2^-24 |A_j|``, and ``|A_j| <= s_j ||q_j||_1 ||p||_inf <= 127 G``:
``2^-20 127 G`` covers them (and the int32 -> float32 conversion when ``H > 1040``). With ``err`` that sum, rounded up to a float32: if ``t`` is
the exact argmax and ``k`` the approximate one, ``A_t >= exact_t / a - err >= exact_k / a - err >=
A_k - 2 err``, so every token within ``2 err`` of the best approximate logit is a candidate
(:func:`cpu_kernel.greedy_refine`, or :func:`refine_torch` where ``cpu_kernels`` keeps torch), and the
candidates' float32 dot products ``h . w_j`` choose (lowest id on ties). The token is therefore the
float32 argmax, up to the float32 rounding of the candidates' dot products (as any change of
summation order). A row with more than ``max_candidates`` candidates gets its logits in full (the
caller's fallback). On the bench's random head the bound is about 8x the largest actual error
(worst-case alignment) and leaves a median of about 6 candidates per row (1-28 over 12 rows).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from zerospeed.inference import cpu_kernel


@functools.lru_cache(maxsize=None)
def int8_available() -> tuple[bool, str]:
    """Whether oneDNN's int8 linear runs here and does what this module assumes (the exact integer
    products, checked on a small probe head), and why not. Not whether it is *fast*: that is measured
    (:func:`zerospeed.inference.fast_path_choice.choose_greedy_head`); on an AMD EPYC with VNNI it ran
    at 35.7 ms a call where float32 took 0.26 ms (issue #25)."""
    onednn = getattr(torch.ops, "onednn", None)
    try:
        if onednn is None or not hasattr(onednn, "qlinear_pointwise") or not hasattr(onednn, "qlinear_prepack"):
            return False, "this torch has no oneDNN int8 linear (torch.ops.onednn.qlinear_pointwise)"
        w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
        if build_int8_head(w) is None:
            return False, "oneDNN's int8 linear did not give the exact integer products on a probe"
        return True, ""
    except Exception as exc:  # pragma: no cover - an op that exists but fails
        return False, f"oneDNN's int8 linear failed on a probe: {type(exc).__name__}: {exc}"


def int8_matmul_available() -> bool:
    """:func:`int8_available` as a bool."""
    return int8_available()[0]


@dataclass(frozen=True)
class Int8Head:
    """The int8 copy of an LM head weight ``[V, H]`` and the constants of the error bound."""

    packed: torch.Tensor  # oneDNN-packed int8 weight
    scales: torch.Tensor  # [V] float32 s_j
    zero_points: torch.Tensor  # [V] int64 zeros (symmetric)
    max_residual: float  # E = max_ji |w_ji - s_j q_ji|
    max_residual_l2: float  # E2 = max_j ||w_j - s_j q_j||_2
    max_scaled_l1: float  # G = max_j s_j ||q_j||_1
    max_scaled_l2: float  # G2 = max_j s_j ||q_j||_2


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [V, H]`` float32 -> int8 ``q`` and float32 scales ``s`` (``s_j = max|w_j| / 127``, 1 for
    an all-zero row)."""
    s = torch.empty(w.shape[0], dtype=torch.float32)
    q = torch.empty(w.shape, dtype=torch.int8)
    for lo in range(0, w.shape[0], 1024):  # in slices: no full-size temporaries
        part = w[lo:lo + 1024]
        sc = part.abs().amax(dim=1) / 127
        sc = torch.where(sc > 0, sc, torch.ones_like(sc))
        s[lo:lo + 1024] = sc
        q[lo:lo + 1024] = torch.round(part / sc.unsqueeze(1)).clamp_(-127, 127)
    return q, s


def build_int8_head(w: torch.Tensor) -> Int8Head | None:
    """Quantise and pack ``w``; None when oneDNN's result on a probe is not the integer product
    (an op that does not do what this module assumes is never used)."""
    q, s = quantize_rows(w)
    consts = [0.0, 0.0, 0.0, 0.0]
    for lo in range(0, w.shape[0], 1024):  # float64 in slices: no 8-byte copy of the whole head at once
        s64 = s[lo:lo + 1024].double().unsqueeze(1)
        scaled = s64 * q[lo:lo + 1024].double()
        residual = w[lo:lo + 1024].double() - scaled
        part = (residual.abs().max(), residual.norm(dim=1).max(), scaled.abs().sum(dim=1).max(),
                scaled.norm(dim=1).max())
        consts = [max(c, float(x)) for c, x in zip(consts, part)]
    zps = torch.zeros(w.shape[0], dtype=torch.int64)
    try:
        packed = torch.ops.onednn.qlinear_prepack(q, None)
        probe = torch.randint(-127, 128, (2, w.shape[1]), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
        got = _qlinear(probe, packed, s, zps).double()
    except (AttributeError, RuntimeError, TypeError):
        return None
    for lo in range(0, w.shape[0], 1024):  # integer products: exact in float64
        want = (probe.double() @ q[lo:lo + 1024].double().t()) * s[lo:lo + 1024].double()
        if not torch.allclose(got[:, lo:lo + 1024], want, rtol=2.0 ** -20, atol=0.0):
            return None
    return Int8Head(packed, s, zps, *consts)


def _qlinear(p: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zps: torch.Tensor) -> torch.Tensor:
    return torch.ops.onednn.qlinear_pointwise(p, 1.0, 0, packed, scales, zps, None, 1.0, 0, torch.float32,
                                              "none", [], "")


def approx_logits(head: Int8Head, hidden: torch.Tensor, use_c: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [R, H]`` float32 -> approximate logits ``[R, V]`` float32 in units of each row's
    activation scale, and ``err [R]`` float32 (the bound above, rounded up). ``use_c``: the
    activation side in one C pass (:func:`cpu_kernel.int8_rows`, the same values as this torch
    code, tested) instead of ~20 small torch ops."""
    rows = hidden.shape[0]
    consts = (head.max_residual, head.max_residual_l2, head.max_scaled_l1, head.max_scaled_l2)
    if use_c:
        p, _, err = cpu_kernel.int8_rows(hidden.contiguous(), consts)
    else:
        p, _, err = activation_rows(hidden, consts)
    return _qlinear(p, head.packed, head.scales, head.zero_points)[:rows], err


def activation_rows(hidden: torch.Tensor, consts: tuple[float, float, float, float]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch twin of :func:`cpu_kernel.int8_rows`: ``hidden [R, H]`` float32 -> int8 rows
    ``p [max(R, 2), H]`` (a single row sent twice: oneDNN's int8 kernel for one row is ~500x slower
    than for two), scales ``a [R]`` and bounds ``err [R]`` for the head's ``consts = (E, E2, G, G2)``."""
    rows = hidden.shape[0]
    e, e2, g, g2 = consts
    m = hidden.abs().amax(dim=1)
    a = torch.where(m > 0, m / 127, torch.ones_like(m))
    p = torch.round(hidden / a.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    if rows == 1:
        p = p.expand(2, -1).contiguous()
    h64, a64 = hidden.double(), a.double()
    d = h64 - a64.unsqueeze(1) * p[:rows].double()
    t1 = torch.minimum(h64.abs().sum(dim=1) * e, h64.norm(dim=1) * e2)
    t2 = torch.minimum(d.abs().amax(dim=1) * g, d.norm(dim=1) * g2)
    bound = (t1 + t2) / a64 * (1 + 2.0 ** -10) + 2.0 ** -20 * 127 * g  # |A_j| <= 127 G
    err = bound.float()
    return p, a, torch.nextafter(err, torch.full_like(err, float("inf")))


def refine_torch(approx: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, err: torch.Tensor,
                 max_candidates: int) -> torch.Tensor:
    """The pure-torch twin of :func:`zerospeed.inference.cpu_kernel.greedy_refine` (used without a C
    compiler, and by the tests as the reference): per row, the tokens within ``2 * err`` of the best
    approximate logit, the exact float32 ``h . w_j`` of each, the largest (lowest id on ties);
    -1 where there are more than ``max_candidates`` candidates (or none)."""
    a = approx.double()
    thr = a.amax(dim=1) - 2 * err.double()
    out = torch.full((approx.shape[0],), -1, dtype=torch.int64)
    for r in range(approx.shape[0]):
        cand = (a[r] >= thr[r]).nonzero(as_tuple=True)[0]
        if 0 < cand.numel() <= max_candidates:
            exact = weight.index_select(0, cand) @ hidden[r]
            out[r] = cand[int(exact.argmax())]  # first maximum: candidates are in id order
    return out
