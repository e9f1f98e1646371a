"""One sp_bench trial on every rank (started by the launcher): train a random-init Llama at one sequence length with
Ulysses sequence parallelism, through zerospeed or DeepSpeed 0.19.8's ALST (same model, data, loss and tiling
recipe), or with PyTorch's context parallel (``torch_cp``: ring attention over DTensor shards of the sequence), and
write each rank's peak activation memory, step wall times and step CPU times (this process, all its threads, user +
system: the compute and the gloo transfers, without the time spent waiting for a core or a peer). ``--dp N`` at
``--sp 1`` is the data-parallel baseline on the same number of ranks: each rank trains its own sample.

Memory (``--memory``): "rss" (what the longest-sequence search uses) is the peak resident set size during the steps
(the kernel's high-water mark, reset just before them through ``/proc/self/clear_refs``) minus the resident size
just before them; the model, optimizer and imports are excluded, so the two libraries' import sizes do not count.
sp_bench runs it with glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``) so freed blocks leave the resident
set. "allocated" (a diagnostic) is the peak of the tensor bytes allocated during the steps and not yet freed, from
torch's profiler's allocation events: frees made on threads the profiler does not follow (gloo's workers release
the all-to-all buffers) are missed, and reserved but untouched buffers count. Modes: "plain" (HF's
graph), "tiled" (TiledMLP on every MLP, ceil(seq/hidden) tiles as DeepSpeed's example, and the tiled fused
logits+loss), "tiled+ckpt" (plus activation checkpointing of every decoder layer with CPU offload of the
checkpoints, ``checkpoint_in_cpu``; on CPU they are in host memory already), "tiled+ckpt_no_offload" (the same
without the offload setting: DeepSpeed 0.19.8's offload path loses the checkpointed hidden states when the device
is the CPU, see the bench notes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The resident high-water mark since :func:`reset_peak_rss` (or the process start where it cannot be reset)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size (Linux >= 4.0)
    except OSError:
        pass


class AllocatedPeak:
    """The peak of the tensor bytes allocated inside the context and not yet freed (torch profiler's memory events
    on the threads it follows)."""

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        self.prof.__exit__(*exc)
        events = [e for e in self.prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        live = peak = 0
        for e in sorted(events, key=lambda e: e.start_ns()):
            live += e.nbytes()
            peak = max(peak, live)
        self.peak_bytes = peak
        return False


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=max(args.seq, 128), tie_word_embeddings=False,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["zerospeed", "deepspeed", "torch_cp"], required=True)
    p.add_argument("--sp", type=int, required=True)
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel degree (the launch has sp x dp ranks); at SP 1 each rank trains its own sample")
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--mode", choices=["plain", "tiled", "tiled+ckpt", "tiled+ckpt_no_offload"], default="plain")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--memory", choices=["rss", "allocated"], default="rss",
                   help="rss: peak resident size; allocated: profiler-counted tensor bytes (slows the steps)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.impl == "torch_cp":
        return torch_cp(args)
    if args.impl == "deepspeed":
        import deepspeed as lib
        ckpt_lib = lib.checkpointing  # an attribute of the package in DeepSpeed, not a module
        from deepspeed.runtime.sequence_parallel.ulysses_sp import (TiledFusedLogitsLoss, TiledMLP,
                                                                    UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter)
        from deepspeed.utils import groups
        lib.init_distributed(dist_backend="gloo")
    else:
        import zerospeed as lib
        import zerospeed.checkpointing as ckpt_lib
        from zerospeed.runtime.sequence_parallel.ulysses_sp import (TiledFusedLogitsLoss, TiledMLP,
                                                                    UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter)
        from zerospeed.utils import groups
        lib.init_distributed(dist_backend="gloo")
    import torch.distributed as dist

    rank = dist.get_rank()
    if dist.get_world_size() != args.sp * args.dp:
        raise SystemExit(f"sp_worker: {dist.get_world_size()} ranks launched for --sp {args.sp} x --dp {args.dp}")
    if args.dp > 1 and args.sp > 1:
        raise SystemExit("sp_worker: --dp > 1 is the data-parallel baseline at SP 1 only")
    model = build_model(args)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", args.sp, 1) if args.sp > 1 else None
    if args.mode != "plain":
        def mlp_forward(module, x):
            return module.down_proj(module.act_fn(module.gate_proj(x)) * module.up_proj(x))

        for layer in model.model.layers:
            mlp = layer.mlp

            def tiled(x, mlp=mlp):
                shards = max(1, math.ceil(x.shape[-2] / x.shape[-1]))
                return TiledMLP.apply(mlp_forward, mlp, x, shards, [p for p in mlp.parameters()])

            mlp.forward = tiled
    if args.mode.startswith("tiled+ckpt"):
        model._set_gradient_checkpointing(True, ckpt_lib.checkpoint)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 2},
              "sequence_parallel_size": args.sp}
    kwargs = {"mpu": mpu} if mpu is not None else {}
    engine, _, _, _ = lib.initialize(model=model, model_parameters=model.parameters(), config=config, **kwargs)
    if args.mode == "tiled+ckpt":
        ckpt_lib.configure(None, checkpoint_in_cpu=True)  # DeepSpeed's CPU offload of the checkpoints
    sp_group = groups._get_sequence_parallel_group() if args.sp > 1 else None
    sp_rank = groups._get_sequence_parallel_rank() if args.sp > 1 else 0
    g = torch.Generator().manual_seed(1 + (rank if args.dp > 1 else 0))  # data parallel: a sample per rank
    batches = []
    for _ in range(args.steps):
        ids = torch.randint(1, args.vocab, (1, args.seq), generator=g)
        batches.append({"input_ids": ids, "position_ids": torch.arange(args.seq).unsqueeze(0), "labels": ids.clone()})

    class Shared(list):
        sp_shared_samples = True

    if args.sp > 1:
        # both libraries: each rank reads its own copy of the same batch; zerospeed's marked loader skips the
        # exchange, DeepSpeed's adapter (no such mark) exchanges and runs every rank's copy: take its first
        loader = UlyssesSPDataLoaderAdapter(Shared(batches) if args.impl == "zerospeed" else batches, sp_rank=sp_rank,
                                            sp_group=sp_group, sp_world_size=args.sp, device="cpu")
        micro = []
        for _ in range(args.steps):
            micro.append(next(loader))
            if args.impl == "deepspeed":
                for _ in range(args.sp - 1):
                    next(loader)
    else:
        micro = [{"input_ids": b["input_ids"], "position_ids": b["position_ids"],
                  "shift_labels": F.pad(b["labels"], (0, 1), value=-100)[:, 1:]} for b in batches]
    module = engine.module
    vocab = args.vocab

    def loss_fn(head, x, y):
        logits = head(x).float()
        return F.cross_entropy(logits.view(-1, vocab), y.reshape(-1), ignore_index=-100, reduction="sum")

    phases = Phases() if os.environ.get("SP_BENCH_PHASES") else None

    def step(b):
        y = b["shift_labels"]
        mark = phases.mark if phases is not None else (lambda name: None)
        mark(None)
        if args.mode == "plain":
            logits = engine(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
            mark("forward")
            total = loss_fn(lambda x: x, logits, y)
        else:
            hidden = module.model(input_ids=b["input_ids"], position_ids=b["position_ids"]).last_hidden_state
            shards = max(1, math.ceil(hidden.shape[1] * vocab / (hidden.shape[1] * 1024)))  # ~1K-column tiles
            total = TiledFusedLogitsLoss.apply(loss_fn, module.lm_head, hidden, y, None, shards,
                                               [module.lm_head.weight], "sum")
        good = (y != -100).sum()
        loss = total / good.clamp_min(1)
        if args.sp > 1:
            losses = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
            goods = torch.distributed.nn.functional.all_gather(good, group=sp_group)
            loss = sum(l * n for l, n in zip(losses, goods)) / max(sum(goods), 1)
        mark("loss")
        engine.backward(loss)
        mark("backward")
        engine.step()
        mark("step")
        return float(loss)

    dist.barrier()
    profiler = None
    if os.environ.get("SP_BENCH_PROFILE"):  # a directory: each rank's CPU-time profile of the steps after the first
        import cProfile

        profiler = cProfile.Profile(time.thread_time)  # the main thread only: gloo's threads are in the phases

    ops = None
    if os.environ.get("SP_BENCH_OPS"):  # a directory: each rank's torch profiler table of the steps after the first
        from torch.profiler import ProfilerActivity, profile

        ops = profile(activities=[ProfilerActivity.CPU])
    times, cpu, losses = [], [], []

    def run_steps():
        for i, b in enumerate(micro):
            if phases is not None and i == 1:
                phases.threads_before = thread_cpu()
            if profiler is not None and i == 1:
                profiler.enable()
            if ops is not None and i == 1:
                ops.__enter__()
            t0, c0 = time.perf_counter(), time.process_time()
            losses.append(step(b))
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)

    record = measured(args, run_steps, times, cpu, losses)
    if phases is not None:
        record["phases"] = phases.per_step(len(micro))
        if phases.threads_before is not None:
            after, n = thread_cpu(), max(1, len(micro) - 1)
            record["thread_cpu_s"] = {name: round((after.get(name, 0.0) - phases.threads_before.get(name, 0.0)) / n, 4)
                                      for name in after}
    if ops is not None:
        ops.__exit__(None, None, None)
        table = ops.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)
        with open(os.path.join(os.environ["SP_BENCH_OPS"], f"sp{args.sp}-dp{args.dp}-seq{args.seq}-rank{rank}.txt"),
                  "w") as f:
            f.write(table)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(os.path.join(os.environ["SP_BENCH_PROFILE"], f"sp{args.sp}-rank{rank}.prof"))
    record["rank"] = rank
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    if args.sp > 1:
        UlyssesSPAttentionHF_unregister = getattr(UlyssesSPAttentionHF, "unregister_from_transformers", None)
        if UlyssesSPAttentionHF_unregister is not None:
            UlyssesSPAttentionHF_unregister()
    sys.stdout.flush()


def thread_cpu() -> dict:
    """Each thread's CPU time (user + system, clock ticks from /proc) summed by thread name."""
    out: dict = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        name = "main" if int(tid) == os.getpid() else name
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


