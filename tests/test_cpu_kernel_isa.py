"""The C kernels built at each instruction-set level (``ZEROSPEED_KERNEL_ISA``: native, avx2 = x86-64-v3, scalar =
the architecture's baseline with the auto-vectoriser off), each loaded explicitly with ``cpu_kernel.load(isa)``
and compared with a float64 evaluation of its torch twin, every difference bounded by what float32 arithmetic
allows at the values' scale (unit roundoff u = 2^-24; a K-term dot product in any order is within
K u sum|a_i b_i| of the exact one, Higham eq. 3.5). A variant is its own cached library; the scalar one holds no
AVX instruction. Values only, no timing."""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from zerospeed.inference import cpu_kernel
from zerospeed.inference.models import greedy_head

U = 2.0 ** -24
X86 = platform.machine().lower() in ("x86_64", "amd64")
ISAS = ["native", "avx2", "scalar"] if X86 else ["native", "scalar"]
pytestmark = pytest.mark.skipif(not cpu_kernel.available()[0], reason="no C compiler for the CPU kernels")


@pytest.fixture(scope="module", params=ISAS)
def kern(request):
    return cpu_kernel.load(request.param)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _within(got: torch.Tensor, want64: torch.Tensor, bound64: torch.Tensor, what: str) -> None:
    err = (got.double() - want64).abs()
    worst = float((err - bound64).max())
    assert worst <= 0, f"{what}: error exceeds the bound by {worst:.3g} (max error {float(err.max()):.3g})"


# ----------------------------------------------------------------------------- builds

def test_each_level_is_its_own_library_with_its_flags():
    libs = {isa: cpu_kernel.load(isa) for isa in ISAS}
    assert len({k.dll._name for k in libs.values()}) == len(ISAS)
    assert "-march=native" in libs["native"].flags
    assert "-fno-tree-vectorize" in libs["scalar"].flags
    if X86:
        assert "-march=x86-64-v3" in libs["avx2"].flags and "-march=x86-64" in libs["scalar"].flags
    assert cpu_kernel.load("scalar") is libs["scalar"]  # loaded once per process


@pytest.mark.skipif(not X86 or shutil.which("objdump") is None, reason="x86 disassembly needs objdump")
def test_scalar_build_has_no_avx_and_avx2_build_no_avx512():
    def count(isa: str, reg: str) -> int:
        text = subprocess.run(["objdump", "-d", cpu_kernel.load(isa).dll._name], capture_output=True, text=True,
                              check=True).stdout
        return text.count(reg)
    assert count("scalar", "%ymm") == count("scalar", "%zmm") == 0
    assert count("avx2", "%zmm") == 0


def test_isa_setting_is_validated_by_name(monkeypatch):
    assert cpu_kernel.kernel_isa({}) == "native"
    assert cpu_kernel.kernel_isa({"ZEROSPEED_KERNEL_ISA": "scalar"}) == "scalar"
    with pytest.raises(ValueError, match=r"ZEROSPEED_KERNEL_ISA: 'avx512' is not one of native, avx2, scalar"):
        cpu_kernel.kernel_isa({"ZEROSPEED_KERNEL_ISA": "avx512"})
    with pytest.raises(ValueError, match="ZEROSPEED_KERNEL_ISA: 'sse' is not one of"):
        cpu_kernel.load("sse")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with pytest.raises(ValueError, match=r"ZEROSPEED_KERNEL_ISA: 'avx2' applies to x86-64 CPUs only"):
        cpu_kernel.kernel_isa({"ZEROSPEED_KERNEL_ISA": "avx2"})
    flags = cpu_kernel.isa_flags("scalar")
    assert "-fno-tree-vectorize" in flags and not any(f.startswith("-march") for f in flags)


# ----------------------------------------------------------------------------- each kernel

@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 15, 24])
def test_skinny_gemm(kern, rows):
    """y = x W^T + b + r: |y - exact| <= (K + 2) u (|x| |W|^T + |b|) + 2 u |r| (+ u |y| for the last add)."""
    g = torch.Generator().manual_seed(rows)
    K, N = 72, 48
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g)
    x = torch.randn(rows, K, generator=g)
    res = torch.randn(rows, N, generator=g) * 10
    packed = cpu_kernel.pack_weight(w)
    exact = x.double() @ w.double().t()
    mag = x.double().abs() @ w.double().abs().t()
    _within(kern.skinny_linear(x, packed), exact, (K + 2) * U * mag, "x W^T")
    full = exact + b.double() + res.double()
    bound = (K + 2) * U * (mag + b.double().abs()) + 2 * U * res.double().abs() + U * full.abs()
    _within(kern.skinny_linear(x, packed, b, res), full, bound, "x W^T + b + r")


