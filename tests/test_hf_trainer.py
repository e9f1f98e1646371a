"""The HF Trainer on zerospeed: ``ZeroSpeedTrainer`` with a DeepSpeed JSON full of HF ``"auto"`` values.

One launch of 2 gloo ranks runs, on a random tiny Llama and an in-memory dataset (4 optimizer steps,
micro batch 2 per rank, accumulation 2, clipping at 1.0, warmup then constant lr, weight decay on
HF's groups): the plain ``Trainer`` (DDP over gloo) as the reference, then ``ZeroSpeedTrainer`` at
ZeRO-2 and ZeRO-3 (HF's optimizer and scheduler), at ZeRO-3 on a model built under ``zero.Init``, and at ZeRO-3 with the config's own optimizer
and WarmupLR scheduler sections. Each ZeRO-3 run also resumes from ``checkpoint-2`` in a fresh
trainer and trains to the end again.

Tolerances: fp32 losses and gradient norms within 1e-5 relative of the plain Trainer (the sums run
in a different order: measured ~1e-7); a resumed run repeats the uninterrupted run's last losses and
final logits to 1e-6; ``trainer.evaluate()`` after training gives the plain Trainer's eval loss to
1e-5; ``save_model`` writes a folder whose ``from_pretrained`` logits equal the trained
engine's exactly.
"""

import pytest
import torch

from hf_cases import batch, trainer_body
from zerospeed.testing import run_distributed

RUNS = [("plain", "plain", None, False), ("z2", "zs", 2, False), ("z3", "zs", 3, False),
        ("z3_init", "zs_init", 3, False), ("z3_sections", "zs", 3, True)]
TOL = 1e-5


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.timeout(240)
def test_zerospeed_trainer_matches_the_plain_trainer_saves_and_resumes(tmp_path):
    from transformers import LlamaForCausalLM

    results = run_distributed(trainer_body, 2, str(tmp_path), RUNS, timeout=230)
    r0 = results[0]
    plain = r0["plain"]
    assert len(plain["losses"]) == 4
    for name in ("z2", "z3", "z3_init"):
        run = r0[name]
        assert run["engine_stage"] == int(name[1])
        assert _rel(run["losses"], plain["losses"]) < TOL, (name, run["losses"], plain["losses"])
        assert _rel(run["grad_norms"], plain["grad_norms"]) < TOL, name
        assert (run["logits"] - plain["logits"]).abs().max() < 1e-4, name
        assert abs(run["eval_loss"] - plain["eval_loss"]) < TOL * plain["eval_loss"], name  # trainer.evaluate()
    sections = r0["z3_sections"]
    assert sections["losses"][:2] == pytest.approx(plain["losses"][:2], rel=TOL)  # same lr until warmup differs
    assert sections["lr"] == [2e-3, 2e-3]  # WarmupLR filled from learning_rate, warmup steps done
    for name in ("z3", "z3_sections"):
        run = r0[name]
        assert run["resumed_step"] == 4
        assert run["resumed_losses"][2:] == pytest.approx(run["losses"][2:], rel=1e-6), name
        assert torch.allclose(run["resumed_logits"], run["logits"], rtol=0, atol=1e-6), name
    for name in ("z2", "z3", "z3_init", "z3_sections"):
        run = r0[name]
        model = LlamaForCausalLM.from_pretrained(tmp_path / name / "final")
        with torch.no_grad():
            loaded = model(input_ids=batch(9, n=2)).logits.float()
        assert torch.equal(loaded, run["logits"]), name
        assert (tmp_path / name / "checkpoint-2" / "zerospeed").is_dir()
    for r in results:  # an epoch that ends inside an accumulation window is refused on every rank
        assert "not a multiple" in r["misaligned"] and "gradient_accumulation_steps (2)" in r["misaligned"]
    for r in results[1:]:  # every rank saw the same losses
        assert r["z3"]["losses"] == r0["z3"]["losses"]


def test_auto_values_are_filled_and_contradictions_refused():
    from transformers import TrainingArguments

    from hf_cases import trainer_ds_config
    from zerospeed.config import ConfigError, load_config
    from zerospeed.integrations.hf_auto import fill_auto

    args = TrainingArguments(output_dir="unused", per_device_train_batch_size=3, gradient_accumulation_steps=2,
                             learning_rate=5e-4, max_grad_norm=0.5, bf16=True, use_cpu=True, report_to=[],
                             warmup_steps=7)
    cfg = fill_auto(trainer_ds_config(3, with_sections=True), args, max_steps=100, world_size=2, hidden_size=64)
    assert cfg["train_batch_size"] == 12 and cfg["train_micro_batch_size_per_gpu"] == 3
    assert cfg["gradient_clipping"] == 0.5 and cfg["bf16"]["enabled"] is True
    assert cfg["optimizer"]["params"] == {"lr": 5e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    assert cfg["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 5e-4, "warmup_num_steps": 7}
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 640
    parsed = load_config(cfg, dp_world_size=2)
    assert parsed.gradient_accumulation_steps == 2 and parsed.precision == "bf16"
    bad = trainer_ds_config(2)
    bad["train_micro_batch_size_per_gpu"] = 4
    with pytest.raises(ConfigError) as err:
        fill_auto(bad, args, max_steps=10, world_size=2)
    assert err.value.key_path == "train_micro_batch_size_per_gpu" and "per_device_train_batch_size" in str(err.value)


def test_trainer_refuses_a_missing_config():
    from hf_cases import make_llama
    from zerospeed.integrations.transformers import ZeroSpeedTrainer

    with pytest.raises(ValueError, match="ds_config is required"):
        ZeroSpeedTrainer(model=make_llama())
