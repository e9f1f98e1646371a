"""init_compression: each technique alone, its schedule, the engine hook, torch.compile, errors."""

from __future__ import annotations

import pytest
import torch
from compression_cases import TINY_GPT, TinyResNet, aq, batch, ds, prune, tiny_gpt, wq

import zerospeed
from zerospeed.compression import CompressedLayer, distillation_loss, init_compression, scheduler_of
from zerospeed.compression.quantizer import fake_quantize, pack, quantize, unpack
from zerospeed.config import ConfigError


def _levels(w: torch.Tensor) -> int:
    return int(torch.unique(w.detach()).numel())


@pytest.mark.parametrize("bits,levels", [(8, 255), (4, 15), (2, 3), (1, 2)])
def test_fake_quantize_grid_and_straight_through(bits: int, levels: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    q = fake_quantize(w, bits, num_groups=1)
    assert _levels(q) <= levels and _levels(q) >= min(levels, 3)
    q.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))  # straight-through estimator
    err = (q - w).abs().max().item()
    if bits >= 4:
        assert err <= w.abs().max().item() / (2 ** (bits - 1) - 1) / 2 + 1e-6  # half a grid step


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8, 12, 16])
def test_pack_round_trip_and_bytes(bits: int) -> None:
    torch.manual_seed(1)
    w = torch.randn(16, 32)
    for symmetric in (True, False):
        q, _, _ = quantize(w, bits, 4, symmetric)
        sym = symmetric or bits <= 2
        packed = pack(q, bits, zero_offset=sym)
        assert torch.equal(unpack(packed, bits, q.numel(), sym).view(q.shape).float(), q)
        width = {1: 1, 2: 2, 3: 4, 4: 4, 8: 8, 12: 16, 16: 16}[bits]
        assert packed.numel() * packed.element_size() == q.numel() * width // 8


def test_bit_schedule_steps_from_start_to_target_after_offset() -> None:
    model = tiny_gpt()
    init_compression(model, ds({"weight_quantization": wq(4, ["blocks"], start=8, period=2, offset=3)}))
    layer = model.blocks[0].mlp.fc
    sched = scheduler_of(model)
    seen = []
    for _ in range(14):
        seen.append(layer.wq_bits)
        sched.step()
    assert seen == [0, 0, 0, 8, 8, 7, 7, 6, 6, 5, 5, 4, 4, 4]


def test_matching_is_regex_and_wraps_in_place_keeping_parameters() -> None:
    model = tiny_gpt()
    before = dict(model.named_parameters())
    init_compression(model, ds({"weight_quantization": wq(8, [r"blocks\.[02]\.mlp\.fc"])}))
    wrapped = [n for n, m in model.named_modules() if isinstance(m, CompressedLayer)]
    assert wrapped == ["blocks.0.mlp.fc", "blocks.2.mlp.fc"]
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)


def test_sparse_mask_hits_dense_ratio_exactly_and_follows_schedule() -> None:
    model = tiny_gpt()
    init_compression(model, ds({"sparse_pruning": prune(0.3, ["attn.qkv"], offset=2)}))
    layer = model.blocks[1].attn.qkv
    sched = scheduler_of(model)
    model(batch(0))
    assert not layer.on["sparse"] and layer.sparse_mask.sum() == layer.weight.numel()
    sched.step(), sched.step()
    model(batch(0))
    mask = layer.sparse_mask
    assert int(mask.sum()) == round(0.3 * layer.weight.numel())
    kept = layer.weight.detach().abs()[mask.bool()]
    dropped = layer.weight.detach().abs()[~mask.bool()]
    assert kept.min() >= dropped.max()  # l1: the largest magnitudes stay
    w = layer.effective_weight()
    assert torch.equal(w == 0, ~mask.bool() | (layer.weight == 0))


def test_topk_row_pruning_learns_scores_and_keeps_exact_rows() -> None:
    model = tiny_gpt()
    init_compression(model, ds({"row_pruning": prune(0.25, ["mlp.fc"], method="topk", related=[["mlp.proj"]])}))
    layer = model.blocks[0].mlp.fc
    assert layer.row_mask_scores.requires_grad
    model(batch(0), batch(1)).backward()
    assert layer.row_mask_scores.grad is not None and layer.row_mask_scores.grad.abs().sum() > 0
    mask = layer.mask("row").detach()
    assert int(mask.sum()) == round(0.25 * layer.out_features)
    w = layer.effective_weight()
    assert torch.equal((w.abs().sum(dim=1) == 0), mask == 0)


