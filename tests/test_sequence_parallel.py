"""Ulysses sequence parallelism and ALST (issue #29): attention, HF training parity with ZeRO, the data adapter,
and bad input. Rank bodies and the tolerance argument: tests/sp_cases.py."""

from __future__ import annotations

import pytest

from zerospeed.testing import run_distributed

import sp_cases
from sp_cases import RTOL



@pytest.mark.parametrize("sp,heads,kv_heads", [(2, 4, 4), (4, 8, 2), (2, 4, 1), (4, 4, 1)])
def test_distributed_attention_equals_full_attention(sp, heads, kv_heads):
    # (4, 8, 2): fewer KV heads than ranks, each sent to two; (2, 4, 1) and (4, 4, 1): multi-query (the KV
    # gradient sums 2 and 4 ranks' copies)
    results = run_distributed(sp_cases.attention_body, sp, sp, heads, kv_heads, timeout=120)
    for r in results:
        assert r["out"] <= RTOL and max(r["grads"]) <= RTOL, r
        assert r["forward_a2a"] == 2 and r["total_a2a"] == 4  # q, k, v packed, and the output; their adjoints


def _check_parity(results, sp_dp_size):
    for r in results:
        for run in r["runs"]:
            assert run["sp_dp_size"] == sp_dp_size, run
            for got, ref in zip(run["losses"], run["ref_losses"]):
                assert abs(got - ref) <= RTOL * abs(ref), run
    rank0 = results[0]["runs"]
    assert all(run["excess"] <= 0 for run in rank0), rank0


def test_llama_gqa_sp2_zero123_equals_one_process():
    results = run_distributed(sp_cases.parity_body, 2, "llama", 2, [1, 2, 3], ["all_gather", "all_reduce", "all_gather"],
                              timeout=240)
    _check_parity(results, 2)


