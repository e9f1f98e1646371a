"""engine.generate at ZeRO-3 (issue #32): HF's greedy tokens on the gathered model, all-gathers counted per
rollout batch, the rollout's extra memory bounded by counted bytes, the streamed mode's resident-layer bound,
LoRA applied at rollout time, n samples and seeds, bad input."""

from __future__ import annotations

import pytest

from rl_cases import release_case, rollout_case, sampling_case
from zerospeed.testing import run_distributed

pytestmark = pytest.mark.timeout(600)  # each run_distributed has its own, shorter limit


def _check_greedy(r: dict) -> None:
    for tokens, (hf, decided) in zip(r["tokens"], r["hf"]):
        assert decided >= 3, "too few tokens decided by the arithmetic for a meaningful check"
        assert tokens[:decided] == hf[:decided]
    assert r["again"] == r["tokens"] == r["inside_gathered"]
    assert r["shards_unchanged"]  # the rollout only reads the ZeRO-3 shards
    # after one more training step the rollout follows the new weights
    for tokens, (hf, decided) in zip(r["after_step"], r["hf_after_step"]):
        assert decided >= 3
        assert tokens[:decided] == hf[:decided]


@pytest.mark.parametrize("world", [1, 2])
def test_generate_zero3_greedy_equals_hf_and_one_pass(world: int) -> None:
    for r in run_distributed(rollout_case, world, timeout=240):
        _check_greedy(r)
        # one pass over the buckets per rollout batch, not one per forward: every bucket gathered exactly once
        assert r["num_forwards"] >= 10
        assert r["all_gathers"] == len(r["bucket_numels"]) == r["num_gathers"]
        assert r["gather_elements"] == sum(r["bucket_numels"])
        # extra memory: the rollout copy (all layers + embeddings/head) + the KV cache, and while filling, at most
        # the buckets one copy job needs (a job reads one or three HF tensors; they sit in at most two buckets)
        # The weights that are contiguous ranges of the buckets (embeddings, LM head, fused gate/up, down, QKV
        # where adjacent) are views of one gathered arena (rl/arena.py): the copy's bytes counted once, plus the
        # arena's bytes no weight uses, which here are the buckets' padding only
        arena = r["arena"]
        # every weight of the 2-layer llama aliases: embeddings, LM head, final norm, and per layer two norms, QKV
        # (q, k, v adjacent in the buckets), o, gate_up, down
        assert arena is not None and arena["aliased"] == 3 + 6 * 2
        assert arena["extra_bytes"] == arena["padding_bytes"] <= arena["buckets"] * (world - 1) * 4
        copy_bytes = sum(r["layer_bytes"]) + r["other_weight_bytes"]
        assert r["weight_bytes_peak"] == copy_bytes + arena["extra_bytes"]
        assert r["live_peak_bytes"] <= 2 * max(r["bucket_bytes"])
        assert r["kv_cache_bytes"] > 0
        assert r["resident_after"] == copy_bytes + arena["extra_bytes"]  # pin_parameters keeps the copy


def test_generate_zero3_plain_copy_twin() -> None:
    """hybrid_engine.alias_weights: false, the plain twin of the arena: every weight copied from the gathered
    buckets, which are released at once; the same checks, the copy's bytes exactly."""
    for r in run_distributed(rollout_case, 2, alias_weights=False, timeout=240):
        _check_greedy(r)
        assert r["arena"] is None
        assert r["all_gathers"] == len(r["bucket_numels"]) == r["num_gathers"]
        copy_bytes = sum(r["layer_bytes"]) + r["other_weight_bytes"]
        assert r["weight_bytes_peak"] == copy_bytes == r["resident_after"]
        assert r["live_peak_bytes"] <= 2 * max(r["bucket_bytes"])


def test_generate_streamed_bounded_resident_layers() -> None:
    for r in run_distributed(rollout_case, 2, 1, timeout=240):
        _check_greedy(r)
        assert r["max_resident_layers_seen"] == 1
        assert r["weight_bytes_peak"] <= max(r["layer_bytes"]) + r["other_weight_bytes"]
        # every layer is gathered again for every forward (bounded residency costs gathers)
        assert r["all_gathers"] > len(r["bucket_numels"])
        assert r["resident_after"] == r["other_weight_bytes"]


def test_generate_lora_applied_without_merging() -> None:
    for r in run_distributed(rollout_case, 2, 0, True, timeout=240):
        _check_greedy(r)  # HF greedy on the merged model; the shards (base weights) unchanged
        assert r["tokens"] != r["hf_without_lora"]  # the adapters matter on this model: they were applied


def test_generate_n_seeds_and_bad_input() -> None:
    r = run_distributed(sampling_case, 2, timeout=240)[0]
    assert len(r["a"]) == 6 and all(len(t) == 8 for t in r["a"])
    assert r["a"][3:] == r["b"]  # a prompt's samples depend on its seed only, not on the other requests
    assert r["a"][:3] == r["c"][:3] and r["a"][3:] != r["c"][3:]
    assert r["a"] == r["d"]
    assert len({tuple(t) for t in r["a"][:3]}) > 1  # n samples differ
    joined = "\n".join(r["errors"])
    assert "n: must be an integer >= 1" in joined
    assert "seeds: 3 seeds for 2 prompts" in joined
    assert "bogus: is not a sampling parameter" in joined
    assert "prompts: must be a list" in joined