def test_snip_momentum_ramps_density_in_blocks() -> None:
    model = tiny_gpt()
    init_compression(model, ds({"sparse_pruning": prune(0.5, ["mlp.fc"], method="snip_momentum", offset=1,
                                                        schedule_offset_end=3, block_pattern="4x1")}))
    layer, sched = model.blocks[0].mlp.fc, scheduler_of(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    density = []
    for step in range(5):
        model(batch(step), batch(step + 1)).backward()
        opt.step(), opt.zero_grad(), sched.step()
        model(batch(step))
        density.append(layer.sparse_mask.mean().item())
    assert density == [1.0, 0.75, 0.5, 0.5, 0.5]  # linear ramp from offset 1 to offset_end 3
    blocks = layer.sparse_mask.view(32, 4, 32)
    assert torch.all(blocks.amax(dim=1) == blocks.amin(dim=1))  # whole 4x1 blocks


def test_head_pruning_keeps_whole_heads() -> None:
    model = tiny_gpt()
    init_compression(model, ds({"head_pruning": prune(0.5, ["attn.proj"], num_heads=4, related=[["attn.qkv"]])}))
    layer = model.blocks[0].attn.proj
    model(batch(0))
    heads = layer.head_mask
    assert int(heads.sum()) == 2
    cols = layer.effective_weight().abs().sum(dim=0).view(4, 8)
    assert torch.equal(cols.sum(dim=1) == 0, heads == 0)


def test_channel_pruning_on_conv() -> None:
    model = TinyResNet()
    init_compression(model, ds({"channel_pruning": prune(0.5, ["layer....conv1"],
                                                         related=[["layer....conv2", "layer....bn1"]])}))
    layer = model.layer1[0].conv1
    model(torch.randn(2, 3, 8, 8))
    assert int(layer.channel_mask.sum()) == 4
    w = layer.effective_weight()
    assert torch.equal(w.abs().sum(dim=(1, 2, 3)) == 0, layer.channel_mask == 0)


def test_activation_quantization_dynamic_and_static() -> None:
    for calibration in ("dynamic", "static"):
        model = tiny_gpt()
        init_compression(model, ds({"activation_quantization": aq(4, ["mlp.proj"], calibration)}))
        layer = model.blocks[0].mlp.proj
        seen = {}
        layer.register_forward_hook(lambda m, i, o: seen.__setitem__("x", m.quantize_input(i[0])))
        model.train()
        model(batch(0))
        if calibration == "static":  # the first step calibrates: unquantized, range recorded
            assert _levels(seen["x"]) > 15 and not layer.act_seen
            scheduler_of(model).step()
            assert layer.act_seen and layer.act_high > 0 and layer.act_low < 0
            model(batch(1))
        assert _levels(seen["x"]) <= 15


def test_layer_reduction_without_and_with_teacher() -> None:
    lr = {"enabled": True, "keep_number_layer": 2, "module_name_prefix": "blocks", "teacher_layer": [1, 3],
          "other_module_name": ["tok_emb", "pos_emb", "ln_f"]}
    teacher = tiny_gpt(seed=1)
    alone = tiny_gpt(seed=1)
    init_compression(alone, ds({"layer_reduction": lr}))
    assert len(alone.blocks) == 2 and alone.blocks[0] is not None
    assert torch.equal(alone.blocks[1].mlp.fc.weight, teacher.blocks[3].mlp.fc.weight)
    from gpt_model import GPTConfig

    student = tiny_gpt(seed=2, cfg=GPTConfig(**{**TINY_GPT.__dict__, "n_layer": 2}))
    init_compression(student, ds({"layer_reduction": lr}), teacher_model=teacher)
    for i, t in enumerate([1, 3]):
        for (n, a), (_, b) in zip(student.blocks[i].named_parameters(), teacher.blocks[t].named_parameters()):
            assert torch.equal(a, b), n
    assert torch.equal(student.tok_emb.weight, teacher.tok_emb.weight)
    x = batch(0)
    assert torch.allclose(student(x), alone(x), atol=1e-6)


def test_distillation_loss() -> None:
    s = torch.randn(4, 8, 10, requires_grad=True)
    t = torch.randn(4, 8, 10)
    assert distillation_loss(t.clone(), t, temperature=2.0).abs() < 1e-6
    loss = distillation_loss(s, t, temperature=2.0, hard_loss=torch.tensor(1.0), alpha=0.5)
    ref = torch.nn.functional.kl_div(torch.log_softmax(s.view(-1, 10) / 2, -1), torch.softmax(t.view(-1, 10) / 2, -1),
                                     reduction="batchmean") * 4
    assert torch.allclose(loss, 0.5 * ref + 0.5, atol=1e-6)
    loss.backward()
    with pytest.raises(ValueError, match="differ in shape"):
        distillation_loss(s, t[:2])


def test_engine_advances_the_schedule_and_requires_init() -> None:
    cfg = ds({"weight_quantization": wq(4, ["blocks"], start=8, period=1, offset=1)})
    with pytest.raises(ConfigError, match="init_compression"):
        zerospeed.initialize(model=tiny_gpt(), config=cfg)
    model = init_compression(tiny_gpt(), cfg)
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    bits = []
    for step in range(4):
        x = batch(step)
        engine.backward(engine(x, x))
        engine.step()
        bits.append(model.blocks[0].attn.qkv.wq_bits)
    assert bits == [8, 7, 6, 5]


def test_torch_compile_traces_without_graph_breaks() -> None:
    import torch._dynamo

    from gpt_model import GPTConfig

    model = tiny_gpt(cfg=GPTConfig(**{**TINY_GPT.__dict__, "n_layer": 1}))
    cfg = ds({"weight_quantization": wq(4, ["blocks"], groups=4), "activation_quantization": aq(8, ["blocks"]),
              "sparse_pruning": prune(0.5, ["attn.qkv"]),
              "row_pruning": prune(0.5, ["mlp.fc"], method="topk", related=[["mlp.proj"]]),
              "head_pruning": prune(0.5, ["attn.proj"], num_heads=4, related=[["attn.qkv"]])})
    init_compression(model, cfg)
    model(batch(0))  # masks computed once, eagerly
    torch._dynamo.reset()
    explain = torch._dynamo.explain(model)(batch(1), batch(2))
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1


def test_qat_loss_close_to_fp32_on_demo_data() -> None:
    """W8A8 QAT on the demo byte-level text: after 40 AdamW steps its loss is within 3% of fp32's."""
    from data import SyntheticTextDataset
    from gpt_model import GPTConfig

    cfg = GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, seq_len=32)
    data = SyntheticTextDataset(num_samples=320, seq_len=32, seed=0)
    losses = {}
    for name in ("fp32", "w8a8"):
        model = tiny_gpt(seed=0, cfg=cfg)
        if name == "w8a8":
            init_compression(model, ds({"weight_quantization": wq(8, ["blocks"]),
                                        "activation_quantization": aq(8, ["blocks"])}))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for step in range(40):
            x, y = zip(*(data[step * 8 + i] for i in range(8)))
            loss = model(torch.stack(x), torch.stack(y))
            loss.backward(), opt.step(), opt.zero_grad()
        with torch.no_grad():
            x, y = zip(*(data[i] for i in range(8)))
            losses[name] = model(torch.stack(x), torch.stack(y)).item()
    assert losses["fp32"] < 3.0  # it learned something
    assert abs(losses["w8a8"] - losses["fp32"]) / losses["fp32"] < 0.03, losses


