"""Parity on one device, parametrized by device: ``cpu`` always, ``cuda`` when there is one (else skipped,
"no CUDA device"). ``make gpu-check`` runs this module on a GPU machine; here it is an ordinary CPU test.

World size 1 in this process: gloo on CPU, NCCL on CUDA (``device_util.world_of_one``), so the engine
computes where the backend says. On CUDA TF32 is off and deterministic kernels are asked for, so the
reference run and the engine run compute the same products and sums in the same order, as they do on
CPU; the bounds below are therefore the CPU suite's, for the CPU suite's reasons:

* ZeRO stages 0-3, optimizer offload to CPU and NVMe, parameter offload (stage 3), fp32: losses and every
  weight within 1e-5 relative of plain PyTorch (tests/test_engine_parity.py, tests/test_offload.py): the
  runs differ only in the optimizer's flat layout and the clipping norm's summation order (a few ulps);
* bf16 (8 significant bits) to the fp32 reference: losses 3e-2, weights 5e-2; fp16 (11 bits) with
  dynamic loss scaling: losses 1e-2, weights 2e-2 (tests/test_engine_parity.py); an overflowing fp16 step
  is skipped (weights untouched) and halves the scale;
* ``engine.compile`` with Dynamo's eager backend and DeepCompile (stage 3) against the eager engine: 1e-6
  relative (the same kernels; reassociation only; tests/test_compile_*.py); Inductor (CUDA only, Triton
  kernels fuse and reorder sums): losses 1e-5, weights 2e-3 (tests/test_compile_deep.py's Inductor bound);
* the inference engine against HF ``generate`` (fp32): every greedy token is HF's argmax under teacher
  forcing within 1e-4 of the logits' scale (logits of ~10 computed in fp32 by other kernels differ by
  ~1e-6 relative), and on CPU the tokens are identical (tests/test_inference_engine.py); the HTTP server
  returns the same text;
* quantized kernels against the dequantize reference: 1e-5 relative (tests/test_compression_clean.py);
* flops profiler: forward + backward FLOPs of the GPT within 2% of the analytic count
  (tests/test_flops_profiler.py).
"""

from __future__ import annotations

import pytest
import torch

import engine_cases
from device_cases import compile_train, engine_train, reference_run, rel_losses, teacher_forced_margins, zero_config
from device_util import DEVICES, HAS_CUDA, NO_CUDA, world_of_one

FP32_TOL = 1e-5
pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def dev(device):
    with world_of_one(device) as d:
        yield d


def _check_fp32(run: dict, ref: tuple[list[float], dict], device: torch.device) -> None:
    assert run["device"].startswith(device.type)
    assert rel_losses(run["losses"], ref[0]) < FP32_TOL, (run["losses"], ref[0])
    assert engine_cases.max_rel_err(run["weights"], ref[1]) < FP32_TOL
    assert run["global_steps"] == engine_cases.STEPS


# -- ZeRO stages, offload, precision ----------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("device", DEVICES)
def test_zero_stage_matches_torch_reference(dev, stage):
    run = engine_train(zero_config(stage, gas=2))
    _check_fp32(run, reference_run(dev, 2), dev)
    assert dev.type in run["param_devices"], run["param_devices"]


@pytest.mark.parametrize("stage,offload", [(2, "cpu"), (2, "nvme"), (3, "cpu"), (3, "nvme"), (3, "param")])
@pytest.mark.parametrize("device", DEVICES)
def test_offload_matches_torch_reference(dev, stage, offload, tmp_path):
    run = engine_train(zero_config(stage, gas=2, offload=offload, nvme_root=str(tmp_path)))
    _check_fp32(run, reference_run(dev, 2), dev)


