"""The inference engine serves a Mixtral-style model (Llama attention + sparse MoE FFN, top-2) of our
own, loaded from an HF Mixtral folder saved from a random-init config: greedy tokens identical to HF
transformers' ``generate`` (fp32), one prompt at a time, as a ragged batch and with chunked prefill;
the grouped expert computation equals a per-expert loop; bad configs give one line."""

from __future__ import annotations

import json
import os

import pytest
import torch

from inference_cases import VOCAB, hf_greedy, prompts, save_model
from zerospeed.inference import SamplingParams, build_engine
from zerospeed.inference.models import ModelLoadError, load_model, model_from_hf

NEW = 12
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)


def _mixtral(seed: int = 0):
    import transformers as tf

    cfg = tf.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=256, initializer_range=0.3,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    model = _mixtral()
    path = save_model(model, str(tmp_path_factory.mktemp("mixtral")))
    ps = prompts([5, 17, 40, 3], seed=11)
    return model, path, ps, [hf_greedy(model, p, NEW) for p in ps]


def test_mixtral_greedy_matches_hf(mixtral):
    model, path, ps, ref = mixtral
    assert all(len(set(r)) >= 6 for r in ref), "random model too repetitive for a meaningful check"
    engine = build_engine(path, block_size=8, num_blocks=64, max_num_batched_tokens=256)
    for p, r in zip(ps, ref):
        assert engine.generate([p], GREEDY) == [r]
    assert engine.generate(ps, GREEDY) == ref  # a ragged batch: decodes and prefills in one forward
    chunked = build_engine(path, block_size=8, num_blocks=64, max_num_batched_tokens=7)
    assert chunked.generate(ps, GREEDY) == ref


def test_both_checkpoint_layouts_load_the_same_weights(mixtral):
    """The folder holds transformers-4 names (per-expert w1/w2/w3, which transformers 5 writes on save);
    an in-memory HF model has transformers-5 stacked experts (gate_up_proj, down_proj)."""
    model, path, _, _ = mixtral
    from_folder, _ = load_model(path)
    from_memory, _ = model_from_hf(model, torch.float32, "cpu")
    a, b = dict(from_folder.named_parameters()), dict(from_memory.named_parameters())
    assert a.keys() == b.keys() and any(".moe.gate_up" in n for n in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_grouped_experts_equal_a_per_expert_loop(mixtral):
    _, path, _, _ = mixtral
    ours, spec = load_model(path)
    moe = ours.layers[0].moe
    x = torch.randn(37, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, experts = moe.route(x)
    assert len(set(experts.reshape(-1).tolist())) > 2  # several experts are used
    ref = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(moe.k):
            e = int(experts[t, j])
            gate, up = (moe.gate_up[e] @ x[t]).split(moe.inter)
            ref[t] += weights[t, j] * (moe.down[e] @ (torch.nn.functional.silu(gate) * up))
    # fp32 to 1e-5 of the output's scale: outputs reach ~50 (initializer_range 0.3), so an element that
    # cancels to near 0 carries ~1e-5 of rounding from its large terms; an absolute 1e-5 used 0.42-1.03
    # of the tolerance over 10 inputs (0.56 on this one), 1e-5 x max|ref| uses 0.02-0.04
    atol = 1e-5 * ref.abs().max().item()
    torch.testing.assert_close(moe(x), ref, rtol=1e-5, atol=atol)  # every expert in use: batched
    assert len(set(experts[:1].reshape(-1).tolist())) * 2 <= moe.num_experts  # one token: the few-expert path
    torch.testing.assert_close(moe(x[:1]), ref[:1], rtol=1e-5, atol=atol)
    torch.testing.assert_close(moe(x[:3]), ref[:3], rtol=1e-5, atol=atol)


def test_mixtral_config_errors_are_one_line(mixtral, tmp_path):
    _, path, _, _ = mixtral
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(path):
        if name != "config.json":
            os.symlink(os.path.join(path, name), bad / name)
    del cfg["num_local_experts"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="missing key 'num_local_experts'"):
        load_model(str(bad))
    cfg["num_local_experts"], cfg["num_experts_per_tok"] = 8, 9
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"num_experts_per_tok \(9\) must be between 1 and num_local_experts \(8\)"):
        load_model(str(bad))


def test_mixtral_tensor_parallel_is_refused_naming_it(mixtral):
    from zerospeed.inference.models import TPInfo, build_model, load_spec

    spec = load_spec(mixtral[1])
    assert (spec.family, spec.num_experts, spec.experts_per_token) == ("mixtral", 8, 2)
    with pytest.raises(ModelLoadError, match="mixtral: tensor parallelism \\(size 2\\) is not supported"):
        build_model(spec, 16, torch.float32, "cpu", TPInfo(rank=0, size=2))
