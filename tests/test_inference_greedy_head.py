"""The int8 greedy LM head (models/greedy_head.py): its error bound holds, the candidates it keeps
always contain the float32 argmax (near-ties, exact ties, all-negative logits, outlier rows and
features, one row, flat rows that fall back to the full logits), the C selection equals its
pure-torch twin, and the engine gives HF's tokens through it. Values only, no timing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference_cases import hf_greedy, make_model, prompts, save_model
from zerospeed.inference import SamplingParams, build_engine, cpu_kernel
from zerospeed.inference.models import greedy_head, layers

INT8 = greedy_head.int8_matmul_available()
#: the int8 head can be built: besides the CPU's AMX or VNNI (INT8), oneDNN's int8 linear must give the integer
#: product on build_int8_head's own probe. It does not under ONEDNN_MAX_CPU_ISA=AVX2 or lower (make test-isa):
#: without VNNI oneDNN's s8 kernels saturate int16 pair sums, build_int8_head returns None and the engine keeps
#: the float32 head.
INT8_HEAD = INT8 and greedy_head.build_int8_head(
    torch.randn(64, 32, generator=torch.Generator().manual_seed(0))) is not None
needs_int8 = pytest.mark.skipif(not INT8_HEAD, reason="this CPU / torch has no exact oneDNN int8 matmul (AMX or VNNI)")
needs_c = pytest.mark.skipif(not cpu_kernel.available()[0], reason="no C compiler for the CPU kernels")


def _head(w, mode="int8"):
    model = layers.CausalLM()
    model.lm_head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        model.lm_head.weight.copy_(w)
    model.greedy_approx = mode
    return model


def _weights_and_rows(seed=0, V=3000, H=64):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g) * 0.05
    w[11] = w[7]  # an exact tie: the lower id wins
    w[500] = w[400] * (1 + 1e-6)  # far closer than int8 can tell apart
    w[900] = w[800] + 1e-5 * torch.randn(H, generator=g)
    w[42] *= 4  # an outlier row (its own large scale)
    w[1000:1064] = w[800] + 2e-3 * torch.randn(64, H, generator=g)  # a cluster of near-ties
    h = torch.randn(40, H, generator=g) * torch.logspace(-3, 3, 40).unsqueeze(1)
    h[3, 5] = 1e3  # an outlier feature: coarse activation scale for that row
    h[0], h[1], h[2], h[4] = w[7] * 10, w[400] * 10, -w[400] * 10, w[800] * 10
    h[20:40] = w[800] * 100 + 5 * torch.randn(20, H, generator=g)  # rows whose best is in the cluster
    return w, h


@needs_int8
def test_the_near_ties_defeat_the_approximation_alone():
    """The test data is hard: the int8 logits' own argmax is wrong on several rows (so the
    refinement is what makes the tokens exact)."""
    w, h = _weights_and_rows()
    approx, _ = greedy_head.approx_logits(greedy_head.build_int8_head(w), h)
    assert int((approx.argmax(dim=1) != F.linear(h, w).max(dim=1).indices).sum()) >= 3


@needs_int8
def test_error_bound_holds_and_is_tight_enough():
    """|A_j - h.w_j / a| <= err for every token of every row (computed in float64), and the bound
    keeps few candidates on a random head."""
    w, h = _weights_and_rows()
    head = greedy_head.build_int8_head(w)
    assert head is not None
    approx, err = greedy_head.approx_logits(head, h)
    a = h.abs().amax(dim=1).double() / 127
    a = torch.where(a > 0, a, torch.ones_like(a)).float().double()  # the float32 scale actually used
    exact = (h.double() @ w.double().t()) / a.unsqueeze(1)
    gap = (approx.double() - exact).abs().amax(dim=1)
    assert bool((gap <= err.double()).all())
    assert bool((gap > err.double() / 1000).all())  # the bound is not vacuous
    # on a plain random head (no outlier row: the bound is uniform over the vocabulary, so one row
    # with 4x the scale widens it for all), it keeps few candidates
    g = torch.Generator().manual_seed(3)
    w, h = torch.randn(3000, 64, generator=g) * 0.05, torch.randn(40, 64, generator=g)
    approx, err = greedy_head.approx_logits(greedy_head.build_int8_head(w), h)
    counts = (approx >= (approx.amax(dim=1) - 2 * err).unsqueeze(1)).sum(dim=1)
    assert int(counts.median()) < 100


@needs_int8
@pytest.mark.parametrize("refine", ["c", "torch"])
def test_int8_head_equals_float32_argmax_on_near_ties(refine, monkeypatch):
    if refine == "c" and not cpu_kernel.available()[0]:
        pytest.skip("no C compiler for the CPU kernels")
    if refine == "torch":  # as on a machine without a C compiler
        monkeypatch.setattr(cpu_kernel, "available", lambda: (False, "disabled by the test"))
    w, h = _weights_and_rows()
    model = _head(w)
    got = model.greedy_tokens(h)
    want = F.linear(h, w).max(dim=1).indices
    assert torch.equal(got, want)
    assert got[0].item() == 7 and got[1].item() == 500
    assert torch.equal(model.greedy_tokens(h[:1]), want[:1])  # one row (sent twice to oneDNN)
    neg = _head(-w.abs())  # every logit negative
    hp = h.abs()
    assert torch.equal(neg.greedy_tokens(hp), F.linear(hp, -w.abs()).max(dim=1).indices)
    V, H = w.shape
    g = torch.Generator().manual_seed(1)
    flat_w = torch.ones(V, H) + torch.randn(V, H, generator=g) * 1e-7  # thousands of candidates
    assert layers.GREEDY_MAX_CANDIDATES < V
    hf = torch.randn(8, H, generator=g)
    assert torch.equal(_head(flat_w).greedy_tokens(hf), F.linear(hf, flat_w).max(dim=1).indices)
    zero = torch.zeros(2, H)  # all logits 0: token 0, as argmax
    assert _head(w).greedy_tokens(zero).tolist() == [0, 0]


@needs_c
def test_c_selection_equals_torch_twin_at_the_bound():
    """Synthetic approximate logits pushed to the edge of the bound (exact/a -+ err, adversarially
    against the true best token): the C selection and refine_torch give the float32 argmax, and
    both give -1 where the candidates exceed the cap."""
    g = torch.Generator().manual_seed(2)
    V, H, R = 5000, 48, 16
    w = torch.randn(V, H, generator=g)
    h = torch.randn(R, H, generator=g)
    exact = F.linear(h, w)
    best = exact.max(dim=1).indices
    err = exact.abs().amax(dim=1) * torch.logspace(-4, -1, R)
    approx = exact + err.unsqueeze(1) * (2 * torch.rand(R, V, generator=g) - 1) * 0.999
    approx[torch.arange(R), best] = exact[torch.arange(R), best] - err * 0.999  # true best pushed down
    c = cpu_kernel.greedy_refine(approx, h, w, err, 4000)
    t = greedy_head.refine_torch(approx, h, w, err, 4000)
    assert torch.equal(c, t) and torch.equal(c, best)
    assert cpu_kernel.greedy_refine(approx, h, w, err, 1).tolist().count(-1) == \
        greedy_head.refine_torch(approx, h, w, err, 1).tolist().count(-1) > 0


def test_greedy_approx_must_be_known():
    model = _head(torch.randn(50, 8), mode="int4")
    with pytest.raises(ValueError, match="greedy_approx: 'int4' is not one of"):
        model.greedy_tokens(torch.randn(2, 8))


@pytest.mark.parametrize("mode", ["int8", "bf16", "off"])
def test_engine_tokens_equal_hf_through_each_head(tmp_path, mode):
    """A batch of greedy requests with each approximate head (where the hardware has it) gives HF's
    tokens; with "int8" on an int8-capable CPU the int8 head is the one used."""
    model = make_model("llama", seed=4)
    path = save_model(model, str(tmp_path / "m"))
    ps = prompts([4 + 5 * i for i in range(8)], seed=11)
    ref = [hf_greedy(model, p, 8) for p in ps]
    if mode == "int8" and not INT8:  # forced where it cannot run: an error naming the switch
        with pytest.raises(ValueError, match="greedy_head: 'int8' cannot run on this machine"):
            build_engine(path, block_size=4, num_blocks=96, greedy_head=mode)
        return
    engine = build_engine(path, block_size=4, num_blocks=96, max_num_batched_tokens=128,
                          greedy_head={"off": "float32"}.get(mode, mode))
    assert engine.generate(ps, SamplingParams(max_new_tokens=8, ignore_eos=True)) == ref
    built = "_lm_head_int8" in engine.model.__dict__
    assert built == (mode == "int8" and INT8)


@needs_int8
@needs_c
def test_c_activation_side_equals_torch():
    """cpu_kernel.int8_rows (one C pass) gives the torch code's int8 rows, scales and bounds: the same
    approximate logits, bounds within float64 rounding, on every kind of row (zero, one, outliers)."""
    w, h = _weights_and_rows()
    h = torch.cat([h, torch.zeros(1, h.shape[1])])
    head = greedy_head.build_int8_head(w)
    for rows in (h, h[:1]):
        a_t, e_t = greedy_head.approx_logits(head, rows)
        a_c, e_c = greedy_head.approx_logits(head, rows, use_c=True)
        assert torch.equal(a_c, a_t)
        torch.testing.assert_close(e_c, e_t, rtol=1e-6, atol=0)
