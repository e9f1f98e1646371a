"""Optimizer factory (DeepSpeed names -> torch classes) and the Lamb optimizer."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from zerospeed.config.errors import ConfigError
from zerospeed.ops import Lamb, build_optimizer, resolve_client_optimizer
from zerospeed.ops.adam.kernel_choice import switch_of


def params(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]


# ----------------------------------------------------------------------------- Lamb reference


def reference_lamb_step(ps, grads, states, *, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                        bias_correction=True, eps_inside_sqrt=False, min_coeff=0.01, max_coeff=10.0):  # fmt: skip
    """DeepSpeed FusedLamb's per-tensor update, one tensor at a time, in plain tensor maths."""
    beta1, beta2 = betas
    ratios = []
    for p, g, st in zip(ps, grads, states):
        st["step"] += 1
        st["m"] = beta1 * st["m"] + (1 - beta1) * g
        st["v"] = beta2 * st["v"] + (1 - beta2) * g * g
        bc1 = 1 - beta1 ** st["step"] if bias_correction else 1.0
        bc2 = 1 - beta2 ** st["step"] if bias_correction else 1.0
        m_hat, v_hat = st["m"] / bc1, st["v"] / bc2
        denom = torch.sqrt(v_hat + eps) if eps_inside_sqrt else torch.sqrt(v_hat) + eps
        update = m_hat / denom + weight_decay * p
        w_norm, u_norm = p.norm().item(), update.norm().item()
        ratio = 1.0 if w_norm == 0 or u_norm == 0 else min(max(w_norm / u_norm, min_coeff), max_coeff)
        p -= lr * ratio * update
        ratios.append(ratio)
    return ratios


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"weight_decay": 0.01},
        {"weight_decay": 0.1, "bias_correction": False},
        {"eps_inside_sqrt": True, "betas": (0.8, 0.99), "eps": 1e-6},
    ],
)
def test_lamb_matches_per_tensor_reference(options):
    ours = params((5, 3), (7,), (2, 2, 2), dtype=torch.float64)
    ref = [p.detach().clone() for p in ours]
    ref_states = [{"step": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)} for p in ref]
    opt = Lamb([{"params": ours[:2]}, {"params": ours[2:], "lr": 0.02}], lr=0.01, **options)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):  # several steps: moments and bias correction carry over
        grads = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in ours]
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        opt.step()
        ratios = reference_lamb_step(ref[:2], grads[:2], ref_states[:2], lr=0.01, **options)
        ratios += reference_lamb_step(ref[2:], grads[2:], ref_states[2:], lr=0.02, **options)
        assert opt.get_lamb_coeffs() == pytest.approx(ratios, rel=1e-12)
        for p, r in zip(ours, ref):
            torch.testing.assert_close(p.detach(), r, rtol=1e-12, atol=1e-14)
    for p, st in zip(ours, ref_states):
        assert opt.state[p]["step"] == st["step"] == 3
        torch.testing.assert_close(opt.state[p]["exp_avg"], st["m"], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], st["v"], rtol=1e-12, atol=1e-14)


def test_lamb_trust_ratio_clamped_to_max_and_min():
    big = torch.full((4,), 1000.0, requires_grad=True)  # ||w|| = 2000
    small = torch.full((4,), 1e-4, requires_grad=True)  # ||w|| = 2e-4
    opt = Lamb([big, small], lr=0.1)
    big.grad = torch.ones(4)
    small.grad = torch.ones(4)
    opt.step()
    # step 1 with bias correction: update = g / (|g| + eps) = 1/(1+1e-8) per element, ||u|| ~ 2
    assert opt.get_lamb_coeffs() == pytest.approx([10.0, 0.01])  # 1000 -> max_coeff, 1e-4 -> min_coeff
    torch.testing.assert_close(big.detach(), torch.full((4,), 1000.0 - 0.1 * 10.0 * 1 / (1 + 1e-8)))
    torch.testing.assert_close(small.detach(), torch.full((4,), 1e-4 - 0.1 * 0.01 * 1 / (1 + 1e-8)))


def test_lamb_custom_coefficient_bounds():
    w = torch.full((4,), 1000.0, requires_grad=True)
    w.grad = torch.ones(4)
    opt = Lamb([w], lr=0.1, max_coeff=3.0, min_coeff=0.5)
    opt.step()
    assert opt.get_lamb_coeffs() == pytest.approx([3.0])


