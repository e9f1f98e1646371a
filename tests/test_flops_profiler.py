"""Flops profiler: totals against the analytic count for the GPT model, per-module rows, the
engine's profile_step window (stage 3 included), MFU, and the errors of bad input and config.

Analytic count for examples/gpt_model.py (L layers, width d, vocabulary V, B x T tokens), counting
matmul-type operators as torch's flop counter does (2 FLOPs per multiply-accumulate):

* forward  = 2 * N * B*T + 4 * L * B * T^2 * d, with N = 12 * L * d^2 + d * V the parameters that
  enter matmuls (qkv 3d^2, attention out d^2, MLP 8d^2 per layer, LM head d*V; embeddings and
  LayerNorms are look-ups / element-wise), and 4*L*B*T^2*d the two attention products Q K^T and
  P V over the full T x T square (causality is not discounted);
* forward + backward = 6 * N * B*T + 14 * L * B * T^2 * d: every matmul's backward is two
  matmuls of its size; flash attention's backward is 2.5x its forward (it recomputes Q K^T).
"""

import pytest
import torch
import torch.distributed as dist

from gpt_cases import GPT, GPTConfig
from zerospeed.config import ConfigError, load_config
from zerospeed.profiling import FlopsProfiler, get_model_profile, measure_peak_flops
from zerospeed.testing import run_distributed

TINY = GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, seq_len=32)


def analytic(cfg, batch, seq, backward=False):
    n_matmul = 12 * cfg.n_layer * cfg.d_model ** 2 + cfg.d_model * cfg.vocab_size
    tokens = batch * seq
    attention = cfg.n_layer * batch * seq * seq * cfg.d_model
    return 6 * n_matmul * tokens + 14 * attention if backward else 2 * n_matmul * tokens + 4 * attention


def test_gpt_forward_total_matches_the_analytic_count(capsys):
    cfg = GPTConfig(vocab_size=256, n_layer=4, n_head=6, d_model=192, seq_len=128)  # gpt_small at seq 128
    torch.manual_seed(0)
    model = GPT(cfg)
    x = torch.randint(0, 256, (2, 128))
    flops, macs, params = get_model_profile(model, args=[x], print_profile=True, as_string=False, warm_up=0,
                                            module_depth=2)
    expected = analytic(cfg, 2, 128)
    assert abs(flops - expected) / expected < 0.02
    assert macs == flops // 2 and params == model.num_parameters()
    text = capsys.readouterr().out
    assert "zerospeed flops profiler" in text and "blocks.0 (Block)" in text and "MFU:" in text
    assert "blocks.0.attn" not in text  # module_depth=2: the model's children and grandchildren
    as_text = get_model_profile(model, args=[x], print_profile=False, warm_up=0)
    assert as_text[0].endswith("FLOPS") and as_text[1].endswith("MACs")


def test_training_step_counts_backward_and_per_module_rows():
    torch.manual_seed(0)
    model = GPT(TINY)
    x = torch.randint(0, 256, (2, 32))
    prof = FlopsProfiler(model, peak_flops=1e12)
    prof.start_profile()
    model(x, x).backward()
    prof.stop_profile()
    expected = analytic(TINY, 2, 32, backward=True)
    assert abs(prof.get_total_flops() - expected) / expected < 0.02
    d, tokens = TINY.d_model, 64
    assert prof.module_flops("blocks.0.mlp.fc") == 3 * 2 * d * 4 * d * tokens  # forward + 2 backward matmuls
    assert prof.module_flops("blocks") == prof.module_flops("blocks.0") + prof.module_flops("blocks.1")
    assert prof.module_params("blocks.0.attn.qkv") == 3 * d * d + 3 * d
    assert prof.get_total_duration() > 0 and prof._calls["blocks.0"] == 1
    assert prof.mfu() == pytest.approx(prof.achieved_flops_per_s() / 1e12)
    # ignore_list: a module type's FLOPs leave every total
    prof.start_profile(ignore_list=[torch.nn.Linear])
    with torch.no_grad():
        model(x)
    prof.stop_profile()
    attention_only = 4 * TINY.n_layer * 2 * 32 * 32 * d
    assert prof.get_total_flops() == attention_only and prof.module_flops("blocks.0.mlp") == 0
    prof.end_profile()
    assert prof.get_total_flops() == 0