@pytest.mark.parametrize("precision,loss_tol,weight_tol", [("bf16", 3e-2, 5e-2), ("fp16", 1e-2, 2e-2)])
@pytest.mark.parametrize("device", DEVICES)
def test_mixed_precision_tracks_fp32_reference(dev, precision, loss_tol, weight_tol):
    ref = reference_run(dev, 2)
    for stage in (0, 2, 3):
        run = engine_train(zero_config(stage, gas=2, precision=precision))
        assert rel_losses(run["losses"], ref[0]) < loss_tol, (stage, run["losses"], ref[0])
        assert engine_cases.max_rel_err(run["weights"], ref[1]) < weight_tol, stage
        assert run["skipped_steps"] == 0, stage
        if precision == "fp16":  # dynamic scaling at its initial 2**16: nothing overflowed
            assert run["loss_scales"] == [2.0 ** 16] * engine_cases.STEPS, run["loss_scales"]


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_overflow_skips_the_step_and_halves_the_scale(dev):
    """2**40 times a loss of ~1 overflows fp16's gradients (max 65504): the step is skipped on the device
    (its fp16 weights untouched) and, with hysteresis 1, every overflow halves the scale."""
    run = engine_train(zero_config(2, gas=1, precision="fp16", initial_scale_power=40, hysteresis=1))
    initial = {n: p.detach().half().float() for n, p in engine_cases.make_model().named_parameters()}
    assert run["skipped_steps"] == engine_cases.STEPS
    assert run["loss_scales"] == [2.0 ** (40 - k) for k in range(1, engine_cases.STEPS + 1)]
    assert all(torch.equal(run["weights"][n], w) for n, w in initial.items())


# -- compile ----------------------------------------------------------------------------------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


@pytest.mark.parametrize("device,backend", [
    ("cpu", "eager"),
    pytest.param("cuda", "eager", marks=pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)),
    pytest.param("cuda", "inductor", marks=pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)),
])
@pytest.mark.parametrize("stage,deepcompile", [(0, False), (3, True)], ids=["compile-stage0", "deepcompile-stage3"])
def test_compiled_engine_matches_eager(dev, backend, stage, deepcompile):
    eager = compile_train(stage, None)
    compiled = compile_train(stage, backend, deepcompile=deepcompile)
    loss_tol, weight_tol = (1e-6, 1e-6) if backend == "eager" else (1e-5, 2e-3)
    assert max(abs(a - b) / abs(b) for a, b in zip(compiled["losses"], eager["losses"])) < loss_tol
    assert max(_rel(compiled["weights"][k], eager["weights"][k]) for k in eager["weights"]) < weight_tol
    rep = compiled["report"]
    assert rep["compiled"] and rep["backend"] == backend and rep["graphs"] >= 1, rep
    if deepcompile:
        assert rep["deepcompile"] and rep["graph_breaks"] == 0, rep["graph_break_reasons"]
    else:
        assert rep["graph_breaks"] == 0, rep["graph_break_reasons"]


# -- inference engine and server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from inference_cases import make_model, save_model

    return save_model(make_model("llama"), str(tmp_path_factory.mktemp("llama")))


@pytest.mark.parametrize("device", DEVICES)
def test_inference_engine_greedy_matches_hf(device, llama_dir):
    from inference_cases import make_model, prompts

    from device_cases import hf_greedy
    from zerospeed.inference import SamplingParams, build_engine

    with world_of_one(device) as dev:  # the pinned numerics; the engine itself needs no process group
        model = make_model("llama").to(dev)
        ps = prompts([5, 17, 40, 3], seed=1)
        ref = [hf_greedy(model, p, 12, dev) for p in ps]
        assert all(len(set(r)) >= 6 for r in ref), "random model too repetitive for a meaningful check"
        engine = build_engine(llama_dir, device=dev, block_size=8, num_blocks=64, max_num_batched_tokens=256)
        assert engine.device.type == device
        got = engine.generate(ps, SamplingParams(max_new_tokens=12, ignore_eos=True))
        for p, tokens in zip(ps, got):
            margins = teacher_forced_margins(model, p, tokens, dev)
            with torch.no_grad():
                scale = model(torch.tensor([p], device=dev)).logits.abs().max().item()
            assert max(margins) <= 1e-4 * max(1.0, scale), (margins, tokens)
        if device == "cpu":
            assert got == ref
        st = engine.stats()
        assert st.num_blocks_free == st.num_blocks_total and st.num_running == 0