class Phases:
    """A diagnostic (``SP_BENCH_PHASES=1``): per phase of the steps after the first, summed then divided by their
    number: the CPU time of the whole process (all threads: gloo's work included) split into user and system, the
    main thread's CPU time, the wall time, the minor page faults and the voluntary / involuntary context switches
    (``getrusage``, all threads)."""

    KEYS = ("cpu_s", "user_s", "sys_s", "main_thread_s", "wall_s", "minor_faults", "vol_switches", "invol_switches")

    def __init__(self) -> None:
        self.sums: dict[str, list[float]] = {}
        self.calls = 0
        self.last = (0.0,) * len(self.KEYS)
        self.threads_before: dict | None = None

    @staticmethod
    def now() -> tuple:
        u = resource.getrusage(resource.RUSAGE_SELF)
        return (time.process_time(), u.ru_utime, u.ru_stime, time.thread_time(), time.perf_counter(), u.ru_minflt,
                u.ru_nvcsw, u.ru_nivcsw)

    def mark(self, name) -> None:
        now = self.now()
        if name is None:
            self.calls += 1
        elif self.calls > 1:
            acc = self.sums.setdefault(name, [0.0] * len(self.KEYS))
            for i in range(len(self.KEYS)):
                acc[i] += now[i] - self.last[i]
        self.last = now

    def per_step(self, steps: int) -> dict:
        n = max(1, steps - 1)
        return {k: dict(zip(self.KEYS, (x / n for x in v))) for k, v in self.sums.items()}


