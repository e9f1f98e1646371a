"""Compression composed with tensor parallelism: a tp=2 run (world 2, gloo) equals the tp=1 run.

The tiny random-init HF GPT-2 (Conv1D storage, fused c_attn, tied vocabulary-parallel embedding /
LM head) is compressed, trained 3 optimizer steps through the engine (SGD, lr 0.05, momentum 0.9)
at tp=1 in one process and at tp=2, and compared: the losses, and every floating-point tensor of
the consolidated state dict (weights, biases, masks, topk scores, static ranges), gathered from the
tp shards, per tensor in relative Frobenius norm ``||a - b|| / ||b||``.

Tolerances (fp32):

* methods without activation quantization (weight quantization 8->4 bits / ternary / binary / 3-bit
  asymmetric, with groups that straddle the shards and groups that do not; sparse l1 / topk /
  snip_momentum; row and head pruning, l1 and topk): 1e-5 for losses and tensors (measured <= 1.2e-7
  and <= 7e-7: the shards' partial matmuls and all-reduces sum in another order);
* activation quantization (4-bit dynamic, 6-bit static asymmetric): losses 1e-4, tensors 1e-3.  The
  inputs differ between the runs by that float noise (~1e-7), so an activation lying on a rounding
  boundary of the grid may round the other way (one code, 1/7 of the range at 4 bits); measured
  exactly equal here.  A range left per-shard (the bug this guards against) gives 8e-4 and 9e-2;
* the real DeepSpeedExamples config ``gpt2 W8A8 Qgroup64 fp32`` (Adam, clipping 1.0, 2 micro-batches
  per step): losses 1e-4, tensors 5e-2.  With 8-bit activations one such flip does occur here
  (1 of 16384 inputs of a c_proj at the first step, measured), and Adam turns the small gradient
  change into steps of up to lr on parameters with small gradients (the attention bias moves
  1.9e-2 relative; every other tensor <= 2e-3; the bound leaves room for a few more flips on another
  CPU).  The same run with per-shard activation ranges (the bug): 0.14.

redundancy_clean under tp (each rank keeps its shard, see ``compression/clean.py``): after 2 steps
at tp=2, the cleaned model's logits equal the simulated (fake-quantized, masked) model's within 1e-5
relative to their max (the same codes and scales; measured 1.9e-7 and 0), the pruned rows / heads
are split between the ranks as the full masks say, and the model is smaller; each rank's file from
save_compressed loads into a freshly split model (tp_model_init) and gives the same logits.

torch.compile: the compressed tp2 model (straddling and aligned weight groups, 8-bit activations,
sparse l1, topk rows with the replicated scores' gradient all-reduce, heads) trains through
``engine.compile(backend="eager")`` as one graph: no break, one recompile (the pruning masks are
computed in the first forward), the same collectives per step, losses equal to eager to 1e-6.

ZeRO: tp2 x dp2 (world 4) at ZeRO stages 1, 2 and 3 (static activation ranges reduced over dp and
tp, snip_momentum scores averaged over dp, topk row scores) equals one process (every rank is fed
the same batch, so the data-parallel mean is the one-process gradient): 1e-5 (measured <= 6.1e-7); the static
activation-range case to the activation-quantization tolerances above (losses 1e-4, tensors 1e-3): the tp shards'
partial sums round in another order here too, so an input on a grid boundary may flip (6-bit static grid, 1/63 of
the range). Measured: its losses agree to 6e-7 at AVX512 and to 1.09e-5 under ATEN_CPU_CAPABILITY=default
ONEDNN_MAX_CPU_ISA=SSE41 (make test-isa), where the earlier 1e-5 for every loss failed (issue #25). A range left
per shard gives 8e-4 in the losses (above), still caught.

Checkpoints: a tp2 run saved after 2 of 4 steps (QAT bit schedule, static ranges, snip_momentum
scores, topk scores, head masks) and resumed at tp2, or at tp1 x dp2 (the checkpoint is in full
coordinates), continues with the uninterrupted run's losses (1e-6 relative).

Both orders are covered: init_compression on the whole model then ``initialize`` with
``tensor_parallel.autotp_size: 2`` (initialize splits the compressed model), and DeepSpeed's
``tp_model_init`` then ``init_compression(mpu=<Megatron-style mpu>)``, and init_compression with an
mpu on the whole model (it splits it) then ``initialize(mpu=...)``.
"""

import pytest

from compression_cases import DS_CONFIGS
from compression_tp_cases import METHODS, REAL_CONFIG
from zerospeed.testing import run_distributed

ACT = {"aq", "aq_static"}
CASES = [(name, "config") for name in METHODS] + \
    [(name, "mpu") for name in ("wq", "row_topk", "sparse_topk", "head")] + [("aq", "mpu_unsplit")]
