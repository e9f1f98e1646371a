"""Float32 linear layers on a weight packed once for oneDNN (the ``packed_linear`` fast path, issue #31).

``torch.nn.functional.linear`` on CPU calls the BLAS GEMM (MKL in torch's wheels), which repacks the weight
into its blocked layout at every call and, on some CPUs, dispatches to an older instruction set than the CPU
has. oneDNN's float32 inner product reads a weight reordered once into its own blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, an opaque ``torch._mkldnn`` tensor) and runs it through
``torch.ops.mkldnn._linear_pointwise`` (bias and a residual add fused), which is what vLLM's CPU build runs
its linears on. Measured on this project's 2-core AMD EPYC (no AMX), one thread, float32, CPU time: a
512-row chunk through a 99M Llama's linears 2.3x faster than ``F.linear`` (105 -> 247 GFLOP/s at
768 x 1280; the 32000-row LM head 91 -> 192), 2-8 rows 2-4x (MKL's small-``m`` path is slow there), one
row equal. Where it is faster is a measurement, not a flag: the inference engine times it against the
plain path per shape class (``packed_linear=auto``, :mod:`zerospeed.inference.forward_plan`).

Numerics: the same float32 products, summed in oneDNN's order instead of MKL's: each output differs from
the exact dot product by at most ``gamma_K = K u / (1 - K u)`` times ``sum_k |x_k w_k|`` (``u = 2^-24``),
as any float32 summation order; :func:`available` checks that on a probe (a build or a
``torch.backends.mkldnn`` setting that computes in bfloat16 or TF32 misses that bound by orders of
magnitude and is refused), and tests compare the two paths to that bound.

The packed weight is a copy (the weight's bytes once more); the owner caches it keyed by the weight's
identity and version, so a weight updated in place is repacked before its next use.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["available", "pack", "linear", "fp32_bound"]

#: the batch size oneDNN is told when it reorders a weight: a hint for the blocking, any row count runs
PACK_ROWS_HINT = 512


def fp32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[M, N]``: ``gamma_K * sum_k |x_mk w_nk|`` (float64), the bound of a float32 dot product's error in
    any summation order (``K`` the reduction length, ``u = 2^-24``)."""
    k = x.shape[-1]
    u = 2.0 ** -24
    gamma = k * u / (1 - k * u)
    return gamma * (x.double().abs() @ w.double().abs().t())


@functools.lru_cache(maxsize=1)
def available() -> tuple[bool, str]:
    """Whether oneDNN's packed float32 linear runs here and computes in float32 (within :func:`fp32_bound`
    of the exact products on a probe), and why not."""
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight") or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False, "this torch has no oneDNN linear (torch.ops.mkldnn._linear_pointwise)"
    if not torch.backends.mkldnn.is_available():
        return False, "torch was built without oneDNN (torch.backends.mkldnn.is_available() is False)"
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(24, 96, generator=g), torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
    try:
        y = linear(x, pack(w), b)
    except (RuntimeError, NotImplementedError) as exc:
        return False, f"oneDNN's linear failed on a probe: {type(exc).__name__}: {exc}"
    err = (y.double() - (x.double() @ w.double().t() + b.double())).abs()
    if not bool((err <= fp32_bound(x, w) + b.double().abs() * 2.0 ** -24).all()):
        return False, ("oneDNN's linear is not float32 here (its error exceeds float32's bound on a probe: "
                       "torch.backends.mkldnn may be set to a lower precision)")
    return True, ""


def pack(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` float32 (a linear layer's weight) reordered once for :func:`linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), PACK_ROWS_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` (``x [M, K]`` float32, ``packed`` from :func:`pack`), plus ``residual [M, N]`` if
    given (added in the same pass)."""
    if residual is not None:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
