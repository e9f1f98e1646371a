"""Loading HF model folders into our own model classes: sharded safetensors with an index, 16-bit
files, tokenizer from the folder, and the errors for what we cannot load (each names the problem)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference_cases import build_tokenizer, hf_greedy, make_model, prompts, save_model
from zerospeed.inference import ModelLoadError, SamplingParams, build_engine
from zerospeed.inference.kv_cache import kv_cache_bytes


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    model = make_model("llama", seed=3)
    return model, save_model(model, str(tmp_path_factory.mktemp("llama")))


def test_sharded_index_folder_loads(llama, tmp_path):
    model, _ = llama
    path = save_model(model, str(tmp_path / "sharded"), max_shard_size="40KB")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 2
    p = prompts([11])[0]
    engine = build_engine(path, num_blocks=16, block_size=8)
    assert engine.generate([p], SamplingParams(max_new_tokens=10, ignore_eos=True)) == [hf_greedy(model, p, 10)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_folder_runs_in_its_dtype(llama, tmp_path, dtype):
    model, _ = llama
    path = save_model(model, str(tmp_path / "half"), dtype=dtype)
    engine = build_engine(path, dtype="auto", num_blocks=16, block_size=8)
    assert engine.dtype == dtype and engine.kv.data.dtype == dtype
    assert next(engine.model.parameters()).dtype == dtype
    # the weights are the file's values exactly
    ref = load_file(os.path.join(path, "model.safetensors"))
    q = ref["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(engine.model.layers[0].attn.qkv.weight[:q.shape[0]], q)
    out = engine.generate(prompts([9]), SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert len(out[0]) == 6


def test_kv_cache_bytes_follow_the_formula(llama):
    _, path = llama
    engine = build_engine(path, num_blocks=10, block_size=4)
    spec = engine.spec
    expect = 2 * spec.num_layers * 10 * 4 * spec.num_kv_heads * spec.head_dim * 4
    assert engine.stats().kv_cache_bytes == expect == kv_cache_bytes(spec.num_layers, 10, 4, spec.num_kv_heads,
                                                                      spec.head_dim, torch.float32)
    per_block = expect // 10
    sized = build_engine(path, kv_cache_memory=per_block * 7 + 5, block_size=4)
    assert sized.stats().num_blocks_total == 7 and sized.stats().kv_cache_bytes == per_block * 7
    assert sized.max_model_len == 28  # capped at what the cache holds


def test_missing_and_mismatched_tensors_are_named(llama, tmp_path):
    _, path = llama
    state = load_file(os.path.join(path, "model.safetensors"))
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("config.json", "generation_config.json"):
        (bad / f).write_text(open(os.path.join(path, f)).read())
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.0.self_attn.k_proj.weight"] = state["model.layers.0.self_attn.k_proj.weight"][:-1].clone()
    state["model.extra.weight"] = torch.zeros(2)
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(ModelLoadError) as e:
        build_engine(str(bad), num_blocks=4)
    msg = str(e.value)
    assert "missing tensors: model.layers.1.mlp.up_proj.weight" in msg
    assert "model.layers.0.self_attn.k_proj.weight: expected shape (32, 64), found (31, 64)" in msg
    assert "unexpected tensors: model.extra.weight" in msg


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(ModelLoadError, match=r"not supported.*supported: LlamaForCausalLM \(llama\).*GPT2LMHeadModel"):
        build_engine(str(tmp_path))


def test_folder_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="is not a directory"):
        build_engine(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="config.json: not found"):
        build_engine(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8,
                                                      "num_attention_heads": 2, "num_hidden_layers": 1,
                                                      "intermediate_size": 8, "vocab_size": 10}))
    with pytest.raises(ModelLoadError, match="no weights found"):
        build_engine(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="rope type 'yarn' is not supported"):
        build_engine(str(tmp_path))


def test_engine_argument_errors(llama):
    _, path = llama
    with pytest.raises(ValueError, match="block_size: must be an integer >= 1"):
        build_engine(path, block_size=0)
    with pytest.raises(ValueError, match="dtype: 'fp8' is not one of"):
        build_engine(path, dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_memory: 10 bytes hold no block"):
        build_engine(path, kv_cache_memory=10)


def test_tokenizer_from_folder(llama, tmp_path):
    model, _ = llama
    path = save_model(model, str(tmp_path / "tok"))
    build_tokenizer(path)
    engine = build_engine(path, num_blocks=8)
    ids = engine.tokenizer.encode("w5 w7 w9", add_special_tokens=False)
    assert ids == [9, 11, 13]
    assert engine.tokenizer.decode(ids) == "w5 w7 w9"
    assert engine.tokenizer.apply_chat_template([{"role": "user", "content": "w1"}]) == "w1 "
    assert engine.eos_token_ids == [2] and engine.model_name == "tok"