@pytest.mark.parametrize("device", DEVICES)
def test_server_completion_matches_hf_generate(device, tmp_path):
    pytest.importorskip("fastapi", reason="the server needs fastapi (zerospeed[serve])")
    pytest.importorskip("uvicorn", reason="the server needs uvicorn (zerospeed[serve])")
    import httpx
    from transformers import LlamaForCausalLM

    from serve_cases import build_model_dir
    from zerospeed.inference import build_engine, serve

    model_dir = build_model_dir(tmp_path / "tiny-llama")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    with world_of_one(device) as dev:
        model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(dev).eval()
        prompt = "To be or not to be"
        ids = tok.encode(prompt).ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids], device=dev), max_new_tokens=12, min_new_tokens=12,
                                 do_sample=False, pad_token_id=0)
        ref = out[0, len(ids):].tolist()
        engine = build_engine(str(model_dir), device=dev, block_size=8, num_blocks=48)
        with serve(str(model_dir), engine=engine, port=0) as handle:
            r = httpx.post(handle.url + "/v1/completions", timeout=60, json={
                "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 12 and body["usage"]["prompt_tokens"] == len(ids)
        assert body["choices"][0]["text"] == tok.decode(ref)


# -- compression kernels, flops profiler ------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits,act_bits", [(8, 8), (4, 0), (8, 0)])
def test_quantized_linear_kernels_match_the_reference(device, bits, act_bits):
    from zerospeed.compression import QuantizedLinear
    from zerospeed.compression.quantizer import fake_quantize, pack, quantize, unpack

    with world_of_one(device) as dev:
        gen = torch.Generator().manual_seed(bits + act_bits)
        weight, bias = torch.randn(48, 32, generator=gen) * 0.1, torch.randn(48, generator=gen)
        layer = QuantizedLinear.from_weight(weight, bias, bits, act_bits=act_bits).to(dev)
        cpu_layer = QuantizedLinear.from_weight(weight, bias, bits, act_bits=act_bits)
        assert torch.equal(layer.qweight.cpu(), cpu_layer.qweight)  # the same codes wherever quantized
        x = torch.randn(3, 40, 32, generator=gen)
        reference = layer.use_kernel("dequant")(x.to(dev))
        assert reference.device.type == device
        for kernel in layer.available_kernels():
            out = layer.use_kernel(kernel)(x.to(dev))
            assert out.shape == (3, 40, 48) and out.dtype == torch.float32 and out.device.type == device
            assert _rel(out.float(), reference.float()) < FP32_TOL, kernel
        # the reference on the device equals the CPU's to fp32 rounding (same codes, same scales)
        assert _rel(reference.cpu(), cpu_layer.use_kernel("dequant")(x)) < FP32_TOL
        w = torch.randn(16, 32, generator=gen).to(dev)
        q, _, _ = quantize(w, 4, 4, True)
        assert torch.equal(unpack(pack(q, 4, zero_offset=True), 4, q.numel(), True).view(q.shape).float(), q)
        assert torch.equal(fake_quantize(w, 8, 1).cpu(), fake_quantize(w.cpu(), 8, 1))


@pytest.mark.parametrize("device", DEVICES)
def test_flops_profiler_counts_forward_and_backward(device):
    from gpt_cases import GPT, GPTConfig
    from zerospeed.profiling import FlopsProfiler, measure_peak_flops

    cfg = GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, seq_len=32)
    with world_of_one(device) as dev:
        torch.manual_seed(0)
        model = GPT(cfg).to(dev)
        x = torch.randint(0, 256, (2, 32)).to(dev)
        prof = FlopsProfiler(model, peak_flops=1e12)
        prof.start_profile()
        model(x, x).backward()
        prof.stop_profile()
        n_matmul = 12 * cfg.n_layer * cfg.d_model ** 2 + cfg.d_model * cfg.vocab_size
        expected = 6 * n_matmul * 64 + 14 * cfg.n_layer * 2 * 32 * 32 * cfg.d_model
        assert abs(prof.get_total_flops() - expected) / expected < 0.02
        assert prof.module_flops("blocks.0.mlp.fc") == 3 * 2 * cfg.d_model * 4 * cfg.d_model * 64
        assert prof.get_total_duration() > 0
        prof.end_profile()
        assert 1e6 < measure_peak_flops(device, torch.float32, size=256, repeats=1) < 1e16


def test_cpu_int8_kernels_are_not_offered_off_the_cpu():
    """onednn / int_mm run the CPU's int8 ops: a layer elsewhere (here on ``meta``, where no kernel runs)
    is offered the dequantize reference only, which computes on any device."""
    from zerospeed.compression import QuantizedLinear

    layer = QuantizedLinear.from_weight(torch.randn(48, 32) * 0.1, None, 8, act_bits=8)
    assert layer.to("meta").available_kernels() == ("dequant",)