def test_lamb_zero_norms_use_ratio_one():
    zero_w = torch.zeros(3, requires_grad=True)  # ||w|| = 0
    zero_g = torch.full((3,), 2.0, requires_grad=True)  # gradient 0 -> ||update|| = 0
    opt = Lamb([zero_w, zero_g], lr=0.1)
    zero_w.grad = torch.tensor([1.0, -1.0, 1.0])
    zero_g.grad = torch.zeros(3)
    opt.step()
    assert opt.get_lamb_coeffs() == [1.0, 1.0]
    torch.testing.assert_close(zero_w.detach(), -0.1 * 1.0 * torch.tensor([1.0, -1.0, 1.0]) / (1 + 1e-8))
    torch.testing.assert_close(zero_g.detach(), torch.full((3,), 2.0))


def test_lamb_max_grad_norm_scales_gradients():
    w = torch.ones(4, requires_grad=True)
    w.grad = torch.full((4,), 3.0)  # ||g|| = 6
    opt = Lamb([w], lr=0.1, max_grad_norm=2.0)
    opt.step()
    clip = (6.0 + 1e-6) / 2.0  # FusedLamb: divide by (norm + 1e-6) / max_grad_norm when > 1
    torch.testing.assert_close(opt.state[w]["exp_avg"], torch.full((4,), (1 - 0.9) * 3.0 / clip))


def test_lamb_mixed_dtypes_keep_param_order():
    a, b, c = torch.ones(3, requires_grad=True), torch.ones(3, dtype=torch.float64, requires_grad=True), torch.full(
        (3,), 100.0, requires_grad=True
    )
    for p in (a, b, c):
        p.grad = torch.ones_like(p)
    opt = Lamb([a, b, c], lr=0.1)
    opt.step()
    # update ~ 1 per element: ratio = ||w|| / ||u|| = 1 for a and b, 100 -> 10 (clamped) for c
    assert opt.get_lamb_coeffs() == pytest.approx([1.0, 1.0, 10.0])
    assert b.dtype == torch.float64 and opt.state[b]["exp_avg"].dtype == torch.float64


def test_lamb_half_precision_norms_do_not_overflow():
    w = torch.full((1000,), 300.0, dtype=torch.float16, requires_grad=True)  # sum of squares 9e7 > fp16 max
    w.grad = torch.ones_like(w)
    opt = Lamb([w], lr=0.01)
    opt.step()
    # ||w|| = 300 * sqrt(1000), ||u|| ~ sqrt(1000): ratio 300, clamped to max_coeff
    assert opt.get_lamb_coeffs() == pytest.approx([10.0])
    assert torch.isfinite(w).all()


def test_lamb_state_dict_round_trip():
    def make():
        ps = params((3, 2), (4,))
        return ps, Lamb(ps, lr=0.01, weight_decay=0.01)

    ps_a, a = make()
    for p in ps_a:
        p.grad = torch.ones_like(p)
    a.step()
    state = copy.deepcopy(a.state_dict())  # as a checkpoint would; state_dict() shares tensors
    assert set(state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}  # FusedLamb's keys

    ps_b, b = make()
    with torch.no_grad():
        for pa, pb in zip(ps_a, ps_b):
            pb.copy_(pa)
    b.load_state_dict(state)
    for ps, opt in ((ps_a, a), (ps_b, b)):
        for p in ps:
            p.grad = torch.full_like(p, 0.5)
        opt.step()
    for pa, pb in zip(ps_a, ps_b):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


def test_lamb_closure_skips_params_without_grad_and_rejects_bad_input():
    w, unused = params((2,), (2,))
    opt = Lamb([w, unused])
    before = unused.detach().clone()

    def closure():
        opt.zero_grad()
        loss = (w * w).sum()
        loss.backward()
        return loss

    assert opt.step(closure) is not None
    assert torch.equal(unused.detach(), before) and unused not in opt.state
    with pytest.raises(ValueError, match="AMSGrad"):
        Lamb([w], amsgrad=True)
    with pytest.raises(ValueError, match="min_coeff"):
        Lamb([w], min_coeff=2.0, max_coeff=1.0)
    emb = torch.nn.Embedding(4, 2, sparse=True)
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        Lamb(emb.parameters()).step()


# ----------------------------------------------------------------------------- factory mapping