def test_rms_norm(kern):
    """y = w x / sqrt(mean(x^2) + eps): the n-term sum of squares (n u), the mean, sqrt and reciprocal (about half
    of the sum's relative error plus 3 u) and two products: |y - exact| <= (n / 2 + 8) u |y|."""
    g = torch.Generator().manual_seed(1)
    n = 40
    x = torch.randn(7, n, generator=g) * torch.logspace(-3, 3, 7).unsqueeze(1)
    w = torch.randn(n, generator=g)
    x64 = x.double()
    exact = w.double() * x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-5)
    _within(kern.rms_norm(x, w, 1e-5), exact, (n / 2 + 8) * U * exact.abs(), "rms_norm")


def test_silu_mul(kern):
    """out = silu(g) * up: exp by a polynomial (a few u), the sigmoid's add and division, two products: within
    16 u |out|; below -87 the kernel's exp stops at e^-87 (~1.6e-38 instead of a denormal or 0), an absolute
    error of at most e^-87 |g up| < 2e-38 |g up|."""
    gen = torch.Generator().manual_seed(5)
    inter = 40
    gu = torch.randn(9, 2 * inter, generator=gen) * 4
    gu[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -90.0])
    gate, up = gu[:, :inter].double(), gu[:, inter:].double()
    exact = gate * torch.sigmoid(gate) * up
    bound = 16 * U * exact.abs() + 2e-38 * (gate * up).abs()
    _within(kern.silu_mul(gu, inter), exact, bound, "silu_mul")


