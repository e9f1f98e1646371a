"""``init_inference``'s ``quant`` section (and ``dtype=int8``): the served model's Linear layers become
``QuantizedLinear``, on the HF-module path and on the injected path, with outputs close to fp32."""

from __future__ import annotations

import pytest
import torch

import zerospeed
from inference_cases import make_model, prompts
from zerospeed.compression import QuantizedLinear
from zerospeed.compression.inference import QuantizedRowLinear
from zerospeed.compression.quantized import INT_MM, ONEDNN
from zerospeed.config.errors import ConfigError
from zerospeed.config.inference import load_inference_config

#: int8 weights (and int8 activations) on these random models: logits within 3% of the largest fp32 logit
INT8_TOL = 0.03
#: HF's usual init: the inference cases' large init (0.3-0.6, for diverse greedy tokens) makes the random
#: models chaotic, so that any int8 rounding moves the logits by 20-30% and no tolerance means anything
SMALL = 0.02


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _quantized(module: torch.nn.Module) -> dict[str, QuantizedLinear]:
    return {n: m for n, m in module.named_modules() if isinstance(m, QuantizedLinear)}


def test_quant_section_parses_with_deepspeed_keys_and_errors() -> None:
    cfg = load_inference_config({"quant": {"enabled": True, "weight": {"num_bits": 4, "q_groups": 2,
                                                                          "q_type": "asymmetric"},
                                           "activation": {"enabled": True}, "qkv": {"enabled": False}}})
    assert (cfg.quant.weight.num_bits, cfg.quant.weight.q_groups, cfg.quant.weight.q_type) == (4, 2, "asymmetric")
    assert cfg.quant.activation.enabled and not cfg.quant.qkv.enabled
    assert load_inference_config({}).quant is None
    int8 = load_inference_config({}, dtype=torch.int8)
    assert int8.dtype == "fp32" and int8.quant.weight.num_bits == 8 and not int8.quant.activation.enabled
    for bad, key in [({"weight": {"num_bits": 3}}, "quant.weight.num_bits"),
                     ({"activation": {"num_bits": 4}}, "quant.activation.num_bits"),
                     ({"activation": {"q_groups": 2}}, "quant.activation.q_groups"),
                     ({"weight": {"post_init_quant": {"fc": {"group_dim": 0}}}}, "group_dim"),
                     ({"weights": {}}, "quant.weights")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_inference_config({"quant": bad})


@pytest.mark.parametrize("activation", [False, True])
def test_hf_module_path_quantizes_every_linear(activation: bool) -> None:
    dense = make_model("gpt2", seed=3, initializer_range=SMALL)
    ids = torch.tensor([prompts([9])[0]])
    with torch.no_grad():
        ref = dense(ids).logits
    engine = zerospeed.init_inference(make_model("gpt2", seed=3, initializer_range=SMALL),
                                      quant={"weight": {"num_bits": 8, "q_groups": 4},
                                             "activation": {"enabled": activation}})
    layers = _quantized(engine.module)
    assert len(layers) == 2 * 4 + 1  # c_attn, c_proj, c_fc, mlp.c_proj per block, and lm_head
    fc = layers["transformer.h.0.mlp.c_fc"]
    assert fc.bits == 8 and fc.scale.numel() == 4 and fc.act_bits == (8 if activation else 0)
    # the int8-activation kernel is the fastest one that is exact on this CPU (compression/quantized.py): oneDNN,
    # else torch._int_mm, else dequantize + fake-quantize (both are off under ONEDNN_MAX_CPU_ISA=AVX2: see make test-isa)
    int8_kernel = "onednn" if ONEDNN else "int_mm" if INT_MM else "dequant"
    assert fc.kernel == (int8_kernel if activation else "rowscale")
    assert _rel(engine(ids)[0], ref) < INT8_TOL


def test_qkv_off_post_init_quant_override_and_errors() -> None:
    engine = zerospeed.init_inference(make_model("gpt2", seed=3, initializer_range=SMALL), quant={
        "qkv": {"enabled": False},
        "weight": {"post_init_quant": {"mlp": {"num_bits": 4, "group_size": 16, "symmetric": False}}}})
    layers = _quantized(engine.module)
    assert not any(n.endswith("c_attn") for n in layers) and "transformer.h.1.attn.c_proj" in layers
    fc = layers["transformer.h.1.mlp.c_fc"]
    assert (fc.bits, fc.group_size, fc.symmetric) == (4, 16, False)
    with pytest.raises(ValueError, match=r"quant\.weight\.q_groups: 3 groups do not divide "
                                         r"transformer\.h\.0\.attn\.c_proj's 64 output rows"):
        zerospeed.init_inference(make_model("gpt2"), quant={"weight": {"q_groups": 3}, "qkv": {"enabled": True}})
    with pytest.raises(ValueError, match="matches several keys"):
        zerospeed.init_inference(make_model("gpt2"), quant={"weight": {"post_init_quant": {"mlp": {}, "c_fc": {}}}})
    with pytest.raises(ValueError, match="needs replace_with_kernel_inject"):
        zerospeed.init_inference(make_model("gpt2"), dtype="int8", tensor_parallel={"tp_size": 2})
    off = zerospeed.init_inference(make_model("gpt2"), quant={"enabled": False})
    assert not _quantized(off.module)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_injected_engine_serves_int8(family: str) -> None:
    dense = make_model(family, seed=4, initializer_range=SMALL)
    ps = prompts([7, 12], seed=5)
    engine = zerospeed.init_inference(make_model(family, seed=4, initializer_range=SMALL), dtype=torch.int8, replace_with_kernel_inject=True,
                                      max_out_tokens=64, quant={"activation": {"enabled": True}})
    layers = _quantized(engine.module)
    assert layers and all(m.act_bits == 8 and m.bits == 8 for m in layers.values())
    # the row-parallel projections (attention out, MLP down) are quantized too (one rank: plain QuantizedLinear)
    assert not any(type(m).__name__ == "RowLinear" for m in engine.module.modules())
    assert not any(isinstance(m, QuantizedRowLinear) for m in engine.module.modules())
    with torch.no_grad():
        for p in ps:
            ids = torch.tensor([p])
            assert _rel(engine(ids)[0], dense(ids).logits) < INT8_TOL
    gen = engine.module.generate(torch.tensor([ps[0]]), max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert gen.shape == (1, 13) and gen[0, :7].tolist() == ps[0]


def _inject_tp2(ps):
    import torch

    torch.set_num_threads(1)
    import zerospeed

    engine = zerospeed.init_inference(make_model("llama", seed=4, initializer_range=SMALL), dtype="int8",
                                      tensor_parallel={"tp_size": 2}, replace_with_kernel_inject=True,
                                      max_out_tokens=64, quant={"activation": {"enabled": True}})
    rows = [m for m in engine.module.modules() if isinstance(m, QuantizedRowLinear)]
    with torch.no_grad():
        return len(rows), len(_quantized(engine.module)), engine(torch.tensor([ps[0]]))[0]


def test_injected_engine_int8_under_tensor_parallelism() -> None:
    """tp2: each rank quantizes its shard; row-parallel partial products are dequantized, then all-reduced."""
    from zerospeed.testing import run_distributed

    ps = prompts([10], seed=6)
    with torch.no_grad():
        ref = make_model("llama", seed=4, initializer_range=SMALL)(torch.tensor([ps[0]])).logits
    results = run_distributed(_inject_tp2, 2, ps, timeout=240)
    for rows, layers, logits in results:
        assert rows == 2 * 2  # attention output and MLP down projection of both layers
        assert layers == rows + 2 * 2 + 1  # + the column-parallel qkv and gate_up, + the LM head
        assert _rel(logits, ref) < INT8_TOL
    assert torch.equal(results[0][2], results[1][2])
