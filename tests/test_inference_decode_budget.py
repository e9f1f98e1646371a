"""The decode K/V budget (``max_decode_kv_bytes``): its "auto" value follows the weight bytes a decode
step reads; the running sequences' K/V at their longest never exceeds it (a lone sequence excepted);
admission stays first-in first-out, a request larger than the whole budget still runs, greedy tokens
equal HF's; bad values are refused by name. Asserted on the scheduler's state, never on time."""

from __future__ import annotations

import pytest
import torch

from inference_cases import hf_greedy, make_model, prompts, save_model
from zerospeed.inference import SamplingParams, build_engine
from zerospeed.inference.engine import DECODE_KV_RATIO
from zerospeed.inference.kv_cache import kv_cache_bytes

NEW = 6


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    model = make_model("llama", seed=3)
    path = save_model(model, str(tmp_path_factory.mktemp("llama_budget")))
    return model, path


@pytest.mark.parametrize("bad", [0, -4, 1.5, True, "big"])
def test_bad_budget_is_refused_by_name(llama, bad):
    with pytest.raises(ValueError, match="max_decode_kv_bytes: must be 'auto', None or a positive integer"):
        build_engine(llama[1], num_blocks=8, max_decode_kv_bytes=bad)


def test_auto_budget_is_a_fraction_of_the_weights_a_step_reads(llama):
    engine = build_engine(llama[1], num_blocks=16)
    model = engine.model
    head = model.lm_head.weight
    per = {"int8": 1, "bf16": 2}.get(model._greedy_choice(model.decode_rows_hint).head, 4)  # the chosen head
    want = sum(p.numel() * 4 for n, p in model.named_parameters() if n not in ("embed.weight", "lm_head.weight"))
    want += head.numel() * per
    assert model.decode_weight_bytes() == want
    assert engine.max_decode_kv_bytes == int(DECODE_KV_RATIO * want)
    assert engine.stats().extra["max_decode_kv_bytes"] == engine.max_decode_kv_bytes
    assert build_engine(llama[1], num_blocks=16, max_decode_kv_bytes=None).scheduler.max_decode_kv_tokens is None


def test_budget_bounds_the_running_kv_fifo_and_keeps_hf_tokens(llama):
    model, path = llama
    lengths = [9, 3, 14, 5, 11, 2, 7, 12]
    ps = prompts(lengths, seed=21)
    ref = [hf_greedy(model, p, NEW) for p in ps]
    spec = build_engine(path, num_blocks=8).spec
    token_bytes = kv_cache_bytes(spec.num_layers, 1, 1, spec.num_kv_heads, spec.head_dim, torch.float32)
    budget_tokens = 40  # about three of these requests at their longest (prompt + NEW)
    engine = build_engine(path, block_size=4, num_blocks=64, max_num_batched_tokens=32,
                          max_decode_kv_bytes=budget_tokens * token_bytes)
    assert engine.scheduler.max_decode_kv_tokens == budget_tokens
    sp = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, sp)
    admitted: list[str] = []
    out: dict[str, list[int]] = {}
    peak = 0
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        running = engine.scheduler.running
        for s in running:
            if s.request_id not in admitted:
                admitted.append(s.request_id)
        held = sum(s.prompt_len + s.params.max_new_tokens for s in running)
        assert len(running) == 1 or held <= budget_tokens
        peak = max(peak, len(running))
    assert admitted == [str(i) for i in range(len(ps))]  # first in, first out
    assert 1 < peak < len(ps)  # the budget, not the request count, limited the batch
    assert [out[str(i)] for i in range(len(ps))] == ref


def test_a_request_larger_than_the_budget_still_runs(llama):
    model, path = llama
    p = prompts([30], seed=4)[0]
    engine = build_engine(path, block_size=4, num_blocks=64, max_decode_kv_bytes=1)
    assert engine.scheduler.max_decode_kv_tokens == 1
    ps = [p, p[:5]]
    got = engine.generate(ps, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert got == [hf_greedy(model, q, NEW) for q in ps]