def test_release_inference_cache_and_unpinned_parameters() -> None:
    r = run_distributed(release_case, 1, timeout=120)[0]
    assert r["a"] == r["b"]  # re-allocated and refilled next call
    assert r["kv_after"] == 0 and r["kv"] > 0
    assert r["resident_after"] == 0 and r["peak"] > 0


@pytest.mark.parametrize("hybrid,key", [({"inference_tp_size": 2}, "hybrid_engine.inference_tp_size"),
                                        ({"max_resident_layers": 3}, "hybrid_engine.max_resident_layers"),
                                        ({"max_out_tokens": 300}, "hybrid_engine.max_out_tokens")])
def test_hybrid_engine_config_errors(hybrid: dict, key: str) -> None:
    from rl_cases import bad_config_case

    message = run_distributed(bad_config_case, 1, hybrid, timeout=120)[0]
    assert message.startswith(f"zerospeed config: {key}:"), message


@pytest.mark.parametrize("stage,world", [(0, 2), (3, 2), (3, 4)])
def test_generate_on_the_training_tp_layout(stage: int, world: int) -> None:
    """AutoTP tp 2 (x ZeRO-3 dp 2 at world 4): each TP rank's rollout copy holds its own training pieces (half the
    q/k/v rows), the TP ranks run one generation together (row-parallel all-reduces in every forward) and every
    rank gets HF's greedy tokens on the TP-merged model, to the tokens the arithmetic decides."""
    from rl_cases import tp_rollout_case

    results = run_distributed(tp_rollout_case, world, stage, timeout=600)
    for r in results:
        assert r["qkv_rows"] * 2 == r["full_qkv_rows"]  # this rank's share, not a resharded whole
        assert r["all_reduces"] >= 2 * r["num_layers"] * r["num_forwards"] > 0  # o and down in every forward
        for tokens, (hf, decided) in zip(r["tokens"], r["hf"]):
            assert decided >= 1 and tokens[:decided] == hf[:decided], (tokens, hf, decided)
        assert r["again"] == r["tokens"]
        # at ZeRO-3 the pieces alias the gathered arena (every weight but the vocabulary-split LM head assembled
        # over TP: embeddings, final norm, and per layer two norms, QKV, o, gate_up, down); no buckets at stage 0
        assert r["arena_aliased"] == (2 + 6 * r["num_layers"] if stage == 3 else 0), r["arena_aliased"]
    by_dp = {}
    for r in results:  # the TP ranks of a dp rank return the same rollout
        by_dp.setdefault(r["dp_rank"], []).append(r["tokens"])
    assert all(len(v) == 2 and v[0] == v[1] for v in by_dp.values())


@pytest.mark.parametrize("hybrid,family,key", [
    ({"inference_tp_size": 1}, "llama", "hybrid_engine.inference_tp_size: 1: rollouts run on the training"),
    ({"inference_tp_size": 2, "max_resident_layers": 1}, "llama", "hybrid_engine.max_resident_layers: 1: streamed"),
    ({"inference_tp_size": 2}, "gpt2", "hybrid_engine.inference_tp_size: rollouts under tensor parallelism are built "
                                       "for the llama family"),
])
def test_tensor_parallel_rollouts_refused(hybrid: dict, family: str, key: str) -> None:
    from rl_cases import tp_refused_case

    message = run_distributed(tp_refused_case, 2, hybrid, family, timeout=180)[0]
    assert message.startswith("zerospeed config: " + key) and "\n" not in message, message


def test_tensor_parallel_ranks_must_ask_for_one_rollout() -> None:
    from rl_cases import tp_mismatched_prompts_case

    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    errors = run_distributed(tp_mismatched_prompts_case, 2, port, timeout=180)
    assert errors[0] == errors[1], errors
    generate, sync = errors[0]
    assert "tensor-parallel ranks [1] asked for another rollout" in generate, generate
    assert sync.startswith(f"WeightSyncError: sync_weights: no generator server at 127.0.0.1:{port}"), sync


def test_hybrid_engine_off_keeps_hf_generate() -> None:
    from rl_cases import hybrid_off_case

    r = run_distributed(hybrid_off_case, 1, timeout=120)[0]
    assert r == {"is_tensor": True, "shape": (1, 10), "rl_enabled": False}


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_generate_other_families(family: str) -> None:
    """GPT-2 (Conv1D weights, tied head, causal-mask buffers) and Qwen2 (QKV biases) read from the shards."""
    for r in run_distributed(rollout_case, 2, 0, False, 10, family, timeout=240):
        _check_greedy(r)
        assert r["all_gathers"] == len(r["bucket_numels"])