# the DeepSpeedExamples configs live next to the repository (../shared/ds_configs), not in it: a clone
# elsewhere (CI) has no such folder, so the real-config case is its own test and skips, saying so
REAL = DS_CONFIGS / REAL_CONFIG
LAYERS = [f"transformer.h.{i}.{m}" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _tp2_equals_tp1(cases: list) -> list:
    """Train ``cases`` at tp=1 and tp=2 and compare them (tolerances: the module docstring); returns
    the tp=2 ranks' results."""
    from compression_tp_cases import train_cases

    one = run_distributed(train_cases, 1, cases, timeout=200)[0]
    two = run_distributed(train_cases, 2, cases, timeout=200)
    for (name, mode), ref, run, peer in zip(cases, one, two[0], two[1]):
        where = f"{name} ({mode})"
        loss_tol, tensor_tol = (1e-4, 5e-2) if name == "real" else (1e-4, 1e-3) if name in ACT else (1e-5, 1e-5)
        assert ref["sharded"] == [] and run["sharded"] == peer["sharded"], where
        assert run["sharded"] and set(run["sharded"]) <= set(LAYERS), where
        if name in ("wq", "aq", "real"):
            assert run["sharded"] == sorted(LAYERS), where
        assert run["losses"] == peer["losses"], where  # both tp ranks see the same loss
        assert max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref["losses"])) < loss_tol, where
        assert set(run["state"]) == set(ref["state"]), where
        for key, want in ref["state"].items():
            got = run["state"][key]
            assert got.shape == want.shape, f"{where}: {key} {tuple(got.shape)} != {tuple(want.shape)}"
            assert _rel(got, want) < tensor_tol, f"{where}: {key} differs by {_rel(got, want):.2e}"
    return two


@pytest.mark.timeout(240)
def test_tp2_equals_tp1_for_every_method():
    two = _tp2_equals_tp1(CASES)
    # the masks were really computed and kept exactly dense_ratio of the full weight
    sparse = two[0][CASES.index(("sparse", "config"))]["state"]["transformer.h.0.attn.c_attn.sparse_mask"]
    assert sparse.shape == (192, 64) and int(sparse.sum()) == 192 * 64 // 2
    row = two[0][CASES.index(("row", "config"))]["state"]["transformer.h.1.mlp.c_fc.row_mask"]
    assert row.shape == (256,) and int(row.sum()) == 128
    head = two[0][CASES.index(("head", "config"))]["state"]["transformer.h.0.attn.c_proj.head_mask"]
    assert head.tolist().count(1.0) == 2


@pytest.mark.timeout(240)
@pytest.mark.skipif(not REAL.is_file(), reason=f"DeepSpeed example config {REAL} is not in this checkout "
                                              "(../shared/ds_configs)")
def test_tp2_equals_tp1_for_a_real_config():
    _tp2_equals_tp1([("real", "config")])


@pytest.mark.timeout(200)
def test_tp2_x_dp2_under_zero_stages_equals_one_process():
    from compression_tp_cases import train_cases

    cases = [("aq_static", "zero1"), ("sparse_snip", "zero2"), ("row_topk", "zero3")]
    one = run_distributed(train_cases, 1, cases, timeout=150)[0]
    four = run_distributed(train_cases, 4, cases, 2, timeout=150)
    for i, ((name, mode), ref, run) in enumerate(zip(cases, one, four[0])):
        assert run["sharded"] and all(r[i]["losses"] == run["losses"] for r in four), name
        loss_tol, tensor_tol = (1e-4, 1e-3) if name in ACT else (1e-5, 1e-5)  # the module docstring
        assert max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref["losses"])) < loss_tol, name
        for key, want in ref["state"].items():
            assert _rel(run["state"][key], want) < tensor_tol, f"{name} {mode}: {key}"


@pytest.mark.timeout(150)
def test_checkpoint_round_trip_at_tp2_and_resharded_to_tp1(tmp_path):
    from compression_tp_cases import checkpoint_round_trip

    for r in run_distributed(checkpoint_round_trip, 2, str(tmp_path), timeout=130):
        for key in ("tp2", "tp1"):
            assert max(abs(a - b) / abs(b) for a, b in zip(r[key], r["straight"])) < 1e-6, (key, r)


@pytest.mark.timeout(120)
def test_bad_inputs_under_tensor_parallelism():
    from compression_tp_cases import bad_inputs

    for errors in run_distributed(bad_inputs, 2, timeout=100):
        assert errors["mpu"] == (
            "TypeError: init_compression: mpu (NoRank) has no get_model_parallel_rank() (nor "
            "get_tensor_model_parallel_rank()); an mpu needs get_model_parallel_group, get_model_parallel_world_size "
            "and get_model_parallel_rank, or pass zerospeed's mesh (zerospeed.comm.get_mesh())"), errors["mpu"]
        assert errors["groups"].startswith(
            "ConfigError: zerospeed config: compression_training.weight_quantization.shared_parameters.quantize_groups: "
            "transformer.h.0.mlp.c_fc (the full weight; tensor parallelism splits it over 2 ranks): quantize_groups 3 "
            "does not divide its 16384 weights"), errors["groups"]
        assert errors["lm_head"].startswith(
            "ConfigError: zerospeed config: compression_training.weight_quantization.different_groups.wq1.modules: "
            "['lm_head', 'mlp.c_fc'] match lm_head, a vocabulary-parallel LmHeadLayer under tensor parallelism"), \
            errors["lm_head"]
        assert errors["other_mpu"].startswith(
            "ValueError: init_compression: transformer.wte is split over a tensor-parallel group of 2 ranks (rank "), \
            errors["other_mpu"]
        assert errors["other_mpu"].endswith("other than the mpu's (1 ranks, rank 0)"), errors["other_mpu"]
        assert errors["ptq"].startswith(
            "ValueError: quantize: transformer.h.0.mlp.c_fc is a tensor-parallel layer (AutoTP); post-training "
            "quantization of a split model is not supported"), errors["ptq"]
        assert errors["clean_mpu"] == (
            "ValueError: redundancy_clean: the mpu has 2 tensor-parallel ranks but the model is not split; clean the "
            "model it trained (split by initialize / tp_model_init), or pass mpu=None"), errors["clean_mpu"]


