"""Tensor-parallel inference on gloo: rank 0 schedules and samples and broadcasts each ragged
batch; tp2 gives the tokens tp1 gives (and HF's), for a GQA Llama and GPT-2, through
``build_engine``/``pipeline`` (with preemption) and through ``init_inference`` kernel injection. (GPT-NeoX splits are
covered at tp1 = HF only; its TP layout is the GPT-2 one with rotary.)"""

from __future__ import annotations

import pytest

from inference_cases import hf_greedy, make_model, prompts, save_model
from zerospeed.testing import run_distributed

NEW = 8


def _serve(path, ps):
    import torch

    torch.set_num_threads(1)
    from zerospeed.inference import SamplingParams, pipeline

    pipe = pipeline(path, tensor_parallel=2, num_blocks=8, block_size=8, max_num_batched_tokens=16)
    if pipe is None:  # ranks > 0 served until rank 0 shut down
        return None
    greedy = [r.generated_tokens for r in pipe(ps, max_new_tokens=NEW, ignore_eos=True)]
    sampled = pipe(ps, max_new_tokens=NEW, ignore_eos=True, do_sample=True, top_k=30, seed=5)
    pipe.shutdown()
    return greedy, [r.generated_tokens for r in sampled], pipe.engine.stats().num_preemptions


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_tp2_matches_tp1(family, tmp_path):
    model = make_model(family, seed=12)
    path = save_model(model, str(tmp_path / family))
    ps = prompts([5, 19, 30], seed=4)
    from zerospeed.inference import SamplingParams, build_engine

    one = build_engine(path, num_blocks=8, block_size=8, max_num_batched_tokens=16)
    ref = one.generate(ps, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert ref == [hf_greedy(model, p, NEW) for p in ps]
    ref_sampled = one.generate(ps, SamplingParams(max_new_tokens=NEW, ignore_eos=True, do_sample=True, top_k=30,
                                                  seed=5))
    results = run_distributed(_serve, 2, path, ps, timeout=240)
    greedy, sampled, preemptions = results[0]
    assert results[1] is None
    assert greedy == ref and sampled == ref_sampled
    assert preemptions > 0  # 8 blocks of 8 tokens hold 64 of the 78 tokens: sequences preempt each other


def _inject(family, ps):
    import torch

    torch.set_num_threads(1)
    import zerospeed

    model = make_model(family, seed=13)
    engine = zerospeed.init_inference(model, tensor_parallel={"tp_size": 2}, replace_with_kernel_inject=True,
                                      max_out_tokens=64)
    qkv = engine.module.model.layers[0].attn.qkv.weight.shape
    ids = torch.tensor([ps[0]])
    return engine.module.generate(ids, max_new_tokens=NEW, eos_token_id=None).tolist(), tuple(qkv)


def test_init_inference_kernel_inject_tp2():
    ps = prompts([9], seed=6)
    model = make_model("llama", seed=13)
    ref = hf_greedy(model, ps[0], NEW)
    results = run_distributed(_inject, 2, "llama", ps, timeout=240)
    for gen, qkv in results:
        assert gen[0][len(ps[0]):] == ref
        assert qkv == (2 * 16 + 2 * 16, 64)  # half the 4 q heads and half the 2 kv heads, head_dim 16
