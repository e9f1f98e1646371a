"""The user-facing APIs on the engine: MII-style ``pipeline`` (text and id prompts, stop strings,
streaming by callback and iterator) and DeepSpeed v2's ``build_hf_engine`` put/query/flush."""

from __future__ import annotations

import pytest
import torch

from inference_cases import build_tokenizer, hf_greedy, make_model, prompts, save_model
from zerospeed.config.errors import ConfigError
from zerospeed.inference import RequestError, build_hf_engine, pipeline
from zerospeed.inference.kv_cache import NoFreeBlocks


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    model = make_model("gpt_neox", seed=6)
    path = save_model(model, str(tmp_path_factory.mktemp("m")))
    build_tokenizer(path)
    return model, path


def test_pipeline_text_and_ids(folder):
    model, path = folder
    pipe = pipeline(path, num_blocks=64, block_size=8)
    texts = ["w10 w20 w30 w40", "w5"]
    ids = [pipe.tokenizer.encode(t) for t in texts]
    raw = prompts([12])[0]
    out = pipe(texts + [raw], max_new_tokens=9, ignore_eos=True)
    for r, p in zip(out, ids + [raw]):
        assert r.generated_tokens == hf_greedy(model, p, 9)
        assert r.prompt_length == len(p) and r.generated_length == 9 and r.finish_reason == "length"
        assert r.generated_text == pipe.tokenizer.decode(r.generated_tokens)
    single = pipe("w10 w20 w30 w40", max_new_tokens=9, ignore_eos=True)
    assert len(single) == 1 and single[0].generated_tokens == out[0].generated_tokens
    assert pipe(raw, max_new_tokens=9, ignore_eos=True)[0].generated_tokens == out[2].generated_tokens


def test_pipeline_stop_string_and_streaming(folder):
    model, path = folder
    pipe = pipeline(path, num_blocks=64, block_size=8)
    full = pipe("w1 w2 w3", max_new_tokens=10, ignore_eos=True)[0]
    words = full.generated_text.split()
    stop = words[3]
    cut = pipe("w1 w2 w3", max_new_tokens=10, ignore_eos=True, stop=stop)[0]
    assert cut.finish_reason == "stop" and stop not in cut.generated_text
    assert cut.generated_text == full.generated_text[:full.generated_text.index(stop)]
    chunks = []
    res = pipe(["w1 w2 w3", "w4"], max_new_tokens=10, ignore_eos=True, streaming_fn=chunks.append)
    assert "".join(c.new_text for c in chunks if c.index == 0) == res[0].generated_text == full.generated_text
    assert [t for c in chunks if c.index == 1 for t in c.new_tokens] == res[1].generated_tokens
    assert sum(c.finished for c in chunks) == 2
    it = list(pipe.stream("w1 w2 w3", max_new_tokens=10, ignore_eos=True))
    assert [c.new_tokens[0] for c in it] == full.generated_tokens and it[-1].finished
    # seeded sampling through the pipeline is reproducible
    a = pipe(["w1", "w9 w8"], do_sample=True, top_k=20, seed=3, max_new_tokens=8, ignore_eos=True)
    b = pipe(["w9 w8", "w7", "w1"], do_sample=True, top_k=20, seed=3, max_new_tokens=8, ignore_eos=True)
    assert a[0].generated_tokens == b[2].generated_tokens and a[1].generated_tokens == b[0].generated_tokens


def test_pipeline_bad_input(folder):
    _, path = folder
    pipe = pipeline(path, num_blocks=64, block_size=8)
    with pytest.raises(RequestError, match="^prompt: is empty"):
        pipe([[]])
    with pytest.raises(RequestError, match="^top_p"):
        pipe("w1", do_sample=True, top_p=2.0)
    assert not pipe.engine.has_unfinished()
    assert pipe.engine.stats().num_blocks_free == 64


def test_v2_put_query_flush(folder):
    model, path = folder
    engine = build_hf_engine(path, {"state_manager": {"max_ragged_batch_size": 64, "max_ragged_sequence_count": 4,
                                                      "max_context": 128,
                                                      "memory_config": {"mode": "allocate", "size": 20}},
                                    "block_size": 8})
    assert engine.n_kv_cache_blocks == 20 and engine.free_blocks == 20
    ps = prompts([10, 20])
    refs = [hf_greedy(model, p, 5) for p in ps]
    logits = engine.put([7, 9], [torch.tensor(ps[0]), ps[1]])
    assert logits.shape == (2, 320)
    gen = {7: [], 9: []}
    for _ in range(5):
        nxt = logits.argmax(-1).tolist()
        gen[7].append(nxt[0])
        gen[9].append(nxt[1])
        logits = engine.put([9, 7], [[nxt[1]], [nxt[0]]])[[1, 0]]
    assert [gen[7], gen[9]] == refs
    # uid 7 holds 15 tokens in 2 blocks: 1 more fits in them, 8 per free block beyond
    assert engine.query(7, 100, 3) == (1 + 3 * 8, 3) and engine.get_remaining_block_capacity(7) == 1
    tokens, blocks = engine.query(5, 40, 3)
    assert (tokens, blocks) == (24, 3)
    assert not engine.can_schedule([5], [200])
    with pytest.raises(ValueError, match="max_ragged_batch_size"):
        engine.put([5], [list(range(3, 70))])
    with pytest.raises(NoFreeBlocks, match="KV blocks"):
        engine.put([1, 2, 3], [list(range(3, 60))] * 3, do_checks=False)
    engine.flush(7)
    engine.flush(9)
    assert engine.free_blocks == 20
    with pytest.raises(ValueError, match="uid 7 is not tracked"):
        engine.flush(7)
    with pytest.raises(ConfigError, match="state_manager.memory_config.mode"):
        build_hf_engine(path, {"state_manager": {"memory_config": {"mode": "lots"}}})
