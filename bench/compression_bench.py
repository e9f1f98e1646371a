"""Compression: held-out loss, bytes on disk, forward latency, peak memory and engine tokens/s of compressed GPTs.

Run from the repository root::

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python bench/compression_bench.py

One run: train the demo GPT (``gpt_small``, 4 layers) on the synthetic text for ``--steps`` steps
(lr 3e-3), then:

* ``dense-fp32``: ``--qat_steps`` more plain steps (lr 1e-3), the reference and the teacher;
  ``dense-fp32-long``: that model trained ``--distill_steps`` more (lr 3e-3), as long as the student;
* ``w8a8``  : from the same point, zerospeed QAT for ``--qat_steps`` (lr 1e-3), int8 weights (every
  Linear and Embedding, 64 row-aligned groups) + int8 activations (blocks and LM head),
  ``redundancy_clean`` -> ``QuantizedLinear`` int8 x int8 GEMMs (oneDNN);
* ``w4``    : the same with int4 weights (64 groups), cleaned (packed two per byte);
* ``rows50+lr4to2``: the dense model's layers 0 and 3 (layer reduction 4 -> 2) with 50% of the MLP
  rows pruned (l1), trained with ``distillation_loss`` (T=2, alpha 0.5) against the dense teacher for
  ``--distill_steps`` (lr 3e-3), cleaned;
* ``zs-w8a8-ptq`` / ``zs-int8-wo``: zerospeed ``quantize(dense, bits=8, act_bits=8 | 0)`` post-training;
* ``torchao-int8-wo``: torchao ``Int8WeightOnlyConfig`` on the dense model (what a user would pick instead);

and measure each against the dense model: held-out loss (seed-1 text the model never saw), bytes of
the saved file (safetensors for zerospeed and dense; ``torch.save`` for torchao, whose tensor
subclasses safetensors cannot hold), forward latency of one ``--batch`` x 64-token batch (one thread,
``torch.no_grad``, ``--reps`` rounds with the models interleaved; wall min and median, and the median
CPU time of the thread, which the shared machine disturbs least), and peak memory: in a
fresh process per model, the rise of the peak RSS (VmHWM, reset after imports) while loading the file
into a meta-device skeleton and running one forward.

Engine table: tokens/s through ``init_inference(..., replace_with_kernel_inject=True)`` (zerospeed's
inference engine) for an HF GPT-2 of the demo GPT's shape (random weights: throughput only),
fp32 against ``dtype=int8`` (weight-only) and ``quant.activation.enabled`` (w8a8): ``--gen_rows``
prompts of 32 tokens, ``--gen_tokens`` greedy new tokens each, the engines interleaved, best of
``--gen_reps``; generated tokens per wall second and per CPU second of this process, and the share of
generated tokens equal to fp32's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

from common import command_line, current_rss_bytes, write_results  # noqa: E402

SEQ = 64


def _data(seed: int, num: int):
    from data import SyntheticTextDataset

    ds = SyntheticTextDataset(seq_len=SEQ, num_samples=num, seed=seed)
    xs, ys = zip(*(ds[i] for i in range(num)))
    return torch.stack(xs), torch.stack(ys)


def _batches(x, y, batch: int, steps: int, offset: int = 0):
    n = x.shape[0]
    for s in range(steps):
        i = ((s + offset) * batch) % (n - batch)
        yield x[i:i + batch], y[i:i + batch]


@torch.no_grad()
def held_out_loss(model, x, y, batch: int = 32) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, x.shape[0], batch):
        total += model(x[i:i + batch], y[i:i + batch]).item() * x[i:i + batch].shape[0]
        count += x[i:i + batch].shape[0]
    return total / count


def train(model, x, y, steps: int, lr: float, batch: int, offset: int = 0, scheduler=None, teacher=None):
    from zerospeed.compression import distillation_loss

    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    for xb, yb in _batches(x, y, batch, steps, offset):
        if teacher is None:
            loss = model(xb, yb)
        else:
            logits = model(xb)
            with torch.no_grad():
                t_logits = teacher(xb)
            hard = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), yb.view(-1))
            loss = distillation_loss(logits, t_logits, temperature=2.0, hard_loss=hard, alpha=0.5)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return model


def compression_config(kind: str) -> dict:
    if kind == "w8a8":
        return {"weight_quantization": {
                    "shared_parameters": {"enabled": True, "quantize_groups": 64},
                    "different_groups": {"wq": {"params": {"start_bits": 8, "target_bits": 8,
                                                           "quantization_period": 0}, "modules": ["*"]}}},
                "activation_quantization": {
                    "shared_parameters": {"enabled": True, "range_calibration": "dynamic"},
                    "different_groups": {"aq": {"params": {"bits": 8}, "modules": ["blocks", "lm_head"]}}}}
    if kind == "w4":
        return {"weight_quantization": {
                    "shared_parameters": {"enabled": True, "quantize_groups": 64},
                    "different_groups": {"wq": {"params": {"start_bits": 4, "target_bits": 4,
                                                           "quantization_period": 0}, "modules": ["*"]}}}}
    if kind == "rows50+lr4to2":
        return {"row_pruning": {"shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "l1"},
                                "different_groups": {"rp": {"params": {"dense_ratio": 0.5}, "modules": ["mlp.fc"],
                                                            "related_modules": [["mlp.proj"]]}}},
                "layer_reduction": {"enabled": True, "keep_number_layer": 2, "module_name_prefix": "blocks",
                                    "teacher_layer": [0, 3], "other_module_name": ["tok_emb", "pos_emb", "ln_f"]}}
    raise ValueError(kind)


# --------------------------------------------------------------------------- the measuring child

def _vm_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(path: str, kind: str, batch: int) -> None:
    """Peak memory of loading ``path`` and running one forward, in this fresh process."""
    torch.set_num_threads(1)
    from gpt_model import GPT, gpt_small

    from zerospeed.compression import load_compressed

    cfg = gpt_small()
    x = torch.randint(0, cfg.vocab_size, (batch, SEQ), generator=torch.Generator().manual_seed(0))
    if kind == "torchao":
        import torchao.quantization  # noqa: F401  (imported before the baseline so its import is not counted)
    with torch.device("meta"):
        model = GPT(cfg)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS high-water mark (Linux)
    base = current_rss_bytes()
    if kind == "torchao":
        model.load_state_dict(torch.load(path, weights_only=False), assign=True)
    else:
        load_compressed(model, path)
    with torch.no_grad():
        model.eval()(x)
    print(json.dumps({"peak_mem_bytes": _vm_hwm_bytes() - base}))


def peak_memory(path: Path, kind: str, args) -> int:
    cmd = [sys.executable, __file__, "--child", str(path), "--child_kind", kind, "--batch", str(args.batch)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode:
        raise RuntimeError(f"measuring {path.name} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mem_bytes"]


@torch.no_grad()
def latencies(models: dict[str, torch.nn.Module], batch: int, reps: int) -> dict[str, tuple[list[float], list[float]]]:
    """Forward times (s) of one batch: wall and CPU time of this thread, the models interleaved round by
    round so that load from other processes on a shared machine falls on all of them alike.  CPU time
    leaves out the time this thread waited while other processes had the cores."""
    x = torch.randint(0, 256, (batch, SEQ), generator=torch.Generator().manual_seed(0))
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in models}
    for model in models.values():
        model.eval()
        for _ in range(3):
            model(x)
    for _ in range(reps):
        for name, model in models.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            model(x)
            times[name][1].append(time.thread_time() - c0)
            times[name][0].append(time.perf_counter() - t0)
    return times


def _hf_gpt2(seed: int = 0):
    import transformers as tf

    cfg = tf.GPT2Config(vocab_size=256, n_embd=192, n_layer=4, n_head=6, n_positions=128, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    return tf.GPT2LMHeadModel(cfg).eval()


def engine_throughput(args) -> list[dict]:
    """Greedy generation through zerospeed's inference engine: fp32, int8 weight-only, w8a8."""
    import zerospeed

    engines = {
        "engine-fp32": zerospeed.init_inference(_hf_gpt2(), replace_with_kernel_inject=True, max_out_tokens=128),
        "engine-int8-wo": zerospeed.init_inference(_hf_gpt2(), dtype="int8", replace_with_kernel_inject=True,
                                                   max_out_tokens=128),
        "engine-w8a8": zerospeed.init_inference(_hf_gpt2(), dtype="int8", replace_with_kernel_inject=True,
                                                max_out_tokens=128, quant={"activation": {"enabled": True}}),
    }
    ids = torch.randint(3, 256, (args.gen_rows, 32), generator=torch.Generator().manual_seed(2))
    best: dict[str, tuple[float, float]] = {}
    tokens: dict[str, torch.Tensor] = {}
    for name, engine in engines.items():  # warm-up
        engine.module.generate(ids[:2], max_new_tokens=4, do_sample=False, eos_token_id=None)
    for _ in range(args.gen_reps):
        for name, engine in engines.items():
            w0, c0 = time.perf_counter(), time.process_time()
            out = engine.module.generate(ids, max_new_tokens=args.gen_tokens, do_sample=False, eos_token_id=None)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            tokens[name] = out[:, 32:]
            prev = best.get(name, (float("inf"), float("inf")))
            best[name] = (min(prev[0], wall), min(prev[1], cpu))
    n = args.gen_rows * args.gen_tokens
    rows = []
    for name in engines:
        wall, cpu = best[name]
        rows.append({"engine": name, "generated_tokens": n, "wall_s": wall, "cpu_s": cpu, "tokens_per_s": n / wall,
                     "tokens_per_cpu_s": n / cpu,
                     "tokens_equal_fp32": float((tokens[name] == tokens["engine-fp32"]).float().mean())})
    base = rows[0]
    for row in rows:
        row["tokens_per_s_x_fp32"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["tokens_per_cpu_s_x_fp32"] = row["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="dense training steps before compression")
    parser.add_argument("--qat_steps", type=int, default=100,
                        help="QAT fine-tuning steps (the dense reference trains as many more)")
    parser.add_argument("--distill_steps", type=int, default=300, help="distillation steps of the 2-layer student")
    parser.add_argument("--train_batch", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16, help="latency batch (x 64 tokens)")
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--gen_rows", type=int, default=16, help="engine: prompts per generate call")
    parser.add_argument("--gen_tokens", type=int, default=64, help="engine: new tokens per prompt")
    parser.add_argument("--gen_reps", type=int, default=5)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child_kind", default="zerospeed", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.child_kind, args.batch)
        return
    torch.set_num_threads(1)
    from gpt_model import GPT, gpt_small

    from zerospeed.compression import init_compression, quantize, redundancy_clean, save_compressed, scheduler_of

    torch.manual_seed(0)
    cfg = gpt_small()
    train_x, train_y = _data(seed=0, num=4096)
    test_x, test_y = _data(seed=1, num=256)
    t0 = time.perf_counter()
    base = train(GPT(cfg), train_x, train_y, args.steps, 3e-3, args.train_batch)
    train_s = time.perf_counter() - t0
    # the dense reference gets the same extra steps the quantized models are fine-tuned for
    dense = train(copy.deepcopy(base), train_x, train_y, args.qat_steps, 1e-3, args.train_batch, offset=args.steps)
    models: dict[str, torch.nn.Module] = {"dense-fp32": dense}
    steps = {"dense-fp32": f"{args.steps} + {args.qat_steps}"}
    for kind in ("w8a8", "w4", "rows50+lr4to2"):
        conf = {"compression_training": compression_config(kind)}
        if kind.startswith("rows"):  # the student: the teacher's layers, distilled from it
            model = init_compression(copy.deepcopy(dense), conf)
            train(model, train_x, train_y, args.distill_steps, 3e-3, args.train_batch, offset=args.steps,
                  scheduler=scheduler_of(model), teacher=dense.eval())
            steps[kind] = f"{args.steps} + {args.qat_steps} + {args.distill_steps} KD"
        else:
            model = init_compression(copy.deepcopy(base), conf)
            train(model, train_x, train_y, args.qat_steps, 1e-3, args.train_batch, offset=args.steps,
                  scheduler=scheduler_of(model))
            steps[kind] = f"{args.steps} + {args.qat_steps} QAT"
        models[f"simulated-{kind}"] = held_out_loss(model, test_x, test_y)
        redundancy_clean(model, conf)
        models[kind] = model
    # the student's fair reference: the dense model trained on for the same steps at the same lr
    models["dense-fp32-long"] = train(copy.deepcopy(dense), train_x, train_y, args.distill_steps, 3e-3,
                                      args.train_batch, offset=args.steps)
    steps["dense-fp32-long"] = f"{args.steps} + {args.qat_steps} + {args.distill_steps}"
    models["zs-w8a8-ptq"] = quantize(copy.deepcopy(dense), bits=8, act_bits=8)
    models["zs-int8-wo"] = quantize(copy.deepcopy(dense), bits=8)
    models["torchao-int8-wo"] = quantize(copy.deepcopy(dense), bits=8, backend="torchao")
    for name in ("zs-w8a8-ptq", "zs-int8-wo", "torchao-int8-wo"):
        steps[name] = steps["dense-fp32"] + " (PTQ)"

    dense_loss = held_out_loss(dense, test_x, test_y)
    names = ("dense-fp32", "w8a8", "w4", "rows50+lr4to2", "dense-fp32-long", "zs-w8a8-ptq", "zs-int8-wo",
             "torchao-int8-wo")
    timed = latencies({n: models[n] for n in names}, args.batch, args.reps)
    rows, tmp = [], Path(tempfile.mkdtemp(prefix="zs-compress-bench-"))
    try:
        for name in names:
            model = models[name]
            if name.startswith("torchao"):
                path = tmp / f"{name}.pt"
                torch.save(model.state_dict(), path)
                peak = peak_memory(path, "torchao", args)
            else:
                path = tmp / f"{name}.safetensors"
                save_compressed(model, path)
                peak = peak_memory(path, "zerospeed", args)
            loss = held_out_loss(model, test_x, test_y)
            ts, cs = sorted(timed[name][0]), sorted(timed[name][1])
            rows.append({"model": name, "steps": steps[name], "held_out_loss": loss,
                         "loss_vs_dense": loss / dense_loss - 1,
                         "simulated_loss": models.get(f"simulated-{name}"), "bytes_on_disk": path.stat().st_size,
                         "latency_min_ms": 1e3 * ts[0], "latency_median_ms": 1e3 * ts[len(ts) // 2],
                         "cpu_ms_median": 1e3 * cs[len(cs) // 2], "peak_mem_bytes": peak})
    finally:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    dense_row = rows[0]
    for row in rows:
        row["bytes_x_dense"] = row["bytes_on_disk"] / dense_row["bytes_on_disk"]
        row["latency_min_x_dense"] = row["latency_min_ms"] / dense_row["latency_min_ms"]
        row["latency_median_x_dense"] = row["latency_median_ms"] / dense_row["latency_median_ms"]
        row["cpu_ms_median_x_dense"] = row["cpu_ms_median"] / dense_row["cpu_ms_median"]
        row["peak_mem_x_dense"] = row["peak_mem_bytes"] / max(dense_row["peak_mem_bytes"], 1)
        print(json.dumps(row), flush=True)
    engine_rows = engine_throughput(args)
    for row in engine_rows:
        print(json.dumps(row), flush=True)
    params = {"model": "gpt_small (4 layers, d_model 192, 6 heads, seq 64, vocab 256)", "train_steps": args.steps,
              "qat_steps": args.qat_steps, "distill_steps": args.distill_steps, "train_batch": args.train_batch,
              "latency_batch": args.batch, "reps": args.reps, "threads": 1, "dense_train_s": round(train_s, 1),
              "engine_model": "HF GPT-2, random init, 4 layers, n_embd 192, 6 heads, vocab 256",
              "gen_rows": args.gen_rows, "gen_tokens": args.gen_tokens, "gen_reps": args.gen_reps}
    notes = ["The machine was shared with other jobs (2 cores, several helpers and the lead running tests and "
             "benchmarks): wall-clock latencies are noisy (a model can wait for a core); the latency target is "
             "judged on cpu_ms_median, the median CPU time of the forward's thread (time.thread_time), which "
             "leaves the waiting out (it still includes cache and memory-bandwidth contention). "
             "dense-fp32-long has the dense model's architecture: its latencies show the run's noise.",
             "w8a8 and w4 quantize every Linear and Embedding (the tied LM head is stored as its own int "
             "copy); LayerNorms and biases stay fp32. w8a8 / zs-w8a8-ptq run QuantizedLinear's oneDNN int8 "
             "GEMM (per-tensor dynamic int8 input, per-row int8 weight scales).",
             "rows50+lr4to2 trains longer than the dense reference (its distillation steps come on top of the "
             "dense model's): the steps column says how many each model saw; dense-fp32-long is the dense model "
             "trained on for the same steps at the same lr, the student's like-for-like reference.",
             "torchao bytes are a torch.save file (its tensor subclasses do not fit safetensors).",
             "peak_mem is the rise of peak RSS (VmHWM reset after imports) in a fresh process while loading the "
             "file into a meta-device skeleton and running one forward.",
             "Engine rows: each generate call is one prefill of 16 x 32 prompt tokens (512 tokens per Linear "
             "call: int8 GEMMs) and then decode steps of 16 tokens per Linear call, where int8's fixed cost of "
             "quantizing the input is about the size of the fp32 GEMM on layers this small (QuantizedLinear's "
             "docstring); tokens_equal_fp32 is the share of greedy tokens equal to the fp32 engine's."]
    json_path, md_path = write_results("compression", rows, params=params, notes=notes, command=command_line())
    print(f"wrote {json_path} and {md_path}")
    json_path, md_path = write_results("compression_engine", engine_rows, params=params, notes=notes[:1] + notes[-1:],
                                       command=command_line())
    print(f"wrote {json_path} and {md_path} (the engine table of the same run)")


if __name__ == "__main__":
    main()
