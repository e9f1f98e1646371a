"""Pipeline engine: every schedule against a single-process reference, plus bad input and eval.

Parity (fp32, 1e-5 relative on losses, on the eval loss after training and on every weight
tensor: max abs error over the tensor's max abs value): for each schedule -- GPipe, 1F1B,
interleaved 1F1B (2 virtual stages per rank), ZB-H1 -- on 2 stages (world 2), 4 stages (world 4)
and 2 stages x 2 data-parallel replicas with ZeRO-1 (world 4). The model has a weight tied between
the first and the last layer (so between the first and the last stage), and gradient clipping
is on, so the tied gradient sum and the global norm (tied weight counted once) are both checked.
1F1B and ZB-H1 run with activation checkpointing (interval 1). All schedules of one topology run
one after another in the same process group, to pay process start-up once.

The world-2 fixture runs the bad-input cases, eval_batch's variants, the training_data loader path
and 16-bit runs (bf16 and fp16 with loss scaling; ZB-H1 + ZeRO-1; held to the fp32 reference at
3e-2 on losses and 5e-2 on weights, with a 10x smaller lr so Adam does not turn 16-bit noise in
near-zero gradients into full-size steps) in one process group.
"""
import pytest
import torch

from pipe_cases import (GLOBAL_BATCH, LR_16BIT, STEPS, config, max_rel_err, pipeline_run, pipeline_runs,
                        reference_eval, reference_run, world2_cases)
from zerospeed.testing import run_distributed

FP32_TOL = 1e-5
GAS = 4
EVAL_STEP = 7
# (schedule, virtual stages per rank, activation checkpoint interval)
SCHEDULES = [("gpipe", 1, 0), ("1f1b", 1, 1), ("interleaved_1f1b", 2, 0), ("zero_bubble", 1, 1)]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,stages,zero", [(2, 2, 0), (4, 4, 0), (4, 2, 1)],
                         ids=["pp2", "pp4", "pp2xdp2-zero1"])