def _attention64(q, kc, vc, tables, lens, bs, scale, window, dot_terms):
    """Float64 decode attention, and the float32 bound of each output element: scores within
    delta = dot_terms u scale max_t sum|q k_t| + u max|s| (the dot products and the scaling); each weight
    exp(s_t - m) / sum then within rho = delta + (4 + max|s_t - m|) u relative (the subtraction, the
    polynomial exp), the normalisation doubling it; the weighted sum of n values adds (n + 2) u:
    |o_i - exact| <= 2 [(4 rho + 2 (n + 2) u) sum_t w_t |v_ti|] (a factor 2 to spare)."""
    B, hq, d = q.shape
    per = hq // kc.shape[1]
    out = torch.empty(B, hq, d, dtype=torch.float64)
    bound = torch.empty_like(out)
    for b in range(B):
        L = int(lens[b])
        start = max(0, L - window) if window else 0
        pos = torch.arange(start, L)
        slots = tables[b][pos // bs] * bs + pos % bs
        k, v = kc[slots].double(), vc[slots].double()
        for h in range(hq):
            kk, vv, qq = k[:, h // per], v[:, h // per], q[b, h].double()
            s = (kk @ qq) * scale
            w = torch.softmax(s, 0)
            out[b, h] = w @ vv
            delta = dot_terms * U * scale * float((kk.abs() @ qq.abs()).max()) + U * float(s.abs().max())
            rho = delta + (4 + float((s.max() - s).max())) * U
            n = len(pos)
            bound[b, h] = 2 * (4 * rho + 2 * (n + 2) * U) * (w @ vv.abs())
    return out, bound


def _paged(g, num_blocks, bs, hkv, d, lens):
    kc = torch.randn(num_blocks * bs, hkv, d, generator=g)
    vc = torch.randn(num_blocks * bs, hkv, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    per = -(-max(lens) // bs)
    tables = torch.stack([perm[i * per:(i + 1) * per] for i in range(len(lens))])
    return kc, vc, tables, torch.tensor(lens)


@pytest.mark.parametrize("hq,hkv,d,window", [(4, 2, 24, None), (4, 4, 16, None), (2, 1, 20, 5)])
def test_decode_attention(kern, hq, hkv, d, window):
    g = torch.Generator().manual_seed(hq * d)
    bs, lens = 4, [13, 1, 7, 16, 9]
    kc, vc, tables, lens_t = _paged(g, 24, bs, hkv, d, lens)
    q = torch.randn(len(lens), hq, d, generator=g) * 2
    want, bound = _attention64(q, kc, vc, tables, lens_t, bs, 0.4, window, d + 2)
    got = kern.decode_attention(q, kc, vc, tables, lens_t, bs, max(lens), 0.4, window)
    _within(got, want, bound, "decode attention")
    torch.set_num_threads(2)  # sequences split over POSIX threads: the same arithmetic per sequence
    assert torch.equal(kern.decode_attention(q, kc, vc, tables, lens_t, bs, max(lens), 0.4, window), got)


def _rotate64(x, cos, sin, rot):
    """HF's rotate-half on the first ``rot`` features, in float64, and the float32 bound of each element (two
    products and a sum: 3 u (|x c| + |x' s|))."""
    half = rot // 2
    x64 = x.double()
    xr = x64[..., :rot]
    other = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
    y = torch.cat((xr * cos + other * sin, x64[..., rot:]), dim=-1)
    b = torch.cat((3 * U * ((xr * cos).abs() + (other * sin).abs()), torch.zeros_like(x64[..., rot:])), dim=-1)
    return y, b


def test_attention_layer(kern):
    """Rotary of q and k, k and v written to the cache at their slots, decode attention of the first rows: the
    rotated q / k within the rotary bound, v copied exactly, the decodes within the attention bound (the
    rotation's rounding counted in the scores: d + 8 terms)."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, rot, bs = 4, 2, 16, 8, 4
    lens = [13, 6]  # two decodes (their new token included), then a 3-token prompt chunk
    kc, vc, tables, lens_t = _paged(g, 24, bs, hkv, d, lens)
    T = 5
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g)
    positions = torch.tensor([12, 5, 0, 1, 2])
    emb = positions.double().unsqueeze(1) * torch.rand(rot // 2, generator=g).double()
    emb = torch.cat((emb, emb), dim=-1)
    cos, sin = emb.cos().float(), emb.sin().float()
    slots = torch.cat([tables[0, 12 // bs:12 // bs + 1] * bs + 12 % bs, tables[1, 5 // bs:5 // bs + 1] * bs + 5 % bs,
                       torch.tensor([23 * bs, 23 * bs + 1, 23 * bs + 2])])
    k_cache, v_cache = kc.clone(), vc.clone()
    out, q_out, k_out = kern.attention_layer(qkv, 2, hq, hkv, d, cos, sin, slots, k_cache, v_cache, tables, lens_t,
                                             bs, max(lens), 0.3, None, want_k=True)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    c64, s64 = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    q_want, q_bound = _rotate64(q.view(T, hq, d), c64, s64, rot)
    k_want, k_bound = _rotate64(k.view(T, hkv, d), c64, s64, rot)
    _within(q_out, q_want, q_bound, "rotated q")
    _within(k_out, k_want, k_bound, "rotated k")
    _within(k_cache[slots], k_want, k_bound, "k written to the cache")
    assert torch.equal(v_cache[slots], v.view(T, hkv, d))
    kc_ref, vc_ref = kc.double().clone(), vc.double().clone()
    kc_ref[slots], vc_ref[slots] = k_want, v.view(T, hkv, d).double()
    want, bound = _attention64(q_want[:2], kc_ref, vc_ref, tables, lens_t, bs, 0.3, None, d + 8)
    _within(out[:2], want, bound, "decode attention after the glue")


def test_int8_rows_equal_the_torch_twin(kern):
    """The int8 head's activation side: the int8 rows and scales exactly (the same correctly rounded float32
    division and round-half-even), the bounds to float64 summation order then one float32 rounding up (2 ulps)."""
    g = torch.Generator().manual_seed(4)
    h = torch.randn(6, 64, generator=g) * torch.logspace(-3, 3, 6).unsqueeze(1)
    h[0] = 0
    h[3, 5] = 1e3
    consts = (1e-3, 1e-2, 2.0, 0.3)
    for rows in (h, h[1:2]):
        p_c, a_c, e_c = kern.int8_rows(rows.contiguous(), consts)
        p_t, a_t, e_t = greedy_head.activation_rows(rows, consts)
        assert torch.equal(p_c, p_t) and torch.equal(a_c, a_t)
        torch.testing.assert_close(e_c, e_t, rtol=2 * 2.0 ** -23, atol=0)
        assert bool((e_c.double() >= e_t.double() * (1 - 2.0 ** -22)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_refine_equals_the_torch_twin(kern, dtype):
    """Approximate logits within err of the exact ones, the true best pushed to the edge of the bound: the C
    selection and greedy_head.refine_torch both give the exact argmax (the rows' best exact logit leads the next
    by more than the float32 rounding of a 48-term dot product), and the same rows exceed a cap of 1."""
    g = torch.Generator().manual_seed(2)
    V, H, R = 5000, 48, 12
    w = torch.randn(V, H, generator=g)
    h = torch.randn(R, H, generator=g)
    exact = h.double() @ w.double().t()
    top2 = exact.topk(2, dim=1).values
    mag = (h.double().abs() @ w.double().abs().t()).max(dim=1).values
    keep = (top2[:, 0] - top2[:, 1]) > 4 * (H + 2) * U * mag  # rows whose argmax float32 cannot flip
    best = exact.argmax(dim=1)
    err = (exact.abs().amax(dim=1) * torch.logspace(-4, -1, R, dtype=torch.float64)).float()
    approx = exact.float() + err.unsqueeze(1) * (2 * torch.rand(R, V, generator=g) - 1) * 0.999
    approx[torch.arange(R), best] = exact[torch.arange(R), best].float() - err * 0.999
    if dtype == torch.bfloat16:
        approx = approx.to(torch.bfloat16)
        err = err + approx.float().abs().amax(dim=1) * 2.0 ** -8  # bfloat16 rounding of the approximate logits
    c = kern.greedy_refine(approx, h, w, err, 4000)
    t = greedy_head.refine_torch(approx, h, w, err, 4000)
    assert torch.equal(c[keep], t[keep]) and torch.equal(c[keep], best[keep]) and int(keep.sum()) >= R // 2
    capped_c = kern.greedy_refine(approx, h, w, err, 1)
    capped_t = greedy_head.refine_torch(approx, h, w, err, 1)
    assert torch.equal(capped_c == -1, capped_t == -1) and int((capped_c == -1).sum()) > 0
    assert F.linear(h, w).shape == (R, V)