def test_peak_probe_measures_a_positive_rate():
    assert 1e6 < measure_peak_flops("cpu", torch.float32, size=256, repeats=1) < 1e15


def _engine_profile(out_file, stage):
    import zerospeed

    torch.manual_seed(0)
    model = GPT(TINY)
    num_params = model.num_parameters()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage},
           "flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": 3, "top_modules": 2,
                              "output_file": out_file, "peak_tflops": 1.0}}
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    totals = []
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        for _ in range(2):
            x = torch.randint(0, 256, (2, 32), generator=g)
            engine.backward(engine(x, x))
            engine.step()
        totals.append(engine.flops_profiler.get_total_flops())
    return {"totals": totals, "params": engine.flops_profiler.get_total_params(), "num_params": num_params}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 3])
def test_engine_profiles_step_profile_step(tmp_path, stage):
    out = tmp_path / "profile.txt"
    results = run_distributed(_engine_profile, 2, str(out), stage)
    step = 2 * analytic(TINY, 2, 32, backward=True)  # two micro-batches of forward + backward
    for r in results:
        assert r["totals"][0] == 0  # step 0 is not profiled (global_steps == profile_step == 1 is the 2nd)
        assert abs(r["totals"][1] - step) / step < 0.02 and r["totals"][2] == r["totals"][1]
        assert r["params"] == r["num_params"]  # full sizes, also from ZeRO-3 shards
    text = out.read_text()
    assert "profile at step 1" in text and "peak (given): 1.00 TFLOP/s" in text and "blocks.0.attn (" in text


@pytest.mark.parametrize("model, kwargs, message", [
    ("not a model", {"args": [1]}, "model must be a torch.nn.Module, got str"),
    (torch.nn.Linear(2, 2), {}, "no input; pass input_shape, args or kwargs"),
    (torch.nn.Linear(2, 2), {"input_shape": (2, -1)}, "input_shape must be a tuple of positive ints"),
    (torch.nn.Linear(2, 2), {"input_shape": (1, 2), "args": [torch.ones(1, 2)]}, "give input_shape or args"),
    (torch.nn.Linear(2, 2), {"input_shape": (1, 2), "warm_up": -1}, "warm_up must be an int >= 0"),
    (torch.nn.Linear(2, 2), {"input_shape": (1, 2), "mode": "generate"}, "mode 'generate' is not supported"),
])
def test_get_model_profile_bad_input(model, kwargs, message):
    with pytest.raises((TypeError, ValueError), match="get_model_profile: ") as info:
        get_model_profile(model, **kwargs)
    assert message in str(info.value)


def test_profiler_misuse_is_one_line():
    prof = FlopsProfiler(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="stop_profile: the profile was not started"):
        prof.stop_profile()
    prof.start_profile()
    with pytest.raises(RuntimeError, match="start_profile: already started"):
        prof.start_profile()
    prof.end_profile()


@pytest.mark.parametrize("section, key", [
    ({"enabled": True, "profile_stp": 2}, "flops_profiler.profile_stp"),
    ({"enabled": True, "module_depth": -2}, "flops_profiler.module_depth"),
    ({"enabled": "yes"}, "flops_profiler.enabled"),
    ({"enabled": True, "peak_tflops": 0}, "flops_profiler.peak_tflops"),
])
def test_bad_flops_profiler_keys_give_one_clear_line(section, key):
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 1, "flops_profiler": section})
    assert str(info.value).startswith(f"zerospeed config: {key}: ") and "\n" not in str(info.value)


def test_flops_profiler_section_is_accepted_with_deepspeed_keys():
    cfg = load_config({"train_batch_size": 1, "flops_profiler": {
        "enabled": True, "recompute_fwd_factor": 0.0, "profile_step": 3, "module_depth": -1, "top_modules": 1,
        "detailed": False, "output_file": None}})
    assert cfg.flops_profiler.profile_step == 3 and not cfg.flops_profiler.detailed
