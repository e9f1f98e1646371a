"""Tensor parallelism: zerospeed AutoTP vs ZeRO-3 data parallelism vs PyTorch DTensor TP vs DeepSpeed AutoTP.

Run from the repository root, in the bench venv (it has DeepSpeed 0.19.8; this benchmark also needs
``transformers`` there: ``.venv-bench/bin/python -m pip install transformers``)::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=$PWD/src .venv-bench/bin/python bench/tp_bench.py

Same model for every row: a random-init HuggingFace Llama (GQA) built from a config, fp32, Adam
(lr 1e-4), gradient clipping 1.0, the same token batches (every rank of a tp group gets its
data-parallel replica's micro-batch). Rows, each launched as its own group of processes through
the zerospeed launcher, one after another so that peak memory belongs to one system:

* ``zerospeed-zero3-dp{2,4}``: ZeRO-3, pure data parallelism (the alternative to splitting layers);
* ``zerospeed-tp2`` (2 processes) and ``zerospeed-tp2xdp2-zero1`` (4): AutoTP through initialize;
* ``dtensor-tp2``: PyTorch-native ``parallelize_module`` with ColwiseParallel / RowwiseParallel on
  the same linears (and the LM head column-parallel, output replicated), torch.optim.Adam;
* ``deepspeed-tp2``: DeepSpeed's AutoTP training (``tensor_parallel.autotp_size``) where it runs
  on CPU (its status says why not when it does not).

Measured: median step time (max over ranks), peak RSS per rank, and for zerospeed the collectives
per step counted by ``zerospeed.comm``. Ratios are to ``dtensor-tp2`` and ``deepspeed-tp2`` at the
same world size. Results: ``bench/results/tp_bench-<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from common import (  # noqa: E402
    format_bytes,
    launch_workers,
    package_version,
    peak_rss_bytes,
    time_steps,
    write_results,
)

# (row name, system, world size, tp degree, ZeRO stage)
ROWS = [("zerospeed-zero3-dp2", "zerospeed", 2, 1, 3), ("zerospeed-tp2", "zerospeed", 2, 2, 0),
        ("dtensor-tp2", "dtensor", 2, 2, 0), ("deepspeed-tp2", "deepspeed", 2, 2, 0),
        ("zerospeed-zero3-dp4", "zerospeed", 4, 1, 3), ("zerospeed-tp2xdp2-zero1", "zerospeed", 4, 2, 1)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(r[0] for r in ROWS), help="comma-separated subset of the rows")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per row")
    p.add_argument("--no_write", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------- worker side

def build_model(args: argparse.Namespace) -> Any:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=8000, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.6875),
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=args.seq, tie_word_embeddings=False)
    return tf.LlamaForCausalLM(cfg)


def batches(args: argparse.Namespace, dp_rank: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(1000 + dp_rank)
    return [torch.randint(0, 8000, (args.micro_batch, args.seq), generator=g) for _ in range(args.steps + args.warmup)]


def ds_config(args: argparse.Namespace, dp: int, tp: int) -> dict[str, Any]:
    # no train_batch_size: DeepSpeed derives it from the data-parallel degree its TP groups leave
    cfg: dict[str, Any] = {"gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": args.micro_batch,
                           "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}, "gradient_clipping": 1.0,
                           "zero_optimization": {"stage": args.stage}, "steps_per_print": 10 ** 9}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return cfg


def run_engine(engine: Any, data: list[Any]) -> Callable[[int], float]:
    def step(i: int) -> float:
        ids = data[i]
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    return step


def worker_zerospeed(args: argparse.Namespace) -> tuple[Callable[[int], float], Callable[[], Any]]:
    import torch.distributed as dist

    import zerospeed
    from zerospeed import comm

    dp = dist.get_world_size() // args.tp
    engine, _, _, _ = zerospeed.initialize(model=build_model(args), config=ds_config(args, dp, args.tp))
    mesh = comm.get_mesh()
    step = run_engine(engine, batches(args, mesh.dp_rank if mesh else dist.get_rank()))
    return step, lambda: {op: d["count"] for op, d in engine.last_step_comms.items()}


def worker_deepspeed(args: argparse.Namespace) -> tuple[Callable[[int], float], Callable[[], Any]]:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import groups

    model = build_model(args)
    dp = dist.get_world_size() // args.tp
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(args, dp, args.tp))
    return run_engine(engine, batches(args, groups.get_data_parallel_rank())), lambda: None


def worker_dtensor(args: argparse.Namespace) -> tuple[Callable[[int], float], Callable[[], Any]]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    if world // args.tp > 1:
        raise NotImplementedError("this row measures pure TP (dp 1)")
    model = build_model(args)
    plan: dict[str, Any] = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(args.layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    data = batches(args, 0)
    tp_group = mesh["tp"].get_group()

    def clip(max_norm: float) -> None:
        # torch's clip_grad_norm_ refuses a mix of DTensor (split linears) and plain tensor (embedding,
        # norms) gradients, so the global norm is summed by hand: shards over the tp group, replicas once
        sharded, replicated = torch.zeros(()), torch.zeros(())
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for g in grads:
            if isinstance(g, DTensor):
                local = g.to_local().pow(2).sum()
                if any(pl.is_shard() for pl in g.placements):
                    sharded += local
                else:
                    replicated += local
            else:
                replicated += g.pow(2).sum()
        dist.all_reduce(sharded, group=tp_group)
        coef = min(1.0, max_norm / (float(sharded + replicated) ** 0.5 + 1e-6))
        for g in grads:
            g.mul_(coef)

    def step(i: int) -> float:
        ids = data[i]
        loss = model(ids, labels=ids).loss
        loss.backward()
        clip(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())

    return step, lambda: None


WORKERS = {"zerospeed": worker_zerospeed, "deepspeed": worker_deepspeed, "dtensor": worker_dtensor}


def worker_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.worker == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    record: dict[str, Any]
    try:
        step, comms = WORKERS[args.worker](args)
        losses: list[float] = []
        timing = time_steps(lambda i: losses.append(step(i)), args.steps, args.warmup, barrier=dist.barrier)
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, {"median_s": timing.median_s, "peak_rss": peak_rss_bytes()})
        record = {"status": "ok", "median_s_per_rank": [r["median_s"] for r in per_rank],
                  "peak_rss_per_rank": [r["peak_rss"] for r in per_rank], "losses": losses,
                  "collectives_per_step": comms()}
    except Exception as exc:  # noqa: BLE001 - the row reports why it could not run
        record = {"status": "failed", "reason": f"{type(exc).__name__}: {str(exc)[:300]}"}
    if rank == 0 and args.result:
        Path(args.result).write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- driver side

def driver_main(args: argparse.Namespace) -> None:
    wanted = [r for r in ROWS if r[0] in args.rows.split(",")]
    records: dict[str, dict[str, Any]] = {}
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    with tempfile.TemporaryDirectory(prefix="zs-tp-bench-") as tmp:
        for name, system, world, tp, stage in wanted:
            if system == "deepspeed" and package_version("deepspeed") is None:
                records[name] = {"status": "skipped", "reason": "deepspeed not installed (make bench-env)"}
                continue
            result = Path(tmp) / f"{name}.json"
            cmd = ["--worker", system, "--tp", str(tp), "--stage", str(stage), "--result", str(result),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--micro_batch", str(args.micro_batch),
                   "--seq", str(args.seq), "--hidden", str(args.hidden), "--layers", str(args.layers)]
            launched = launch_workers(Path(__file__).resolve(), cmd, num_procs=world, env=env, timeout_s=args.timeout)
            if result.exists():
                records[name] = json.loads(result.read_text())
            else:
                records[name] = {"status": "failed", "reason": launched.error or f"exit code {launched.returncode}"}
            records[name]["world"] = world
    rows = []
    for name, _, world, _, _ in wanted:
        rec = records[name]
        row: dict[str, Any] = {"row": name, "procs": world, "status": rec.get("status")}
        if rec.get("status") != "ok":
            row["note"] = rec.get("reason", "")
            rows.append(row)
            continue
        step_s, peak = max(rec["median_s_per_rank"]), max(rec["peak_rss_per_rank"])
        row.update(step_s=step_s, peak_rss_max_rank=format_bytes(peak), final_loss=rec["losses"][-1],
                   collectives_per_step=rec.get("collectives_per_step"))
        for ref in ("dtensor-tp2", "deepspeed-tp2", f"zerospeed-zero3-dp{world}"):
            other = records.get(ref)
            if ref != name and other and other.get("status") == "ok" and other.get("world") == world:
                row[f"time_vs_{ref}"] = step_s / max(other["median_s_per_rank"])
                row[f"rss_vs_{ref}"] = peak / max(other["peak_rss_per_rank"])
        rows.append(row)
    for row in rows:
        print("[tp_bench] " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if args.no_write:
        return
    params = {k: getattr(args, k) for k in ("steps", "warmup", "micro_batch", "seq", "hidden", "layers")}
    notes = ["HF Llama (GQA 8/4 heads, vocab 8000), fp32, Adam lr 1e-4, clip 1.0, one torch thread per rank, gloo",
             "step time = max over ranks of each rank's median step; peak RSS = max over ranks",
             "the machine (2 cores) was shared with other jobs while this ran: compare ratios within this file only"]
    json_path, md_path = write_results("tp_bench", rows, params=params, notes=notes)
    print(f"[tp_bench] wrote {json_path} and {md_path}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
    else:
        driver_main(args)


if __name__ == "__main__":
    main()
