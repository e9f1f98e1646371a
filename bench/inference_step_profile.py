"""Where one engine step's time goes (a profiling aid, not part of the suite or the bench).

Builds the engine on bench/inference_bench.py's model (it must exist: run the bench once), brings
32 sequences into the decode phase, then times, in CPU seconds of this thread (``thread_time``, robust
to other jobs on a shared machine), over ``--reps`` repetitions each:

- a pure decode step of 32 sequences, and the same with a prompt chunk of ``--chunk`` tokens fused in;
- inside them: scheduling, batch building (metadata), the layers' parts (QKV, attention, O, MLP),
  the LM head over the sampled rows, sampling, and the per-step bookkeeping;
- HF ``generate``'s decode step at batch 1 for comparison (the ITL reference of the issue).

Usage: ``OMP_NUM_THREADS=1 PYTHONPATH=src python bench/inference_step_profile.py``
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

import inference_bench as ib  # noqa: E402  (same folder)

T = defaultdict(list)


@contextlib.contextmanager
def timed(name: str):
    t0 = time.thread_time()
    yield
    T[name].append(time.thread_time() - t0)


def med(name: str) -> float:
    return 1e3 * statistics.median(T[name]) if T[name] else float("nan")


_LABEL = ["decode"]


def profile_step(engine, reps: int, label: str, chunk: int, prompts) -> None:
    """Times ``engine.step()`` pieces; re-adds a fresh prompt chunk each rep when ``chunk``."""
    _LABEL[0] = label
    from zerospeed.inference import SamplingParams
    from zerospeed.inference.attention import AttentionMetadata

    model = engine.model
    for r in range(reps):
        if chunk:
            rng = random.Random(len(T[f"{label}:step"]))  # fresh tokens: no prefix-cache hit
            engine.add_request(f"p{label}{len(T[f'{label}:step'])}", [rng.randrange(3, 32000) for _ in range(chunk)],
                               SamplingParams(max_new_tokens=1, ignore_eos=True))
        with timed(f"{label}:step"):
            with timed(f"{label}:schedule"):
                batch = engine.scheduler.schedule()
            nd = batch.num_decodes
            items = [(s.num_computed, n, s.blocks) for s, n in batch.items]
            ids = [t for s, n in batch.items for t in s.tokens[s.num_computed:s.num_computed + n]]
            rows, t = [], 0
            for s, n in batch.items:
                t += n
                if s.num_computed + n == len(s.tokens):
                    rows.append(t - 1)
            with torch.inference_mode():
                with timed(f"{label}:meta"):
                    meta = AttentionMetadata.build(items, nd, engine.block_size, engine.device, engine.workspace,
                                                   engine._decode_kernel)
                    x = torch.tensor(ids)
                with timed(f"{label}:layers"):
                    h = model.embed(x)
                    cos, sin = model.rotary.lookup(meta.positions, h.dtype)
                    for i, layer in enumerate(model.layers):
                        a = layer.attn
                        with timed(f"{label}:norm"):
                            y = layer.input_norm(h)
                        with timed(f"{label}:qkv"):
                            qkv = a.qkv(y)
                        Tn = y.shape[0]
                        q, k, v = qkv.split([a.hq * a.d, a.hkv * a.d, a.hkv * a.d], dim=-1)
                        with timed(f"{label}:rotary"):
                            from zerospeed.inference.models.layers import apply_rotary
                            q = apply_rotary(q.view(Tn, a.hq, a.d), cos, sin, a.rotary_dim)
                            k = apply_rotary(k.view(Tn, a.hkv, a.d), cos, sin, a.rotary_dim)
                        with timed(f"{label}:attention"):
                            o = meta.attend(q, k, v.view(Tn, a.hkv, a.d), engine.kv.k[i], engine.kv.v[i], None,
                                            a.window)
                        with timed(f"{label}:o_proj"):
                            h = h + a.o(o)
                        with timed(f"{label}:norm"):
                            y = layer.post_norm(h)
                        with timed(f"{label}:mlp"):
                            h = h + layer.mlp(y)
                    h = model.norm(h)
                with timed(f"{label}:lm_head"):  # as the engine: greedy tokens straight from the head if it can
                    last = h.index_select(0, torch.tensor(rows))
                    greedy = model.greedy_tokens(last)
                    logits = model.compute_logits(last) if greedy is None else None
            with timed(f"{label}:bookkeeping"):
                engine.scheduler.after_forward(batch)
                need = [s for s, _ in batch.items if s.num_remaining == 0]
            from zerospeed.inference.sampling import sample
            with timed(f"{label}:sample"):
                toks = greedy.tolist() if greedy is not None else sample(logits, need)[0]
            with timed(f"{label}:bookkeeping"):
                for s, tok in zip(need, toks):
                    s.tokens.append(tok)
                    engine._num_generated += 1
                    engine._check_stop(s, tok)
                    if s.is_finished:
                        engine._seqs.pop(s.request_id, None)
        T[f"{label}:rows"].append(len(rows))
        T[f"{label}:tokens"].append(len(ids))


def hf_batch1(prompt, reps: int) -> None:
    from transformers import LogitsProcessorList

    model = ib._hf_model()
    steps = []

    class Clock:
        def __call__(self, input_ids, scores):
            steps.append(time.thread_time())
            return scores

    with torch.no_grad():
        model.generate(torch.tensor([prompt]), max_new_tokens=reps + 1, min_new_tokens=reps + 1, do_sample=False,
                       pad_token_id=0, logits_processor=LogitsProcessorList([Clock()]))
    T["hf1:step"] = [b - a for a, b in zip(steps, steps[1:])]


def linear_layouts(rows: int, reps: int) -> None:
    """The LM head (32000 x 256) and MLP shapes through F.linear vs alternatives."""
    torch.manual_seed(0)
    for name, (n, k) in {"lm_head": (32000, 256), "gate_up": (1280, 256), "down": (256, 640)}.items():
        w = torch.randn(n, k)
        x = torch.randn(rows, k)
        wt = w.t().contiguous()
        cands = {"F.linear": lambda: F.linear(x, w), "x@wT(pre-transposed)": lambda: x @ wt,
                 "addmm-free mm(x, w.t())": lambda: torch.mm(x, w.t())}
        try:
            wp = torch.ops.mkldnn._reorder_linear_weight(w, rows) if hasattr(torch.ops.mkldnn, "_reorder_linear_weight") else None
        except Exception:
            wp = None
        if torch.backends.mkldnn.is_available():
            try:
                wm = w.to_mkldnn()
                cands["mkldnn_linear"] = lambda: torch._C._nn.mkldnn_linear(x.to_mkldnn(), wm).to_dense()
            except Exception as e:  # noqa: BLE001
                print("mkldnn_linear unavailable:", e)
        try:
            packed = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
            cands["mkl_packed"] = lambda: torch.ops.mkl._mkl_linear(x, packed, w, None, rows)
        except Exception as e:  # noqa: BLE001
            print("mkl packed linear unavailable:", type(e).__name__, str(e)[:100])
        ref = F.linear(x, w)
        for c, fn in cands.items():
            for _ in range(3):
                fn()
            ts = []
            for _ in range(reps):
                t0 = time.thread_time()
                y = fn()
                ts.append(time.thread_time() - t0)
            same = torch.equal(y, ref)
            print(f"  {name:8s} rows={rows:3d} {c:26s} {1e3 * statistics.median(ts):7.3f} ms  bitwise_same={same}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cap", default="none")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--layouts", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from zerospeed.inference import SamplingParams, build_engine

    from zerospeed.inference import cpu_kernel

    kernel = cpu_kernel.decode_attention

    def timed_kernel(*a, **k):  # the C kernel's own share of "attention"
        with timed(f"{_LABEL[0]}:kernel"):
            return kernel(*a, **k)

    cpu_kernel.decode_attention = timed_kernel
    prompts = ib.requests()
    engine = build_engine(str(ib.MODEL_DIR), max_num_batched_tokens=512, block_size=16, max_num_seqs=64,
                          kv_cache_memory=256 << 20, max_prefill_tokens_with_decodes=None)
    sp = SamplingParams(max_new_tokens=64, ignore_eos=True)
    for i in range(args.seqs):
        engine.add_request(str(i), prompts[i], sp)
    while engine.scheduler.waiting or any(s.num_remaining > 1 for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    print(f"running {len(engine.scheduler.running)} sequences, contexts "
          f"{min(s.num_computed for s in engine.scheduler.running)}-{max(s.num_computed for s in engine.scheduler.running)}")
    for r in range(args.reps):
        profile_step(engine, 1, "decode", 0, prompts)
        profile_step(engine, 1, "mixed", args.chunk, prompts)
        engine.step()  # the chunk's sequence (max_new_tokens=1) finishes here
    parts = ["step", "schedule", "meta", "layers", "norm", "qkv", "rotary", "attention", "kernel", "o_proj", "mlp", "lm_head",
             "sample", "bookkeeping"]
    print(f"CPU ms per step (median of {args.reps}; parts inside 'layers' summed over the 4 layers):")
    for lab in ("decode", "mixed"):
        print(f"  {lab:7s} tokens={T[f'{lab}:tokens'][0]:4d} sampled_rows={T[f'{lab}:rows'][0]:3d}: "
              + "  ".join(f"{p} {_per_step(lab, p):.2f}" for p in parts))
    if not args.skip_hf:
        hf_batch1(prompts[0][:136], args.reps)
        print(f"  HF generate batch 1, decode step: {med('hf1:step'):.2f} ms (p95 {1e3 * ib._pct(T['hf1:step'], 0.95):.2f})")
    if args.layouts:
        for rows in (1, 8, 32):
            linear_layouts(rows, args.reps)


def _per_step(lab: str, part: str) -> float:
    xs = T[f"{lab}:{part}"]
    n = len(T[f"{lab}:step"])
    per = len(xs) // n if n else 1
    return 1e3 * statistics.median([sum(xs[i * per:(i + 1) * per]) for i in range(n)]) if xs else float("nan")


if __name__ == "__main__":
    main()
