"""Decode attention over the paged cache: the C kernel (:mod:`zerospeed.inference.cpu_kernel`)
against the pure-torch path (gathered blocks + SDPA), and both against a per-sequence reference,
fp32 within 1e-5; greedy tokens through the engine equal HF's on either backend; the decode
prefill cap and the backend choice reject bad values by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference_cases import hf_greedy, make_model, prompts, save_model
from zerospeed.inference import SamplingParams, build_engine, cpu_kernel
from zerospeed.inference.attention import AttentionMetadata

BS = 4


def _case(hq: int, hkv: int, lens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BS) for n in lens) + 5
    k_cache = torch.randn(num_blocks * BS, hkv, 8, generator=g)
    v_cache = torch.randn(num_blocks * BS, hkv, 8, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, i = [], 0
    for n in lens:  # scattered blocks, not in order
        nb = -(-n // BS)
        tables.append(perm[i:i + nb])
        i += nb
    q = torch.randn(len(lens), hq, 8, generator=g)
    return q, k_cache, v_cache, tables


def _reference(q, k_cache, v_cache, tables, lens, scale, window):
    out = []
    for b, n in enumerate(lens):
        slots = torch.tensor([tables[b][p // BS] * BS + p % BS for p in range(n)])
        k, v = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)
        mask = None if window is None else torch.arange(n) > n - 1 - window
        out.append(F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, attn_mask=mask, scale=scale,
                                                  enable_gqa=True)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("hq,hkv,window", [(4, 4, None), (4, 2, None), (6, 1, 5), (2, 2, 9)])
def test_decode_kernel_and_torch_path_match_reference(hq, hkv, window):
    ok, why = cpu_kernel.available()
    assert ok, why  # the machine that runs the tests has a C compiler; the kernel must build
    lens = [23, 21, 3, 17, 1, 9, 8, 30]  # several length groups on the torch path, full blocks too
    lens.sort(reverse=True)
    q, kc, vc, tables = _case(hq, hkv, lens)
    # decode rows are the last token of each context: cached = len - 1; their K/V go to that slot
    items = [(n - 1, 1, tables[b]) for b, n in enumerate(lens)]
    last_k = torch.stack([kc[tables[b][(n - 1) // BS] * BS + (n - 1) % BS] for b, n in enumerate(lens)])
    last_v = torch.stack([vc[tables[b][(n - 1) // BS] * BS + (n - 1) % BS] for b, n in enumerate(lens)])
    scale = 0.3
    ref = _reference(q, kc, vc, tables, lens, scale, window)
    outs = {}
    for kernel in (False, True):
        meta = AttentionMetadata.build(items, len(lens), BS, torch.device("cpu"), decode_kernel=kernel)
        assert (meta.kernel_tables is not None) == kernel
        if not kernel:
            assert len(meta.decode_groups) > 1
        outs[kernel] = meta.attend(q, last_k, last_v, kc.clone(), vc.clone(), scale, window).view_as(q)
    torch.testing.assert_close(outs[True], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[False], ref, atol=1e-5, rtol=1e-5)


def test_decode_kernel_threads_split_sequences():
    """With several torch threads the kernel splits sequences across POSIX threads: same result."""
    lens = [31, 2, 17, 9, 25]
    q, kc, vc, tables = _case(4, 2, lens, seed=7)
    tab = torch.tensor([t + [0] * (8 - len(t)) for t in tables])
    args = (q, kc, vc, tab, torch.tensor(lens), BS, max(lens), None, 6)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernel.decode_attention(*args)
        torch.set_num_threads(3)
        three = cpu_kernel.decode_attention(*args)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, three)
    torch.testing.assert_close(one, _reference(q, kc, vc, tables, lens, None, 6), atol=1e-5, rtol=1e-5)


def test_kernel_with_prefill_chunks_in_the_same_forward():
    """Mixed forward: kernel decodes plus a fresh prompt and a continued prompt, same as torch path."""
    lens = [13, 6]
    q0, kc, vc, tables = _case(4, 2, lens + [12], seed=3)
    g = torch.Generator().manual_seed(4)
    fresh, cont = 5, 4  # a 5-token prompt from 0; a 4-token chunk after 8 cached tokens (table 2)
    T = len(lens) + fresh + cont
    q = torch.randn(T, 4, 8, generator=g)
    k = torch.randn(T, 2, 8, generator=g)
    v = torch.randn(T, 2, 8, generator=g)
    extra = list(range(kc.shape[0] // BS, kc.shape[0] // BS + 2))
    kc = torch.cat([kc, torch.zeros(2 * BS, 2, 8)])
    vc = torch.cat([vc, torch.zeros(2 * BS, 2, 8)])
    items = [(lens[0] - 1, 1, tables[0]), (lens[1] - 1, 1, tables[1]), (0, fresh, extra), (8, cont, tables[2])]
    outs = [AttentionMetadata.build(items, 2, BS, torch.device("cpu"), decode_kernel=kern)
            .attend(q, k, v, kc.clone(), vc.clone(), None, None) for kern in (False, True)]
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    model = make_model("mistral")  # sliding window 24: the window path of both backends
    path = save_model(model, str(tmp_path_factory.mktemp("mistral")))
    ps = prompts([30, 7, 19, 2], seed=11)
    return path, ps, [hf_greedy(model, p, 14) for p in ps]


@pytest.mark.parametrize("backend", ["torch", "cpu_kernel"])
def test_greedy_matches_hf_on_both_backends(mistral, backend):
    path, ps, ref = mistral
    params = SamplingParams(max_new_tokens=14, ignore_eos=True)
    for cap in (None, 3):  # cap: at most 3 prompt tokens beside running decodes
        engine = build_engine(path, block_size=8, num_blocks=64, max_num_batched_tokens=64, attention_backend=backend,
                              max_prefill_tokens_with_decodes=cap)
        assert engine.attention_backend == backend
        assert engine.generate(ps, params) == ref
        if cap:
            assert engine.stats().extra["num_forwards"] >= (sum(len(p) for p in ps) - 30) / 3


def test_prefill_cap_bounds_prompt_tokens_beside_decodes(mistral):
    path, ps, _ = mistral
    engine = build_engine(path, block_size=8, num_blocks=64, max_num_batched_tokens=64,
                          max_prefill_tokens_with_decodes=5)
    engine.add_request("a", ps[1], SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.step()  # a's prompt (7 tokens, under the budget), no decodes yet: not capped
    engine.add_request("b", ps[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
    batch = engine.scheduler.schedule()
    assert [(s.request_id, n) for s, n in batch.items] == [("a", 1), ("b", 5)]


def test_transposed_lm_head_matches_linear(mistral):
    """The CPU LM head through the cached transposed weight gives F.linear's logits (float32 rounding),
    and a changed weight (in place or replaced) is picked up, not served from the stale copy."""
    from zerospeed.inference.models import layers

    engine = build_engine(mistral[0], num_blocks=8)
    model = engine.model
    big = torch.nn.Linear(64, 3000, bias=False)
    model.lm_head = big
    for rows in (1, 2, layers.LOGITS_TRANSPOSED_MIN_ROWS, 7, 32):
        h = torch.randn(rows, 64)
        torch.testing.assert_close(model.compute_logits(h), torch.nn.functional.linear(h, big.weight),
                                   rtol=1e-5, atol=1e-5)
    h = torch.randn(8, 64)
    with torch.no_grad():
        big.weight.mul_(2.0)  # in place: the version changes
    torch.testing.assert_close(model.compute_logits(h), torch.nn.functional.linear(h, big.weight), rtol=1e-5, atol=1e-5)
    model.lm_head = torch.nn.Linear(64, 3000, bias=False)  # replaced
    torch.testing.assert_close(model.compute_logits(h), torch.nn.functional.linear(h, model.lm_head.weight),
                               rtol=1e-5, atol=1e-5)
    assert "_lm_head_t" not in "".join(model.state_dict())


def test_backend_and_cap_errors(mistral):
    path = mistral[0]
    with pytest.raises(ValueError, match="attention_backend: 'flash' is not one of"):
        build_engine(path, num_blocks=8, attention_backend="flash")
    with pytest.raises(ValueError, match="attention_backend: 'cpu_kernel' needs float32 on CPU"):
        build_engine(path, num_blocks=8, dtype="bf16", attention_backend="cpu_kernel")
    assert build_engine(path, num_blocks=8, dtype="bf16").attention_backend == "torch"
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes: must be an integer >= 1"):
        build_engine(path, num_blocks=8, max_prefill_tokens_with_decodes=0)