def test_adam_means_adamw_by_default_with_deepspeed_defaults():
    opt = build_optimizer("Adam", {}, params((2,)))
    assert type(opt) is torch.optim.AdamW  # ADAM_W_MODE_DEFAULT = True in DeepSpeed
    d = opt.defaults
    assert (d["lr"], d["betas"], d["eps"], d["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 0.0)
    assert d["fused"] is None and switch_of(opt).setting == "auto"  # adam_kernel: timed at the first step


def test_adam_w_mode_false_gives_coupled_adam():
    opt = build_optimizer("Adam", {"adam_w_mode": False, "lr": 0.1, "weight_decay": 0.1, "betas": [0.8, 0.9],
                                   "eps": 1e-6, "amsgrad": True}, params((2,)))  # fmt: skip
    assert type(opt) is torch.optim.Adam
    d = opt.defaults
    assert (d["lr"], d["betas"], d["eps"], d["weight_decay"], d["amsgrad"]) == (0.1, (0.8, 0.9), 1e-6, 0.1, True)


def test_adamw_stays_decoupled_even_with_adam_w_mode_false():
    # DeepSpeed: effective_adam_w_mode = name == "adamw" or adam_w_mode
    assert type(build_optimizer("AdamW", {"adam_w_mode": False}, params((2,)))) is torch.optim.AdamW


def test_torch_adam_uses_torch_defaults():
    opt = build_optimizer("AdamW", {"torch_adam": True}, params((2,)))
    assert type(opt) is torch.optim.AdamW
    assert opt.defaults["weight_decay"] == 0.01  # torch.optim.AdamW's default, as DeepSpeed would get


def test_adam_vs_adamw_weight_decay_numerics():
    # zero gradient, weight 1, lr 0.1, weight_decay 0.1
    def one_step(type_name, extra):
        w = torch.ones(1, requires_grad=True)
        opt = build_optimizer(type_name, {"lr": 0.1, "weight_decay": 0.1, **extra}, [w])
        w.grad = torch.zeros(1)
        opt.step()
        return w.item()

    # decoupled: w <- w * (1 - lr * wd); the Adam part sees g = 0 -> no move
    assert one_step("Adam", {}) == pytest.approx(1.0 * (1 - 0.1 * 0.1), rel=1e-6)
    assert one_step("AdamW", {}) == pytest.approx(1.0 * (1 - 0.1 * 0.1), rel=1e-6)
    # coupled (L2): g = wd * w = 0.1; first Adam step moves by lr * g / (|g| + eps)
    assert one_step("Adam", {"adam_w_mode": False}) == pytest.approx(1.0 - 0.1 * 0.1 / (0.1 + 1e-8), rel=1e-6)


def test_sgd_mapping():
    opt = build_optimizer("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "dampening": 0.0,
                                  "weight_decay": 1e-4}, params((2,)))  # fmt: skip
    assert type(opt) is torch.optim.SGD
    d = opt.defaults
    assert (d["lr"], d["momentum"], d["nesterov"], d["dampening"], d["weight_decay"]) == (0.1, 0.9, True, 0.0, 1e-4)
    assert d["fused"] is True


def test_adagrad_mapping():
    opt = build_optimizer("ADAGRAD", {"lr": 0.05, "eps": 1e-9, "weight_decay": 0.01, "lr_decay": 0.001},
                          params((2,)))  # fmt: skip
    assert type(opt) is torch.optim.Adagrad
    d = opt.defaults
    assert (d["lr"], d["eps"], d["weight_decay"], d["lr_decay"]) == (0.05, 1e-9, 0.01, 0.001)


def test_lamb_mapping():
    opt = build_optimizer("LAMB", {"lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.01,
                                   "bias_correction": False, "max_coeff": 5.0, "min_coeff": 0.1,
                                   "eps_inside_sqrt": True}, params((2,)))  # fmt: skip
    assert type(opt) is Lamb
    d = opt.defaults
    assert (d["lr"], d["betas"], d["eps"], d["weight_decay"]) == (0.01, (0.8, 0.99), 1e-6, 0.01)
    assert (d["bias_correction"], d["max_coeff"], d["min_coeff"], d["eps_inside_sqrt"]) == (False, 5.0, 0.1, True)
    lamb_defaults = build_optimizer("Lamb", {}, params((2,))).defaults
    assert (lamb_defaults["max_coeff"], lamb_defaults["min_coeff"], lamb_defaults["max_grad_norm"]) == (10.0, 0.01, 0.0)


def test_param_group_forms():
    model = torch.nn.Linear(3, 2)
    opt = build_optimizer("AdamW", {"lr": 0.1, "weight_decay": 0.1},
                          [{"params": [model.weight]}, {"params": (p for p in [model.bias]), "weight_decay": 0.0}])  # fmt: skip
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert opt.param_groups[1]["params"] == [model.bias]
    gen_opt = build_optimizer("SGD", {"lr": 0.1}, model.parameters())  # a generator
    assert len(gen_opt.param_groups[0]["params"]) == 2


def test_explicit_implementation_choice_wins():
    assert build_optimizer("Adam", {"foreach": True}, params((2,))).defaults["fused"] is None
    assert build_optimizer("SGD", {"lr": 0.1, "fused": False}, params((2,))).defaults["fused"] is False


# ----------------------------------------------------------------------------- factory errors


def expect_config_error(key_path: str, type_name, opt_params: dict, match: str = "") -> ConfigError:
    with pytest.raises(ConfigError) as info:
        build_optimizer(type_name, opt_params, params((2,)))
    assert info.value.key_path == key_path
    assert match in info.value.problem
    return info.value


def test_unknown_optimizer_type():
    expect_config_error("optimizer.type", "Adamm", {}, match="did you mean 'Adam'")
    err = expect_config_error("optimizer.type", "Shampoo", {})
    assert "Lamb" in err.problem
    expect_config_error("optimizer.type", None, {}, match="not a string")


def test_unknown_parameter():
    err = expect_config_error("optimizer.params.learning_rate", "Adam", {"learning_rate": 0.1},
                              match="unknown parameter for Adam; allowed: ")  # fmt: skip
    assert "adam_w_mode" in err.problem and "betas" in err.problem
    expect_config_error("optimizer.params.betas", "SGD", {"betas": [0.9, 0.99]}, match="unknown parameter for SGD")
    expect_config_error("optimizer.params.decoupled_weight_decay", "Adam", {"decoupled_weight_decay": True})


@pytest.mark.parametrize("type_name", ["Adam", "Lamb", "SGD"])
def test_max_grad_norm_points_to_gradient_clipping(type_name):
    expect_config_error("optimizer.params.max_grad_norm", type_name, {"max_grad_norm": 1.0},
                        match="gradient_clipping")  # fmt: skip


@pytest.mark.parametrize(
    "type_name,opt_params,key,match",
    [
        ("Adam", {"betas": [0.9]}, "betas", "two numbers"),
        ("Adam", {"betas": [0.9, 1.0]}, "betas", "two numbers"),
        ("Adam", {"betas": "0.9,0.999"}, "betas", "two numbers"),
        ("Adam", {"lr": -1.0}, "lr", ">= 0"),
        ("Adam", {"lr": "auto"}, "lr", ">= 0"),
        ("Adam", {"eps": float("inf")}, "eps", ">= 0"),
        ("AdamW", {"weight_decay": -0.1}, "weight_decay", ">= 0"),
        ("Adam", {"amsgrad": "true"}, "amsgrad", "not a boolean"),
        ("Adam", {"adam_w_mode": 1}, "adam_w_mode", "not a boolean"),
        ("Adam", {"bias_correction": False}, "bias_correction", "false is not supported"),
        ("AdamW", {"set_grad_none": False}, "set_grad_none", "false is not supported"),
        ("SGD", {"momentum": -0.5}, "momentum", ">= 0"),
        ("Lamb", {"amsgrad": True}, "amsgrad", "AMSGrad"),
        ("Lamb", {"min_coeff": 2.0, "max_coeff": 1.0}, "min_coeff", "larger than max_coeff"),
        ("Lamb", {"max_coeff": -1.0}, "max_coeff", ">= 0"),
    ],
)
def test_bad_values_name_the_key(type_name, opt_params, key, match):
    expect_config_error(f"optimizer.params.{key}", type_name, opt_params, match=match)


# ----------------------------------------------------------------------------- client optimizers


def test_resolve_client_optimizer():
    ps = params((2,))
    existing = torch.optim.SGD(ps, lr=0.1)
    assert resolve_client_optimizer(existing, ps) is existing
    from_class = resolve_client_optimizer(torch.optim.Adagrad, ps)
    assert type(from_class) is torch.optim.Adagrad
    from_partial = resolve_client_optimizer(functools.partial(torch.optim.SGD, lr=0.3), ps)
    assert from_partial.defaults["lr"] == 0.3
    seen = []
    resolve_client_optimizer(lambda groups: seen.append(groups) or torch.optim.SGD(groups, lr=0.1), ps)
    assert seen == [ps]


def test_resolve_client_optimizer_errors():
    with pytest.raises(TypeError, match="callable"):
        resolve_client_optimizer("adam", params((2,)))
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        resolve_client_optimizer(lambda groups: object(), params((2,)))