def test_errors() -> None:
    with pytest.raises(ConfigError, match=r"match no .* its modules are: tok_emb, pos_emb, drop, blocks, blocks\.0"):
        init_compression(tiny_gpt(), ds({"weight_quantization": wq(8, ["encoder.layer"])}))
    with pytest.raises(ConfigError, match=r"start_bits: 32 bits is not supported"):
        init_compression(tiny_gpt(), ds({"weight_quantization": wq(8, ["blocks"], start=32)}))
    with pytest.raises(ConfigError, match=r"dense_ratio: 1.5 is not a number in \(0, 1\]"):
        init_compression(tiny_gpt(), ds({"sparse_pruning": prune(1.5, ["blocks"])}))
    with pytest.raises(ConfigError, match=r"dense_ratio: 0 is not a number in \(0, 1\]"):
        init_compression(tiny_gpt(), ds({"row_pruning": prune(0, ["mlp.fc"])}))
    lr = {"enabled": True, "keep_number_layer": 6, "module_name_prefix": "blocks", "teacher_layer": [0, 1, 2, 3, 4, 5]}
    with pytest.raises(ConfigError, match=r"keep_number_layer: 6 is larger than the 4 layers of 'blocks'"):
        init_compression(tiny_gpt(), ds({"layer_reduction": lr}))
    with pytest.raises(ValueError, match="quantize_groups 7 does not divide"):
        init_compression(tiny_gpt(), ds({"weight_quantization": wq(8, ["blocks"], groups=7)}))
    with pytest.raises(ConfigError, match="num_heads: is required"):
        init_compression(tiny_gpt(), ds({"head_pruning": prune(0.5, ["attn.proj"])}))
    model = init_compression(tiny_gpt(), ds({"weight_quantization": wq(8, ["blocks"])}))
    with pytest.raises(ValueError, match="already compressed"):
        init_compression(model, ds({"weight_quantization": wq(8, ["blocks"])}))


def test_bf16_engine_with_real_gpt2_config() -> None:
    """The DeepSpeedExamples GPT-2 W4/8-A8 config on a random HF GPT-2, trained by the engine in bf16
    at ZeRO-2 (one process): the fake-quantized layers run in bf16 and the loss goes down."""
    import json

    from compression_cases import DS_CONFIGS, tiny_gpt2

    path = DS_CONFIGS / "compression__gpt2__config__ds_config_W4or8A8_Qgroup64_fp32.json"
    if not path.exists():
        pytest.skip(f"DeepSpeed example config {path} is not in this checkout (../shared/ds_configs)")
    raw = json.loads(path.read_text())
    raw.update({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
                "zero_optimization": {"stage": 2}, "steps_per_print": 0})
    model = init_compression(tiny_gpt2(), raw).train()
    engine, *_ = zerospeed.initialize(model=model, config=raw)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(6):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    c_fc = model.transformer.h[0].mlp.c_fc
    assert c_fc.weight.dtype == torch.bfloat16 and c_fc.wq_bits == 4 and c_fc.aq_on
    assert model.transformer.h[0].attn.c_attn.wq_bits == 8
    assert losses[-1] < losses[0]