def measured(args, run_steps, times: list, cpu: list, losses: list) -> dict:
    """Run the steps and return this rank's record: activation bytes by ``args.memory``, times, losses."""
    before = rss_bytes()
    reset_peak_rss()
    if args.memory == "allocated":
        with AllocatedPeak() as counted:
            run_steps()
        activation = counted.peak_bytes
    else:
        run_steps()
    peak = peak_rss_bytes()
    if args.memory == "rss":
        activation = max(0, peak - before)
    return {"activation_bytes": activation, "memory": args.memory, "peak_rss_bytes": peak, "rss_before_bytes": before,
            "step_s": times, "cpu_s": cpu, "losses": losses}


def torch_cp(args) -> None:
    """PyTorch's context parallel (torch.distributed.tensor.experimental.context_parallel) on the same model, data
    and loss: the sequence of the batch is sharded over a 1-d "cp" device mesh, every SDPA call inside the context
    becomes ring attention, gradients are summed over the ranks (each rank's loss is its share of the global mean).
    It fails on CPU if torch has no CPU ring kernel; the error line is then what the benchmark reports."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    if args.mode != "plain":
        raise ValueError(f"sp_worker: torch_cp is run on the plain HF graph only, not {args.mode!r}")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = build_model(args)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.steps):
        ids = torch.randint(1, args.vocab, (1, args.seq), generator=g)
        batches.append((ids, torch.arange(args.seq).unsqueeze(0), F.pad(ids, (0, 1), value=-100)[:, 1:]))

    def step(ids, pos, y):
        ids, pos, y = ids.clone(), pos.clone(), y.clone()
        with context_parallel(mesh, buffers=[ids, pos, y], buffer_seq_dims=[1, 1, 1]):
            logits = model(input_ids=ids, position_ids=pos).logits.float()
            total = F.cross_entropy(logits.view(-1, args.vocab), y.reshape(-1), ignore_index=-100, reduction="sum")
            good = (y != -100).sum()
            goods = good.clone()
            dist.all_reduce(goods)
            (total / goods.clamp_min(1)).backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        loss = total.detach().clone()
        dist.all_reduce(loss)
        return float(loss / goods.clamp_min(1))

    dist.barrier()
    times, cpu, losses = [], [], []

    def run_steps():
        for b in batches:
            t0, c0 = time.perf_counter(), time.process_time()
            losses.append(step(*b))
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)

    record = measured(args, run_steps, times, cpu, losses)
    record["rank"] = rank
    gathered = [None] * world
    dist.all_gather_object(gathered, record)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()


if __name__ == "__main__":
    main()
