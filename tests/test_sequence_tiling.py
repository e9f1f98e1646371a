"""ALST's tiled compute (issue #29): TiledMLP, sequence_tiled_compute and TiledFusedLogitsLoss equal the untiled
computation, and the activation memory falls with the tile count.

Tolerance (fp32): tiling computes every token's activations by the same formula; a parameter's gradient becomes a
sum over tiles of per-tile sums instead of one sum over tokens (a different order, within ~n ulps for n tokens),
so norm-wise 1e-5 relative holds with a wide margin at these sizes (<= 256 tokens). Memory: the peak is measured
with torch's profiler (zerospeed.checkpointing.peak_allocated_bytes, every CPU allocation) and the saved tensors
with SavedTensorBytes, as the activation-checkpointing tests do.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zerospeed.checkpointing import SavedTensorBytes, peak_allocated_bytes
from zerospeed.runtime.sequence_parallel.ulysses_sp import (TiledFusedLogitsLoss, TiledMLP,
                                                            sequence_tiled_compute)

RTOL = 1e-5


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def mlp(hidden=32, inter=64, seed=0):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(seed)
    return LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=inter))


def mlp_forward(module, x):
    return module.down_proj(module.act_fn(module.gate_proj(x)) * module.up_proj(x))


def grads_of(module, x, fn):
    x = x.clone().requires_grad_(True)
    module.zero_grad()
    out = fn(module, x)
    w = torch.linspace(-1, 1, out.numel()).reshape(out.shape)  # a fixed cotangent
    (out * w).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("shards,shape", [(1, (2, 37, 32)), (4, (2, 37, 32)), (5, (37, 32)), (37, (1, 37, 32))])
def test_tiled_mlp_equals_untiled(shards, shape):
    # 37 tokens: 4 and 5 tiles do not divide it (the last tile is shorter); 2-d input is a MoE expert's layout
    module = mlp()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    out, gx, gp = grads_of(module, x, mlp_forward)
    t_out, t_gx, t_gp = grads_of(module, x, lambda m, v: TiledMLP.apply(mlp_forward, m, v, shards))
    assert rel(t_out, out) <= RTOL and rel(t_gx, gx) <= RTOL
    assert all(rel(t_gp[n], gp[n]) <= RTOL for n in gp)


def test_tiled_mlp_accumulates_each_parameter_gradient_once():
    # ZeRO's gradient hooks fire on every accumulation: a tiled backward must accumulate once, as untiled does
    module = mlp()
    fired = {n: 0 for n, _ in module.named_parameters()}
    for n, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=n: fired.__setitem__(n, fired[n] + 1))
    x = torch.randn(1, 40, 32, requires_grad=True)
    TiledMLP.apply(mlp_forward, module, x, 8).sum().backward()
    assert set(fired.values()) == {1}, fired


def lm_loss(head, hidden, shift_labels):
    logits = head(hidden).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1), ignore_index=-100,
                           reduction="sum")


def _loss_case(seq=45, vocab=500, hidden=32):
    torch.manual_seed(3)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(1, seq, hidden)
    y = torch.randint(0, vocab, (1, seq))
    y[:, :7] = -100
    return head, h, y


def _run_loss(head, h, fn):
    h = h.clone().requires_grad_(True)
    head.zero_grad()
    loss = fn(h)
    loss.backward()
    return loss.detach(), h.grad, head.weight.grad.clone()


@pytest.mark.parametrize("shards", [1, 3, 8])
def test_tiled_losses_equal_untiled(shards):
    head, h, y = _loss_case()
    tokens = (y != -100).sum()
    ref = _run_loss(head, h, lambda v: lm_loss(head, v, y) / tokens)
    compute = _run_loss(head, h, lambda v: sequence_tiled_compute(
        lambda hidden_states, shift_labels, head: lm_loss(head, hidden_states, shift_labels), h.shape[1], shards,
        {"hidden_states": v, "shift_labels": y}, {"head": head}, "hidden_states", [head.weight],
        output_unshard_dimension=0, output_reduction="sum") / tokens)
    fused = _run_loss(head, h, lambda v: TiledFusedLogitsLoss.apply(
        lambda m, x, t: lm_loss(m, x, t), head, v, y, None, shards, [head.weight], "sum") / tokens)
    for got in (compute, fused):
        assert all(rel(a, b) <= RTOL for a, b in zip(got, ref)), (shards, [rel(a, b) for a, b in zip(got, ref)])


def test_sequence_tiled_compute_outputs_and_mean():
    module = mlp()
    x = torch.randn(2, 30, 32)
    out, gx, gp = grads_of(module, x, lambda m, v: mlp_forward(m, v))
    t_out, t_gx, t_gp = grads_of(module, x, lambda m, v: sequence_tiled_compute(
        lambda x, module: mlp_forward(module, x), 30, 4, {"x": v}, {"module": m}, "x", None, 1, None))
    assert rel(t_out, out) <= RTOL and rel(t_gx, gx) <= RTOL and all(rel(t_gp[n], gp[n]) <= RTOL for n in gp)
    v = x.clone().requires_grad_(True)
    mean = sequence_tiled_compute(lambda x, module: mlp_forward(module, x), 30, 4, {"x": v}, {"module": module}, "x")
    assert abs(float(mean) - float(mlp_forward(module, x).mean())) <= RTOL * abs(float(mlp_forward(module, x).mean()))
    with pytest.raises(ValueError, match="output_reduction 'max'"):
        sequence_tiled_compute(lambda x: x, 30, 4, {"x": v}, {}, "x", None, 1, "max")
    with pytest.raises(ValueError, match="grad_requiring_tensor_key 'h'"):
        sequence_tiled_compute(lambda x: x, 30, 4, {"x": v}, {}, "h")


def test_peak_activation_memory_falls_with_the_tile_count():
    module = mlp(hidden=64, inter=1024)
    x = torch.randn(1, 512, 64)
    per_token_intermediate = 1024 * 4  # one fp32 row of the [seq, intermediate] activations

    def step(shards):
        v = x.clone().requires_grad_(True)
        out = TiledMLP.apply(mlp_forward, module, v, shards) if shards else mlp_forward(module, v)
        out.sum().backward()

    peaks = {s: peak_allocated_bytes(lambda s=s: step(s)) for s in (0, 1, 4, 16)}  # 0: untiled
    # one tile recomputes the untiled graph; on top of it, the backward's preallocated input gradient and the
    # tile's own input gradient (before it is copied in) are live together: two [seq, hidden] buffers
    assert peaks[1] <= peaks[0] + 2 * x.numel() * 4, peaks
    assert peaks[16] < peaks[4] < peaks[1], peaks
    # the untiled graph holds several [seq, intermediate] tensors; 16 tiles hold a few [seq/16, intermediate] ones
    assert peaks[0] - peaks[16] >= 2 * 512 * per_token_intermediate * (1 - 1 / 16), peaks
    with SavedTensorBytes(ignore=module.parameters()) as untiled:
        mlp_forward(module, x.clone().requires_grad_(True))
    with SavedTensorBytes(ignore=module.parameters()) as tiled:
        TiledMLP.apply(mlp_forward, module, x.clone().requires_grad_(True), 16)
    assert tiled.total == x.numel() * 4  # only the input is kept for the backward
    assert untiled.total >= 3 * 512 * per_token_intermediate  # gate, up, act(gate): [seq, intermediate] each


def test_fused_logits_loss_holds_one_tile_of_logits():
    # its backward runs inside the forward, tile by tile: the [seq, vocab] logits never exist whole
    head, h, y = _loss_case(seq=256, vocab=2000)
    logits_bytes = 256 * 2000 * 4

    def step(shards):
        v = h.clone().requires_grad_(True)
        if shards:
            loss = TiledFusedLogitsLoss.apply(lambda m, x, t: lm_loss(m, x, t), head, v, y, None, shards,
                                              [head.weight], "sum")
        else:
            loss = lm_loss(head, v, y)
        loss.backward()

    peaks = {s: peak_allocated_bytes(lambda s=s: step(s)) for s in (0, 8)}
    assert peaks[0] >= logits_bytes and peaks[8] < peaks[0] - logits_bytes / 2, peaks


def _live_peak_bytes(fn):
    """Peak of the bytes allocated and not yet freed while ``fn`` runs (torch profiler's allocation events, in
    order; one thread)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_fused_logits_loss_holds_one_parameter_gradient_sum():
    # the lm_head gradient is summed over the tiles in place, and a tile's gradient is freed before the next tile
    # runs: at most the sum and one tile's gradient exist (2 weights), plus one tile's logits and the input's
    # gradient; keeping the previous tile's gradient and allocating each new sum made it 3 weights
    seq, hidden, vocab, shards = 32, 128, 4000, 8
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h, y = torch.randn(1, seq, hidden), torch.randint(0, vocab, (1, seq))

    def fn(m, x, t):
        return torch.nn.functional.cross_entropy(m(x).view(-1, vocab), t.reshape(-1), reduction="sum")

    def step():
        head.weight.grad = None
        v = h.clone().requires_grad_(True)
        TiledFusedLogitsLoss.apply(fn, head, v, y, None, shards, [head.weight], "sum").backward()

    step()
    weight_bytes, tile_logits_bytes, x_bytes = vocab * hidden * 4, (seq // shards) * vocab * 4, seq * hidden * 4
    peak = _live_peak_bytes(step)
    assert peak <= 2 * weight_bytes + 8 * tile_logits_bytes + 4 * x_bytes, (peak, weight_bytes)
