"""The ``packed_linear`` fast path (issue #31): float32 linears and the LM head through oneDNN on weights packed once
(zerospeed.ops.packed_linear), against their plain twins (``F.linear`` / MKL).

Tolerances come from the arithmetic, not from this CPU: both paths compute the same float32 products and sum them
in different orders, so each output is within ``gamma_K * sum_k |x_k w_k|`` (``gamma_K = K u / (1 - K u)``,
``u = 2^-24``) of the exact value, and the two paths within twice that of each other (``packed_linear.fp32_bound``
per element). Through a whole model the difference is that rounding propagated, like any change of GEMM blocking:
prompt logprobs are compared with HF's ``log_softmax`` at the 1e-4 the other logprob tests use (about 100 ulps of
logits of O(10); see test_serve_prompt_logprobs.py), and greedy tokens with HF's where HF's choice is decided by
more than that (hf_greedy_decided). Nothing here times anything: ``auto``'s dispatch is driven by a fake chooser.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference_cases import hf_greedy_decided, make_model, prompts, save_model
from zerospeed.inference import SamplingParams, build_engine, fast_path_choice
from zerospeed.ops import fast_paths, packed_linear
from zerospeed.ops.fast_paths import ENV_VAR, FastPathError

pytestmark = pytest.mark.numeric
AVAILABLE, WHY = packed_linear.available()
needs_onednn = pytest.mark.skipif(not AVAILABLE, reason=f"oneDNN's float32 linear does not run here: {WHY}")
LOGPROB_ATOL = 1e-4


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@needs_onednn
@pytest.mark.parametrize("rows,k,n", [(1, 64, 48), (7, 96, 33), (300, 256, 512), (64, 1000, 17)])
def test_packed_linear_equals_f_linear_within_float32_bound(rows, k, n):
    g = torch.Generator().manual_seed(rows * 7 + k)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    r = torch.randn(rows, n, generator=g)
    p = packed_linear.pack(w)
    exact = x.double() @ w.double().t()
    bound = packed_linear.fp32_bound(x, w)
    for got, want, extra in ((packed_linear.linear(x, p), F.linear(x, w), 0.0),
                             (packed_linear.linear(x, p, b), F.linear(x, w, b), b.double().abs()),
                             (packed_linear.linear(x, p, b, r), r + F.linear(x, w, b), (r + b).double().abs())):
        # each path: the products' bound, plus one rounding of each addition (bias, residual) at the result's scale
        own = bound + (exact.abs() + bound + extra) * 2 * 2.0 ** -24
        assert got.shape == want.shape and got.dtype == torch.float32
        assert bool(((got.double() - want.double()).abs() <= 2 * own).all())
    # a non-contiguous input (a column slice) gives the same values as its contiguous copy
    wide = torch.randn(rows, 2 * k, generator=g)
    assert torch.equal(packed_linear.linear(wide[:, :k], p), packed_linear.linear(wide[:, :k].contiguous(), p))


def test_probe_refuses_an_op_that_is_not_float32(monkeypatch):
    """A oneDNN that computes in a lower precision (bfloat16 rounding of the inputs) fails the probe, with why."""
    real = packed_linear.linear

    def bf16_like(x, packed, bias=None, residual=None):
        return real(x.bfloat16().float(), packed, bias, residual)
    packed_linear.available.cache_clear()
    monkeypatch.setattr(packed_linear, "linear", bf16_like)
    try:
        ok, why = packed_linear.available()
        assert not ok and "not float32" in why
    finally:
        packed_linear.available.cache_clear()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    model = make_model("llama", seed=11)
    path = save_model(model, str(tmp_path_factory.mktemp("packed_llama")))
    return model, path


def _generate_and_score(engine, ps, new):
    """Greedy tokens and prompt logprobs of each prompt."""
    params = SamplingParams(max_new_tokens=new, ignore_eos=True, prompt_logprobs=0)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, params)
    toks = {f"r{i}": [] for i in range(len(ps))}
    lps = {}
    while engine.has_unfinished():
        for o in engine.step():
            toks[o.request_id] += o.new_token_ids
            if o.prompt_logprobs is not None:
                lps[o.request_id] = o.prompt_logprobs
    return [toks[f"r{i}"] for i in range(len(ps))], [lps[f"r{i}"] for i in range(len(ps))]


@needs_onednn
@pytest.mark.parametrize("setting", ["on", "off"])
def test_engine_packed_and_plain_match_hf(llama, setting, monkeypatch):
    """With packed_linear on (every linear and the LM head through oneDNN: counted) and off (never), a chunked
    prompt's logprobs equal HF's log_softmax within LOGPROB_ATOL and decided greedy tokens equal HF's."""
    model, path = llama
    calls = []
    real = packed_linear.linear
    monkeypatch.setattr(packed_linear, "linear", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    ps = prompts([40, 9, 23], seed=3)
    engine = build_engine(path, block_size=4, num_blocks=128, max_num_batched_tokens=16, packed_linear=setting)
    toks, lps = _generate_and_score(engine, ps, 6)
    linears = {tuple(lin.weight.shape) for blk in engine.model.layers
               for lin in (blk.attn.qkv, blk.attn.o, blk.mlp.gate_up, blk.mlp.down)}
    head = tuple(engine.model.lm_head.weight.shape)
    if setting == "on":
        assert linears | {head} <= {tuple(s) for s in calls}
        assert "packed_linear=on (oneDNN)" in engine.fast_path_report
    else:
        assert calls == []
    for p, got_toks, got_lps in zip(ps, toks, lps):
        with torch.no_grad():
            ref = model(torch.tensor([p])).logits[0].float().log_softmax(-1)
        want = ref[:-1].gather(1, torch.tensor(p[1:])[:, None])[:, 0]
        assert got_lps[0] is None and len(got_lps) == len(p)
        assert torch.allclose(torch.tensor(got_lps[1:], dtype=torch.float32), want, atol=LOGPROB_ATOL, rtol=0)
        hf_toks, decided = hf_greedy_decided(model, p, 6)
        assert got_toks[:decided] == hf_toks[:decided]


@needs_onednn
def test_weights_changed_in_place_are_repacked(llama):
    """A weight updated in place (a trainer's weight sync) is repacked before its next use: the packed head's
    logits follow the new weight."""
    _, path = llama
    engine = build_engine(path, block_size=4, num_blocks=64, packed_linear="on")
    m = engine.model
    h = torch.randn(5, m.lm_head.weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = m.compute_logits(h)
        m.lm_head.weight.mul_(2.0)
        after = m.compute_logits(h)
    bound = 2 * packed_linear.fp32_bound(h, m.lm_head.weight) + before.double().abs() * 2.0 ** -23
    assert bool(((after.double() - 2 * before.double()).abs() <= 2 * bound).all())


class Fake:
    """Replaces fast_path_choice.choice: packed_linear answers from ``packed`` by the key's kind ("block" linears,
    "lm_head"), everything else takes its plain candidate; records packed_linear's keys and candidates."""

    def __init__(self, packed):
        self.packed, self.keys = packed, []

    def __call__(self, path, shape_class, candidates, setting, source):
        if path != "packed_linear":
            return fast_paths.Choice(path, shape_class, next(iter(candidates)), setting, "fake")
        self.keys.append(shape_class)
        assert list(candidates) == ["off", "on"]  # the plain path is the incumbent
        for c in candidates.values():
            c.run()  # each candidate runs on the shapes it is measured on
        return fast_paths.Choice(path, shape_class, self.packed[shape_class[0]], setting, "fake")


@needs_onednn
@pytest.mark.parametrize("block,head", [("on", "off"), ("off", "on")])
def test_auto_follows_the_chooser_per_shape_class(llama, monkeypatch, block, head):
    _, path = llama
    fake = Fake({"block": block, "lm_head": head})
    monkeypatch.setattr(fast_path_choice, "choice", fake)
    engine = build_engine(path, block_size=4, num_blocks=96, max_num_batched_tokens=16, cpu_kernels="off")
    plan = engine.planner.plan(16, 0, 0)
    shapes = {tuple(lin.weight.shape) for lin in (engine.model.layers[0].attn.qkv, engine.model.layers[0].mlp.down)}
    assert (shapes <= plan.packed) == (block == "on") and bool(plan.packed) == (block == "on")
    assert engine.model._packed_head(37) == (head == "on")
    n = len(fake.keys)
    assert engine.planner.plan(9, 0, 0) is plan and engine.model._packed_head(64) == (head == "on")
    assert len(fake.keys) == n  # same classes: cached, nothing asked again
    assert ("lm_head", 64, *engine.model.lm_head.weight.shape, 1) in fake.keys
    assert any(k[:2] == ("block", 16) for k in fake.keys)


def test_switch_values_and_forced_candidates_that_cannot_run(llama, monkeypatch):
    _, path = llama
    with pytest.raises(FastPathError, match="packed_linear: 'fast' is not one of auto, off, on"):
        build_engine(path, packed_linear="fast")
    monkeypatch.setattr(packed_linear, "available", lambda: (False, "no oneDNN in this build"))
    with pytest.raises(FastPathError, match="packed_linear: 'on' but oneDNN's packed float32 linear cannot run "
                                            "here: no oneDNN in this build"):
        build_engine(path, block_size=4, num_blocks=64, packed_linear="on")
    # auto where it cannot run: the plain path, said so in the report
    engine = build_engine(path, block_size=4, num_blocks=64)
    assert "packed_linear=auto (not used: no oneDNN in this build)" in engine.fast_path_report
    assert not engine.model._packed_head(8)


def test_bf16_model_refuses_on_and_env_sets_auto(llama, monkeypatch):
    _, path = llama
    with pytest.raises(FastPathError, match=r"packed_linear: 'on' needs float32 on CPU \(bfloat16 on cpu\)"):
        build_engine(path, dtype="bf16", block_size=4, num_blocks=64, packed_linear="on")
    monkeypatch.setenv(ENV_VAR, "packed_linear=off")
    engine = build_engine(path, block_size=4, num_blocks=64)
    assert "packed_linear=off (not used: packed_linear=off)" in engine.fast_path_report
    assert not engine.model._packed_head(64) and not engine.planner.plan(16, 0, 0).packed


def test_serve_flag(llama):
    from zerospeed.inference.serving import cli
    from zerospeed.inference.serving.server import ENGINE_KEYS

    _, path = llama
    args = cli.build_parser().parse_args([path, "--packed-linear", "off"])
    assert cli.engine_kwargs(args) == {"packed_linear": "off"}
    assert "packed_linear" not in cli.engine_kwargs(cli.build_parser().parse_args([path]))
    with pytest.raises(cli._UsageError, match=r"--packed-linear: invalid choice: 'yes'"):
        cli.build_parser().parse_args([path, "--packed-linear", "yes"])
    assert "packed_linear" in ENGINE_KEYS and fast_paths.PATHS["packed_linear"] == ("auto", "off", "on")
