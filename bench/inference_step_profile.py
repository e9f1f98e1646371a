"""Where one engine decode step's time goes (a profiling aid, not part of the suite or the bench).

Builds the engine on bench/inference_bench.py's model (it must exist: run the bench once), brings
``n`` sequences into the decode phase for each ``n`` of ``--seqs``, then, in CPU seconds of this
thread (``thread_time``, robust to other jobs on a shared machine):

- the median decode step (``engine.step()``) per batch size, steps of all sizes interleaved so that
  a change of machine load hits them alike, and the per-sequence cost between sizes;
- with ``--breakdown N``: the step at ``N`` sequences split by kernel (the block matmuls, the fused
  attention layer, the int8 LM head and its candidate selection, the norms) and the rest (Python,
  small torch ops), from ``cProfile`` (which itself adds ~1 us per Python call to "rest");
- HF ``generate``'s decode step at batch 1 for comparison (the ITL reference of the issue).

Usage: ``OMP_NUM_THREADS=1 PYTHONPATH=src python bench/inference_step_profile.py --seqs 1,4,8,12,16``
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import inference_bench as ib  # noqa: E402  (same folder)

KERNELS = {"block matmuls": ("skinny_linear", "linear", "addmm"), "attention layer": ("attention_layer",),
           "int8 LM head": ("qlinear_pointwise",), "candidates": ("greedy_refine",), "norms": ("rms_norm",)}


def decoding_engine(n: int, prompts):
    from zerospeed.inference import SamplingParams, build_engine

    engine = build_engine(str(ib.MODEL_DIR), block_size=16, max_num_seqs=n, max_decode_kv_bytes=None,
                          kv_cache_memory=256 << 20)
    sp = SamplingParams(max_new_tokens=ib.NEW_TOKENS * 4, ignore_eos=True)
    for i in range(n):
        engine.add_request(str(i), prompts[i % len(prompts)][:160], sp)
    while engine.scheduler.waiting or any(s.num_generated == 0 for s in engine.scheduler.running):
        engine.step()
    return engine


def hf_batch1(prompt, reps: int) -> list[float]:
    from transformers import LogitsProcessorList

    model = ib._hf_model()
    steps: list[float] = []

    class Clock:
        def __call__(self, input_ids, scores):
            steps.append(time.thread_time())
            return scores

    with torch.no_grad():
        model.generate(torch.tensor([prompt]), max_new_tokens=reps + 1, min_new_tokens=reps + 1, do_sample=False,
                       pad_token_id=0, logits_processor=LogitsProcessorList([Clock()]))
    return [b - a for a, b in zip(steps, steps[1:])]


def breakdown(engine, reps: int) -> None:
    prof = cProfile.Profile(time.thread_time)
    t0 = time.thread_time()
    prof.enable()
    for _ in range(reps):
        engine.step()
    prof.disable()
    total = (time.thread_time() - t0) / reps
    own: dict[str, float] = {}
    for (_, _, name), (_, _, tt, _, _) in pstats.Stats(prof).stats.items():
        own[name] = own.get(name, 0.0) + tt
    parts = {}
    for label, names in KERNELS.items():
        parts[label] = sum(t for name, t in own.items() if any(k in name for k in names)) / reps
    rest = total - sum(parts.values())
    print(f"  breakdown at {len(engine.scheduler.running)} sequences, CPU ms per step (profiled {1e3 * total:.2f}): "
          + "  ".join(f"{k} {1e3 * v:.2f}" for k, v in parts.items()) + f"  rest {1e3 * rest:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="1,4,8,12,16")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--breakdown", type=int, default=0, help="a batch size to break down by kernel")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    prompts = ib.requests()
    sizes = [int(s) for s in args.seqs.split(",")]
    engines = {n: decoding_engine(n, prompts) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(args.reps // 5):
        for n, engine in engines.items():
            for _ in range(5):
                t0 = time.thread_time()
                engine.step()
                times[n].append(time.thread_time() - t0)
    print("decode step, CPU ms (median; contexts: the bench's prompts cut at 160 tokens, plus what was generated):")
    prev = None
    for n in sizes:
        med = 1e3 * statistics.median(times[n])
        ctx = sum(s.num_computed for s in engines[n].scheduler.running) / n
        extra = f"  (+{(med - prev[1]) / (n - prev[0]):.3f} ms per added sequence)" if prev else ""
        print(f"  {n:3d} sequences, mean context {ctx:4.0f}: {med:6.2f}{extra}")
        prev = (n, med)
    if args.breakdown:
        breakdown(engines.get(args.breakdown) or decoding_engine(args.breakdown, prompts), args.reps)
    if not args.skip_hf:
        hf = hf_batch1(prompts[0][:136], args.reps)
        print(f"  HF generate batch 1, decode step: {1e3 * statistics.median(hf):.2f} ms "
              f"(p95 {1e3 * ib._pct(hf, 0.95):.2f})")


if __name__ == "__main__":
    main()
