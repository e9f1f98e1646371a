"""The C kernels of a CPU float32 decode step against their torch twins: the skinny GEMM (packed weight, bias,
residual, every row-group size) within the float32 rounding bound of its dot products, the RMSNorm (rtol (K/2 + 4) u =
1.4e-6: a 40-term sum of squares, the square root and two products), the SwiGLU gate (rtol
2e-6: ~16 ulps for the polynomial exp, the sigmoid's division and the products) and the fused attention glue
(rotary, cache writes, decode attention, prompt chunks in the same forward; 1e-5 for outputs of size ~1, 1e-6 for
the rotated keys: two products and a sum, a few ulps of |k|). Measured at most 18% of each of these tolerances at
every ISA level of make test-isa. Values only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zerospeed.inference import cpu_kernel
from zerospeed.inference.attention import AttentionMetadata
from zerospeed.inference.models import layers
from zerospeed.inference.models.layers import RMSNorm, RowLinear, TPInfo, apply_rotary, cpu_linear

pytestmark = pytest.mark.skipif(not cpu_kernel.available()[0], reason="no C compiler for the CPU kernels")
BS = 4
U = 2.0**-24  # float32 unit roundoff


def _assert_gemm_rounding(got, want, x, w, *added):
    """``got`` and ``want`` are two float32 evaluations of ``x @ w.T`` (plus the tensors in ``added``), by different
    kernels (the C GEMM, MKL / oneDNN at whatever ISA they dispatch to). Any summation order, with or without FMA, is
    within gamma_K |x| @ |w|.T ~ K u |x| @ |w|.T of the exact result (Higham, Accuracy and Stability of Numerical
    Algorithms, eq. 3.5), each term added afterwards adds one rounding, so the two differ by at most twice that,
    elementwise (issue #25: bounded by the arithmetic, not by what one CPU gave; measured at most 4% of it at the
    native, avx2 and scalar kernel builds with MKL at AVX512, AVX2 and SSE4.2). Wrong packing, indexing, bias or
    residual handling is off by O(1) and fails."""
    k = x.shape[-1]
    bound = 2 * (k + len(added)) * U * (x.abs() @ w.abs().t() + sum(t.abs() for t in added))
    ratio = ((got - want).abs() / bound).max().item()
    assert ratio <= 1.0, f"difference is {ratio:.3g} x the float32 rounding bound"


@pytest.fixture(autouse=True)
def one_thread():
    """The single-threaded kernels are chosen with one torch thread (as the suite runs): pin it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 15, 24])
def test_skinny_gemm_equals_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 72, generator=g)
    b = torch.randn(48, generator=g)
    x = torch.randn(rows, 72, generator=g)
    res = torch.randn(rows, 48, generator=g)
    packed = cpu_kernel.pack_weight(w)
    _assert_gemm_rounding(cpu_kernel.skinny_linear(x, packed), F.linear(x, w), x, w)
    _assert_gemm_rounding(cpu_kernel.skinny_linear(x, packed, b, res), res + F.linear(x, w, b), x, w, b, res)


def test_cpu_linear_routes_by_rows_and_follows_weight_changes():
    """Few rows go through the packed C GEMM, many through torch; either way the same values, and a
    weight updated in place is re-packed (the cache is keyed by the tensor's version)."""
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(32, 64, bias=False)
    row = RowLinear(64, 32, True, TPInfo())
    with torch.no_grad():
        lin.weight.copy_(torch.randn(64, 32, generator=g))
        row.weight.copy_(torch.randn(32, 64, generator=g))
        row.bias.copy_(torch.randn(32, generator=g))
    lo, hi = layers.SKINNY_ROWS
    for rows in (1, lo, hi, hi + 1):
        x = torch.randn(rows, 32, generator=g)
        h = torch.randn(rows, 32, generator=g)
        _assert_gemm_rounding(cpu_linear(x, lin), lin(x), x, lin.weight.detach())
        y = torch.randn(rows, 64, generator=g)
        _assert_gemm_rounding(cpu_linear(y, row, residual=h), h + row(y), y, row.weight.detach(), row.bias.detach(), h)
    assert "_packed_weight" in lin.__dict__
    with torch.no_grad():
        lin.weight.mul_(2)
    x = torch.randn(lo, 32, generator=g)
    _assert_gemm_rounding(cpu_linear(x, lin), lin(x), x, lin.weight.detach())