@pytest.mark.timeout(120)
def test_redundancy_clean_keeps_each_ranks_shard_and_equals_the_simulated_model(tmp_path):
    from compression_tp_cases import CLEAN, clean_cases

    names = list(CLEAN)
    ranks = run_distributed(clean_cases, 2, names, str(tmp_path), timeout=100)
    for i, name in enumerate(names):
        runs = [r[i] for r in ranks]
        for run in runs:
            assert run["err"] < 1e-5, f"{name}: cleaned vs simulated {run['err']:.2e}"
            assert run["types"]["mlp.c_fc"] == run["types"]["mlp.c_proj"] == "TPCleanedLinear", name
            assert run["c_proj_in"] == run["c_fc_out"], name  # c_proj lost the input columns c_fc lost rows
            assert run["reloaded_err"] == 0.0, name  # save_compressed / load_compressed per rank: the same model
        # 50% of c_fc's 256 rows, wherever they were
        assert sum(r["c_fc_out"] for r in runs) == 128, name
    mixed, asym = [r[0] for r in ranks], [r[1] for r in ranks]
    assert sum(r["heads"] for r in mixed) == 3 and all(r["split_size"] == 16 * r["heads"] for r in mixed)
    assert all(r["after"] < 0.2 * r["before"] for r in mixed)  # 4-bit codes, half the MLP, a quarter of the heads
    assert all(set(r["types"].values()) >= {"TPCleanedLinear"} and r["types"]["attn.c_attn"] == "TPCleanedLinear"
               for r in mixed)
    assert all(r["types"]["attn.c_attn"] == "LinearLayer" and r["heads"] == 2 for r in asym)  # left alone
    assert all(r["after"] < 0.6 * r["before"] for r in asym)


@pytest.mark.timeout(240)
def test_compressed_tp_model_compiles_as_one_graph():
    from compression_tp_cases import eager_vs_compiled

    for r in run_distributed(eager_vs_compiled, 2, timeout=220):
        eager, compiled = r["none"], r["eager"]
        assert max(abs(a - b) / abs(b) for a, b in zip(compiled["losses"], eager["losses"])) < 1e-6
        assert compiled["calls"] == eager["calls"] and compiled["calls"][1]["all_gather"] > 0
        rep = compiled["report"]
        assert rep["graph_breaks"] == 0 and rep["recompiles"] == 1, str(rep)
        assert rep["graphs"] == rep["frames_compiled"] == 2, str(rep)
        assert "refresh" in rep["recompile_reasons"][0]


def test_shard_rows_and_columns_match_the_split():
    """TPShard's global row / column of each local canonical row / column equals the split's own
    arithmetic (a full index tensor cut by local_piece), for plain, fused and Conv1D splits."""
    import torch

    from zerospeed.compression.tp import TPShard
    from zerospeed.module_inject import LinearAllreduce, LinearLayer, TPSplit, local_piece

    cases = [  # (storage shape, split dim, sub sizes, transposed, row-parallel)
        ((12, 5), 0, (12,), False, False),        # column Linear
        ((5, 12), 1, (4, 4, 4), True, False),     # GPT-2 c_attn: Conv1D [in, out], q/k/v fused
        ((8, 6), 0, (8,), True, True),            # row-parallel Conv1D: input dim is storage dim 0
        ((6, 8), 1, (8,), False, True),           # row-parallel Linear
        ((12, 5), 0, (6, 2, 4), False, False),    # GQA-like unequal sub-projections
    ]
    for shape, dim, subs, transposed, row in cases:
        for rank in range(2):
            split = TPSplit(shape, dim, subs, 2)
            weight = torch.randn(shape)
            cls = LinearAllreduce if row else LinearLayer
            args = (weight, None, split, None, 2, rank) if row else (weight, None, split, None, None, 2, rank)
            shard = TPShard.of(cls(*args, transposed=transposed), "layer")
            canon = shape[::-1] if transposed else shape
            index = torch.arange(canon[0] * canon[1]).view(canon)
            local = local_piece(index.t().contiguous() if transposed else index, split, rank)
            local = local.t() if transposed else local
            assert torch.equal(shard.flat_index(), local), (shape, dim, subs, rank)
            assert shard.kind == ("row" if row else "column")
