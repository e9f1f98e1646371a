"""``zerospeed.init_inference`` (DeepSpeed v1): the HF module path and kernel injection (our own
fused model with the HF weights copied), forward logits and ``module.generate`` against HF."""

from __future__ import annotations

import pytest
import torch

import zerospeed
from inference_cases import hf_greedy, make_model, prompts, save_model
from zerospeed.config.errors import ConfigError


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_kernel_inject_matches_hf(family):
    model = make_model(family, seed=8)
    engine = zerospeed.init_inference(make_model(family, seed=8), dtype=torch.float32, replace_with_kernel_inject=True,
                                      max_out_tokens=64)
    assert type(engine.module).__name__ == "InjectedCausalLM"
    assert not any("transformers" in type(m).__module__ for m in engine.module.modules())
    ps = prompts([6, 11], seed=2)
    # forward: HF-shaped logits, left padding honoured
    ids = torch.zeros(2, 11, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0, 5:], mask[0, 5:] = torch.tensor(ps[0]), 1
    ids[1], mask[1] = torch.tensor(ps[1]), 1
    out = engine(ids, attention_mask=mask)[0]
    with torch.no_grad():
        for r, p in enumerate(ps):
            ref = model(torch.tensor([p])).logits[0]
            # to 2e-5 of the logits' scale (up to ~22 for these models): an absolute 2e-5 used 0.35 of
            # the tolerance on this model and up to 1.44 over 16 model/prompt seeds (so another CPU's
            # rounding could fail it); scaled, at most 0.09 over the same 16
            atol = 2e-5 * max(1.0, ref.abs().max().item())
            torch.testing.assert_close(out[r, 11 - len(p):], ref, atol=atol, rtol=1e-5)
    gen = engine.module.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert gen.shape == (2, 19)
    assert gen[:, 11:].tolist() == [hf_greedy(model, p, 8) for p in ps]
    with pytest.raises(ValueError, match="max_out_tokens"):
        engine.module.generate(ids, max_new_tokens=60)


def test_hf_module_path_with_checkpoint_and_dtype(tmp_path):
    src = make_model("llama", seed=9)
    path = save_model(src, str(tmp_path / "ckpt"))
    target = make_model("llama", seed=10)  # different weights, replaced by the checkpoint
    engine = zerospeed.init_inference(target, config={"dtype": "bf16", "checkpoint": path, "return_tuple": True})
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    ids = torch.tensor([prompts([7])[0]])
    out = engine(ids)
    assert isinstance(out, tuple)
    torch.testing.assert_close(out[0].float(), src.to(torch.bfloat16)(ids).logits.float())
    src.float()
    gen = engine.module.generate(ids, max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, 11)


def test_config_errors():
    with pytest.raises(ConfigError, match="dtype"):
        zerospeed.init_inference(make_model("llama"), dtype="int3")
    with pytest.raises(ConfigError, match="unknown key"):
        zerospeed.init_inference(make_model("llama"), config={"max_out_tokns": 5})
    with pytest.raises(ConfigError, match="enable_cuda_graph"):
        zerospeed.init_inference(make_model("llama"), enable_cuda_graph=True)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        zerospeed.init_inference("llama")