def test_rms_norm_equals_module():
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(40, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(40, generator=g))
    x = torch.randn(7, 40, generator=g) * 3
    # a 40-term sum of squares (at most 40 u relative, halved by the square root) and a few roundings after it
    torch.testing.assert_close(cpu_kernel.rms_norm(x, norm.weight, norm.eps), norm(x), rtol=(40 / 2 + 4) * U, atol=1e-6)


@pytest.mark.parametrize("hq,hkv,rot,window", [(4, 2, 8, None), (4, 4, 4, None), (2, 1, 8, 5)])
def test_fused_attention_glue_equals_torch_path(hq, hkv, rot, window):
    """attend_qkv (rotary + cache writes + decodes in C, prompt chunks by SDPA) against apply_rotary +
    attend on the torch path: same output and same cache contents, with decodes, a fresh prompt and
    a continued prompt in one forward; partial rotary (rot < head_dim) and a sliding window too."""
    d = 8
    g = torch.Generator().manual_seed(hq + rot)
    num_blocks = 24
    kc = torch.randn(num_blocks * BS, hkv, d, generator=g)
    vc = torch.randn(num_blocks * BS, hkv, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [perm[0:4], perm[4:6], perm[6:8], perm[8:12]]
    # two decodes (contexts 14 and 7), a fresh 5-token prompt, a 4-token chunk after 8 cached tokens
    items = [(13, 1, tables[0]), (6, 1, tables[1]), (0, 5, tables[2]), (8, 4, tables[3])]
    T = 1 + 1 + 5 + 4
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g)
    positions = torch.tensor([13, 6, 0, 1, 2, 3, 4, 8, 9, 10, 11])
    freqs = torch.outer(positions.float(), torch.rand(rot // 2, generator=g))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
    outs, caches = [], []
    for fused in (False, True):
        meta = AttentionMetadata.build(items, 2, BS, torch.device("cpu"), decode_kernel=True)
        assert meta.cpu_fused
        k_cache, v_cache = kc.clone(), vc.clone()
        if fused:
            out = meta.attend_qkv(qkv, hq, hkv, d, cos, sin, k_cache, v_cache, 0.4, window)
        else:
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q = apply_rotary(q.reshape(T, hq, d), cos, sin, rot)
            k = apply_rotary(k.reshape(T, hkv, d), cos, sin, rot)
            out = meta.attend(q, k, v.reshape(T, hkv, d), k_cache, v_cache, 0.4, window)
        outs.append(out)
        caches.append((k_cache, v_cache))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[1][0], caches[0][0], rtol=1e-6, atol=1e-6)
    assert torch.equal(caches[1][1], caches[0][1])


def test_silu_mul_equals_torch():
    g = torch.Generator().manual_seed(5)
    gu = torch.randn(9, 2 * 40, generator=g) * 4
    gu[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -90.0])
    want = F.silu(gu[:, :40]) * gu[:, 40:]
    torch.testing.assert_close(cpu_kernel.silu_mul(gu, 40), want, rtol=2e-6, atol=1e-30)


def test_skinny_path_only_with_one_thread():
    """The C GEMM is single-threaded: with more torch threads cpu_linear leaves the rows to torch (the
    packed copy is then never made)."""
    lin = torch.nn.Linear(32, 64, bias=False)
    x = torch.randn(layers.SKINNY_ROWS[0], 32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        torch.testing.assert_close(cpu_linear(x, lin), lin(x))
        assert "_packed_weight" not in lin.__dict__
        torch.set_num_threads(1)
        cpu_linear(x, lin)
        assert "_packed_weight" in lin.__dict__
    finally:
        torch.set_num_threads(before)