def test_qwen2_sp2_zero3_with_checkpointing_and_tiled_mlp_equals_one_process():
    # multi-query (1 KV head, repeated to 2), activation checkpointing with cpu_checkpointing on, TiledMLP (3 tiles
    # of the 8-token shards) under ZeRO-3 (each parameter's gradient accumulated once per backward)
    results = run_distributed(sp_cases.parity_body, 2, "qwen2", 2, [3, 2], ["all_reduce", "all_gather"], 2, 16, True,
                              3, timeout=240)
    _check_parity(results, 2)
    _check_offloaded_checkpoints(results, 16 // 2)


def _check_offloaded_checkpoints(results, shard):
    # 2 layers x 2 steps checkpointed through the host-offload path, each holding this rank's shard of the hidden
    # states only (the full sequence is 2 x shard)
    for r in results:
        for run in r["runs"]:
            assert run["checkpoints"] >= 2 * 2 and len(run["held_seq"]) == run["checkpoints"], run
            assert set(run["held_seq"]) == {shard}, run


def test_llama_sp4_equals_one_process():
    results = run_distributed(sp_cases.parity_body, 4, "llama", 4, [2], ["all_gather"], timeout=300)
    _check_parity(results, 4)


def test_llama_sp2_dp2_zero123_equals_one_process():
    results = run_distributed(sp_cases.parity_body, 4, "llama", 2, [1, 2, 3], ["all_gather", "all_reduce", "all_gather"],
                              timeout=400)
    _check_parity(results, 4)


def test_qwen2_sp2_dp2_zero123_with_offloaded_checkpoints_equals_one_process():
    # host offload of the checkpoints from the engine config (activation_checkpointing.cpu_checkpointing); on CPU
    # the offloaded inputs stay where they are, so what is checked is the path: the store holds them
    results = run_distributed(sp_cases.parity_body, 4, "qwen2", 2, [1, 2, 3], ["all_reduce", "all_gather", "all_reduce"],
                              2, 16, "config", timeout=400)
    _check_parity(results, 4)
    _check_offloaded_checkpoints(results, 16 // 2)


def test_qwen2_sp4_equals_one_process():
    # one KV head repeated to the 4 ranks
    results = run_distributed(sp_cases.parity_body, 4, "qwen2", 4, [1, 3], ["all_gather", "all_reduce"], timeout=300)
    _check_parity(results, 4)


def test_adapter_exchanges_batches_as_deepspeed_does():
    for r in run_distributed(sp_cases.exchange_body, 2, 2, timeout=60):
        assert r["same"] and r["n"] == 4, r


def test_bad_input_is_one_line_naming_it():
    for r in run_distributed(sp_cases.errors_body, 2, 2, timeout=120):
        assert "3 attention heads do not divide by sequence_parallel_size 2" in r["q_heads"]
        assert "3 key/value heads" in r["kv_heads"]
        assert "3 key/value heads" in r["hf_heads"] and "attention heads 6" in r["hf_heads"]
        assert "world size 2 is not divisible by pp=1 x sp=4 x tp=1" in r["world"]
        assert "world size 2 is not divisible by pp=1 x sp=4 x tp=1" in r["register_world"]
        assert "sequence_parallel_size 2 with tensor_parallel.autotp_size 2" in r["tp"]
        assert "sequence length 15 is not divisible by sequence_parallel_size 2" in r["uneven"]
        assert all("\n" not in v for v in r.values() if v)


def test_registration_refuses_what_it_cannot_hook():
    import torch
    from torch import nn

    from zerospeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from zerospeed.sequence.layer import SequenceParallelError

    assert UlyssesSPAttentionHF.register_with_transformers(sp_cases.llama(), "sdpa", 1, 1) is None  # sp 1: nothing

    class OwnAttention(nn.Module):  # attention of its own: nothing in transformers' table to replace
        def __init__(self):
            super().__init__()
            self.config = sp_cases.llama().config
            self.attn = nn.MultiheadAttention(32, 4)

        def forward(self, x):
            return self.attn(x, x, x)[0]

    with pytest.raises(SequenceParallelError, match="OwnAttention has no attention module that dispatches"):
        UlyssesSPAttentionHF.register_with_transformers(OwnAttention(), "sdpa", 2, 1)
    with pytest.raises(SequenceParallelError, match="'eager' cannot be hooked"):
        UlyssesSPAttentionHF.register_with_transformers(sp_cases.llama(attn_implementation="eager"), "eager", 2, 1)
    with pytest.raises(SequenceParallelError, match="the model's config uses 'sdpa'"):
        UlyssesSPAttentionHF.register_with_transformers(sp_cases.llama(), "flex_attention", 2, 1)
    with pytest.raises(SequenceParallelError, match="torch.distributed is not initialised"):
        UlyssesSPAttentionHF.register_with_transformers(sp_cases.llama(), "sdpa", 2, 1)
    del torch


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_saved_at_sp2_resumes_at_sp1_and_sp4(tmp_path, stage):
    import json

    saved = run_distributed(sp_cases.checkpoint_save_body, 2, str(tmp_path), 2, stage, timeout=180)[0]
    index = json.loads((tmp_path / "sp" / "index.json").read_text())
    # the layout: the config's sp degree, and the dp x sp ranks the ZeRO shards were written by
    assert index["config"]["sequence_parallel_size"] == 2 and index["world_size"] == 2
    for sp in (1, 4):
        resumed = run_distributed(sp_cases.checkpoint_load_body, sp, str(tmp_path), sp, stage, timeout=240)[0]
        for got, ref in zip(resumed["losses"], saved["losses"]):
            assert abs(got - ref) <= RTOL * abs(ref), (sp, resumed["losses"], saved["losses"])
        for name, ref in saved["state"].items():
            assert sp_cases.rel(resumed["state"][name], ref) <= RTOL, (sp, name)


def test_deepspeed_alst_tutorial_runs_with_its_imports_changed():
    # the tutorial's plain DataLoader gives both sp ranks the same two samples; the adapter (as DeepSpeed's) then
    # processes rank 0's and rank 1's copy in turn: 4 micro-steps (sample 0 twice, then sample 1 twice), the first
    # on the untouched model
    for r in run_distributed(sp_cases.tutorial_body, 2, timeout=180):
        assert len(r["losses"]) == 4
        assert abs(r["losses"][0] - r["ref_first"]) <= RTOL * r["ref_first"], r
        assert r["losses"][1] < r["losses"][0]  # one Adam step (lr 1e-3) on that same sample lowers its loss


def test_initialize_loader_gives_an_sp_group_the_same_samples():
    import torch

    results = run_distributed(sp_cases.loader_body, 4, 2, timeout=180)  # sp 2 x dp 2
    by_dp = {}
    for r in results:
        by_dp.setdefault(r["dp_rank"], []).append(r)
    assert sorted(by_dp) == [0, 1] and all(len(v) == 2 for v in by_dp.values())
    for group in by_dp.values():
        assert torch.equal(group[0]["ids"], group[1]["ids"])  # the same samples on both sp ranks
        for r in group:  # one micro-batch per batch: this rank's half of each sample, nothing exchanged
            assert r["len"] == len(r["ids"]) == len(r["shards"])
            assert all(torch.equal(s[0], full[8 * r["sp_rank"]:8 * (r["sp_rank"] + 1)])
                       for s, full in zip(r["shards"], r["ids"]))
    assert not torch.equal(by_dp[0][0]["ids"], by_dp[1][0]["ids"])  # the dp groups read different samples
