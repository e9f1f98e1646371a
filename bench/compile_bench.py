"""engine.compile() versus eager, at ZeRO stages 0-3, 2 processes (gloo on CPU).

For each stage: an eager engine and an ``engine.compile(backend)`` engine train the same GPT on the
same batches; reported per stage: median step time of each (warmup steps excluded, the first
compiled step included in compile time, not in step time), the ratio compiled/eager, compile
seconds (Dynamo + backend, ``engine.get_compile_time()``), graphs, graph breaks and recompiles
(``engine.compile_report()``), and the max relative loss difference over the measured steps.

DeepCompile and DeepSpeed's / FSDP2's compiled peers are not run: DeepCompile is not built in
zerospeed (see README, "torch.compile").

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD/src python bench/compile_bench.py --backend inductor --stages 0 1 2 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _worker(stages: list[int], backend: str, steps: int, warmup: int, layers: int, d_model: int,
            seq: int, micro: int) -> list[dict]:
    import torch
    import torch._dynamo
    import torch.distributed as dist

    import zerospeed
    from common import time_steps
    from gpt_model import GPT, GPTConfig

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=256, n_layer=layers, n_head=max(1, d_model // 64), d_model=d_model, seq_len=seq)
    rank, world = dist.get_rank(), dist.get_world_size()

    def batches(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i * world + rank)
        data = torch.randint(0, cfg.vocab_size, (micro, seq + 1), generator=g)
        return data[:, :-1], data[:, 1:]

    rows = []
    for stage in stages:
        out: dict = {"stage": stage}
        for mode in ("eager", "compiled"):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = GPT(cfg)
            ds = {"train_batch_size": micro * world, "steps_per_print": 0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
            engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
            losses: list[float] = []

            def step(i: int) -> None:
                x, y = batches(i)
                loss = engine(x, targets=y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())

            first = 0.0
            if mode == "compiled":
                engine.compile(backend=backend)
                t0 = time.perf_counter()
                step(-1)  # compiles
                first = time.perf_counter() - t0
                losses.clear()
            timing = time_steps(step, steps, warmup, barrier=dist.barrier)
            out[f"{mode}_step_s"] = timing.median_s
            out[f"{mode}_losses"] = losses[warmup:]
            if mode == "compiled":
                rep = engine.compile_report()
                out.update({"first_compiled_step_s": first, "compile_s": engine.get_compile_time(),
                            "graphs": rep["graphs"], "graph_breaks": rep["graph_breaks"],
                            "recompiles": rep["recompiles"]})
        eager_l, comp_l = out.pop("eager_losses"), out.pop("compiled_losses")
        out["ratio_compiled_over_eager"] = out["compiled_step_s"] / out["eager_step_s"]
        out["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(comp_l, eager_l))
        rows.append(out)
    return rows


def main() -> None:
    from common import write_results
    from zerospeed.testing import run_distributed

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="inductor")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro", type=int, default=4)
    a = p.parse_args()
    rows = run_distributed(_worker, 2, a.stages, a.backend, a.steps, a.warmup, a.layers, a.d_model, a.seq,
                           a.micro, timeout=3000)[0]
    json_path, md_path = write_results(
        "compile_bench", rows, params=vars(a),
        notes=["2 gloo processes, 1 torch thread each, on a machine shared with other jobs: timings are noisy",
               "compile_s: Dynamo + backend seconds (engine.get_compile_time()); first_compiled_step_s: wall time "
               "of the step that compiled",
               "the losses of the measured steps of the eager and compiled runs are compared "
               "(max_rel_loss_diff); DeepCompile, DeepSpeed's engine.compile and FSDP2 + torch.compile not run"])
    for row in rows:
        print(row)
    print(json_path, md_path)


if __name__ == "__main__":
    main()