def test_every_schedule_matches_single_process_reference(world, stages, zero):
    ref = reference_run(GAS, world // stages, eval_step=EVAL_STEP)
    cases = [(config(name, GAS, zero=zero, virtual=v, ckpt=ckpt), stages) for name, v, ckpt in SCHEDULES]
    runs = run_distributed(pipeline_runs, world, cases, eval_step=EVAL_STEP, timeout=200)
    for i, (name, _, _) in enumerate(SCHEDULES):
        seen = set()
        for rank, per_rank in enumerate(runs):
            r = per_rank[i]
            where = f"{name}, rank {rank}"
            assert r["global_steps"] == STEPS, where
            assert max(_rel(a, b) for a, b in zip(r["losses"], ref["losses"])) < FP32_TOL, where
            assert _rel(r["eval_loss"], ref["eval_loss"]) < FP32_TOL, where
            assert max_rel_err(r["weights"], ref["weights"]) < FP32_TOL, where
            for key, copy in r["weights"].items():  # every copy of the tied weight, not only the counted one
                if key.startswith("tied/") and key.endswith("weight"):
                    name_in_ref = key.split("/", 2)[2]
                    assert max_rel_err({name_in_ref: copy}, ref["weights"]) < FP32_TOL, f"{where}: {key}"
            seen.update(k for k in r["weights"] if not k.startswith("tied/"))
        assert seen == set(ref["weights"]), name  # the stages together hold every parameter


@pytest.mark.timeout(120)
def test_interleaved_on_one_rank_hands_over_locally():
    """4 virtual stages on a single rank: activations, gradients and the tied sum stay local."""
    ref = reference_run(GAS, 1, eval_step=EVAL_STEP)
    r = run_distributed(pipeline_run, 1, config("interleaved_1f1b", GAS, virtual=4), 1, eval_step=EVAL_STEP,
                        timeout=100)[0]
    assert max(_rel(a, b) for a, b in zip(r["losses"], ref["losses"])) < FP32_TOL
    assert max_rel_err(r["weights"], ref["weights"]) < FP32_TOL
    assert _rel(r["eval_loss"], ref["eval_loss"]) < FP32_TOL


@pytest.fixture(scope="module")
def world2():
    return run_distributed(world2_cases, 2, timeout=100)


@pytest.mark.timeout(120)
def test_bad_input_gives_the_same_clear_error_on_every_rank(world2):
    errors = [r["errors"] for r in world2]
    assert errors[0] == errors[1]  # never one rank raising while its peer waits
    e = errors[0]
    assert e["stages_not_dividing_world"][0] == "ValueError" and "not divisible by 3" in e["stages_not_dividing_world"][1]
    assert e["more_stages_than_layers"][0] == "ValueError" and "1 layers" in e["more_stages_than_layers"][1]
    assert "4 stages, more than the 3 layers" in e["virtual_stages_than_layers"][1]
    kind, msg = e["stage_without_parameters"]  # found on rank 1 alone, raised on both
    assert kind == "PipelineSetupError" and "rank 1" in msg and "no trainable parameters" in msg
    assert e["batch_not_divisible"][0] == "ConfigError" and "train_batch_size: 15" in e["batch_not_divisible"][1]
    assert e["interleaved_microbatches"][0] == "ConfigError"
    assert "gradient_accumulation_steps: 3" in e["interleaved_microbatches"][1]
    assert e["zero_stage_2"][0] == "ConfigError" and "zero_optimization.stage" in e["zero_stage_2"][1]
    assert e["stages_config_mismatch"][0] == "ConfigError" and "pipeline.stages" in e["stages_config_mismatch"][1]
    kind, msg = e["shape_mismatch"]  # raised by the start-up handshake, before any weight changed
    assert kind == "PipelineSetupError"
    assert "stage 1" in msg and "from stage 0, (4, 8) float32" in msg and "4x8 and 5x6" in msg
    assert e["missing_data_iter"][0] == "PipelineSetupError" and "this rank got None" in e["missing_data_iter"][1]
    assert e["non_scalar_loss"][0] == "PipelineSetupError" and "scalar loss" in e["non_scalar_loss"][1]
    assert e["engine_call"][0] == "PipelineError" and "train_batch" in e["engine_call"][1]
    assert e["dynamic_shape"] == ("ok", "")


@pytest.mark.timeout(120)
def test_eval_batch_variants(world2):
    ref_loss, ref_out = reference_eval(5)
    first, last = world2[0]["eval"], world2[1]["eval"]
    for r in (first, last):
        assert _rel(r["loss"], ref_loss) < FP32_TOL  # broadcast to every stage
        assert r["global_steps"] == 0 and r["training"]  # eval changes nothing, restores train mode
    assert first["logits"] is None and first["per_microbatch"] is None and first["outputs"] is None
    assert first["not_broadcast"] is None
    assert torch.allclose(last["logits"], ref_out, rtol=FP32_TOL, atol=1e-6)
    assert last["logits"].shape == (GLOBAL_BATCH, 6)
    assert len(last["per_microbatch"]) == GAS
    assert _rel(float(torch.stack(last["per_microbatch"]).mean()), ref_loss) < FP32_TOL
    assert torch.allclose(torch.cat(last["outputs"]), ref_out, rtol=FP32_TOL, atol=1e-6)
    assert _rel(float(last["not_broadcast"]), ref_loss) < FP32_TOL


@pytest.mark.timeout(120)
def test_training_data_loader_feeds_train_batch(world2):
    for r in world2:
        loader = r["loader"]
        assert loader["global_steps"] == 3 and loader["loader_len"] == 4  # 16 samples / micro-batch 4
        assert all(torch.isfinite(torch.tensor(loader["losses"])))
    assert world2[0]["loader"]["losses"] == world2[1]["loader"]["losses"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16bit_tracks_fp32_reference(world2, precision):
    """ZB-H1 with ZeRO-1 in bf16 / fp16 (loss scaling) stays within 16-bit rounding of fp32."""
    ref = reference_run(GAS, 1, lr=LR_16BIT)
    for r in world2:
        got = r[precision]
        assert max(_rel(a, b) for a, b in zip(got["losses"], ref["losses"])) < 3e-2
        assert max_rel_err(got["weights"], ref["weights"]) < 5e-2
