"""Communication-efficient scale-out (issue #28): bytes on the link, step time and loss, 2 hosts x 2 processes.

Two network namespaces joined by a veth pair (tests/netns_hosts.py), 2 processes each (torchrun, world 4), the
link capped on both ends by a token bucket (``tc ... tbf``) at 1 Gbit/s and 200 Mbit/s, and uncapped. Model: an
MLP of 2.1M parameters (fp32) on seeded random regression data, so that communication dominates when capped.

Rows: DDP-equivalent (zerospeed ZeRO-0), ZeRO-2 and ZeRO-3 flat (``ZEROSPEED_HIERARCHICAL=0``) and hierarchical,
ZeRO++ parts alone and together (qwZ, qgZ, hpZ), 1-bit Adam (zerospeed.ops.onebit_adam.OneBitAdam in a plain
loop; its freeze_step is the warm-up, 20 steps by default, so the timed steps are compressed; an Adam twin runs
the same schedule), 0/1 Adam and 1-bit LAMB (optimizer types ZeroOneAdam / OneBitLamb through zerospeed.initialize
at ZeRO-0, DeepSpeedExamples' settings scaled down, timed after their warm-up / freeze; twins AdamW / Lamb), and DeepSpeed 0.19.8 ZeRO-3 (and ZeRO++) from the bench
venv where it runs. Per row: bytes per step on host A's veth (rx+tx) over the timed steps, the ZeRO formula per
host link (2Ψ x 4 B for stages 0-2, 3Ψ x 4 B for stage 3), step time, the loss after the last step.

Needs root. Usage: ``OMP_NUM_THREADS=1 .venv/bin/python bench/comm_bench.py [--steps 4 --warmup 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO / "tests"))

from common import write_results  # noqa: E402

WORKER = r'''
import json, os, sys, time
import torch, torch.distributed as dist
from torch import nn

out, kind, cfg, steps, warmup = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
if kind == "ds":
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
else:
    import zerospeed
    zerospeed.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 512))
num_params = sum(p.numel() for p in model.parameters())
if kind == "onebit":
    from zerospeed.ops.onebit_adam import OneBitAdam
    opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=warmup)  # timed steps are all compressed
    def step(i):
        x = torch.randn(8, 512, generator=torch.Generator().manual_seed(100 * i + rank))
        loss = nn.functional.mse_loss(model(x), x.sin())
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss
else:
    if kind == "ds":
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        engine, _, _, _ = zerospeed.initialize(model=model, config=cfg)
    def step(i):
        x = torch.randn(8, 512, generator=torch.Generator().manual_seed(100 * i + rank))
        t0 = time.perf_counter()
        loss = nn.functional.mse_loss(engine(x), x.sin())
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        PHASES["forward"] += t1 - t0
        PHASES["backward"] += t2 - t1
        PHASES["optimizer"] += t3 - t2
        return loss
PHASES = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}

def veth():
    base = f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/"
    return sum(int(open(base + k).read()) for k in ("rx_bytes", "tx_bytes"))

for i in range(warmup):
    step(i)
dist.barrier()
if kind != "onebit":
    PHASES.update(forward=0.0, backward=0.0, optimizer=0.0)
before, t0, c0 = veth(), time.perf_counter(), time.process_time()
for i in range(steps):
    loss = step(warmup + i)
dist.barrier()
elapsed, cpu, after = time.perf_counter() - t0, time.process_time() - c0, veth()
total = loss.detach().float().reshape(1)
dist.all_reduce(total)
if rank == 0:
    kernel = None
    if kind == "zs" and (cfg["zero_optimization"].get("zero_quantized_weights")
                         or cfg["zero_optimization"].get("zero_quantized_gradients")):
        from zerospeed.zero import zeropp
        kernel = zeropp.kernel_path()
    json.dump({"step_s": elapsed / steps, "veth_bytes_per_step": (after - before) / steps, "num_params": num_params,
               "loss": total.item() / world, "cpu_s": cpu / steps, "kernel": kernel,
               **({f"{k}_s": v / steps for k, v in PHASES.items()} if kind != "onebit" else {})},
              open(os.path.join(out, "result.json"), "w"))
'''

ADAMW = {"type": "AdamW", "params": {"lr": 1e-3}}

# 0/1 Adam and 1-bit LAMB: DeepSpeedExamples' bing_bert seq128 configs (shared/ds_configs), lr / weight decay /
# coefficient clamps as published, the step counts scaled down 1000x in samples: 0/1 Adam (4K batch)
# var_freeze_step 12500 -> 12 and local_step_scaler 32678 -> 32; 1-bit LAMB (64K batch = 16x 4K) freeze_step
# 1000 -> 16. Their twins: the same lr and weight decay uncompressed (AdamW; DeepSpeed's published LAMB config).
ZO_VAR_FREEZE, ZO_LOCAL_SCALER, LAMB_FREEZE = 12, 32, 16
ZERO_ONE_ADAM = {"type": "ZeroOneAdam", "params": {
    "lr": 4e-4, "weight_decay": 0.01, "bias_correction": False, "var_freeze_step": ZO_VAR_FREEZE,
    "local_step_scaler": ZO_LOCAL_SCALER, "cuda_aware": False, "comm_backend_name": "nccl"}}
ZERO_ONE_TWIN = {"type": "AdamW", "params": {"lr": 4e-4, "weight_decay": 0.01}}
LAMB_PARAMS = {"lr": 0.011, "weight_decay": 0.01, "bias_correction": False, "max_coeff": 0.3, "min_coeff": 0.01}
ONEBIT_LAMB = {"type": "OneBitLamb", "params": {
    **LAMB_PARAMS, "freeze_step": LAMB_FREEZE, "cuda_aware": False, "comm_backend_name": "nccl",
    "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1}}
LAMB_TWIN = {"type": "Lamb", "params": LAMB_PARAMS}


def _zs(stage: int, optimizer: dict = ADAMW, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 0, "optimizer": optimizer,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 1 << 24, "allgather_bucket_size": 1 << 24,
                                  "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, **zero}}


#: (row name, worker kind, config, extra environment, formula factor (x Ψ x 4 B))
ROWS = [
    ("DDP-equivalent (zerospeed ZeRO-0)", "zs", _zs(0), {}, 2),
    ("ZeRO-2 flat", "zs", _zs(2), {"ZEROSPEED_HIERARCHICAL": "0"}, 2),
    ("ZeRO-2 hierarchical", "zs", _zs(2), {}, 2),
    ("ZeRO-3 flat", "zs", _zs(3), {"ZEROSPEED_HIERARCHICAL": "0"}, 3),
    ("ZeRO-3 hierarchical", "zs", _zs(3), {}, 3),
    ("ZeRO++ qwZ", "zs", _zs(3, zero_quantized_weights=True), {}, 3),
    ("ZeRO++ qgZ", "zs", _zs(3, zero_quantized_gradients=True), {}, 3),
    ("ZeRO++ hpZ", "zs", _zs(3, zero_hpz_partition_size=2), {}, 3),
    ("ZeRO++ qwZ+qgZ+hpZ", "zs", _zs(3, zero_quantized_weights=True, zero_quantized_gradients=True,
                                       zero_hpz_partition_size=2), {}, 3),
    ("ZeRO++ qwZ+qgZ+hpZ, torch quantizer", "zs", _zs(3, zero_quantized_weights=True, zero_quantized_gradients=True,
                                                        zero_hpz_partition_size=2),
     {"ZEROSPEED_FAST_PATHS": "block_quant=torch"}, 3),
    ("1-bit Adam (timed after its warm-up)", "onebit", {}, {}, 2),
    ("Adam, DDP-equivalent, on 1-bit Adam's schedule", "zs", _zs(0), {}, 2),
    ("0/1 Adam (timed after var_freeze_step)", "zs", _zs(0, ZERO_ONE_ADAM), {}, 2),
    ("Adam, DDP-equivalent, on 0/1 Adam's schedule", "zs", _zs(0, ZERO_ONE_TWIN), {}, 2),
    ("1-bit LAMB (timed after its freeze_step)", "zs", _zs(0, ONEBIT_LAMB), {}, 2),
    ("LAMB, DDP-equivalent, on 1-bit LAMB's schedule", "zs", _zs(0, LAMB_TWIN), {}, 2),
    ("DeepSpeed 0.19.8 ZeRO-3", "ds", _zs(3), {}, 3),
    ("DeepSpeed 0.19.8 ZeRO++ (qwZ+qgZ+hpZ)", "ds", _zs(3, zero_quantized_weights=True, zero_quantized_gradients=True,
                                                        zero_hpz_partition_size=2), {}, 3),
]

CAPS = [None, "1gbit", "200mbit"]

#: warm-up steps (untimed) of the rows that need their own: the timed steps are all in the compressed phase
#: (0/1 Adam: frozen from step var_freeze_step + 2, its step 1 being the initialisation step; 1-bit LAMB:
#: compressing from step freeze_step + 1); 1-bit Adam and its twin take --onebit-warmup
ROW_WARMUP = {"0/1 Adam (timed after var_freeze_step)": ZO_VAR_FREEZE + 1,
              "Adam, DDP-equivalent, on 0/1 Adam's schedule": ZO_VAR_FREEZE + 1,
              "1-bit LAMB (timed after its freeze_step)": LAMB_FREEZE,
              "LAMB, DDP-equivalent, on 1-bit LAMB's schedule": LAMB_FREEZE}

#: compressed row -> its uncompressed twin (same link, same steps)
TWINS = {"1-bit Adam (timed after its warm-up)": "Adam, DDP-equivalent, on 1-bit Adam's schedule",
         "0/1 Adam (timed after var_freeze_step)": "Adam, DDP-equivalent, on 0/1 Adam's schedule",
         "1-bit LAMB (timed after its freeze_step)": "LAMB, DDP-equivalent, on 1-bit LAMB's schedule"}


def _python(kind: str) -> str:
    return str(REPO / ".venv-bench" / "bin" / "python") if kind == "ds" else sys.executable


def _env(kind: str, extra: dict[str, str], ifname: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=ifname, **extra)
    for var in ("ZEROSPEED_HIERARCHICAL", "ZEROSPEED_FAST_PATHS"):
        if var not in extra:
            env.pop(var, None)
    if kind == "ds":
        env.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(REPO / ".venv-bench" / "torch_extensions"))
        env.pop("PYTHONPATH", None)
    else:
        env["PYTHONPATH"] = str(REPO / "src")
    return env


def _cap(hosts, rate: str | None) -> None:
    for ns, veth in zip(hosts.ns, hosts.veth):
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", veth, "root"], capture_output=True)
        if rate is not None:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", rate,
                            "burst", "256kb", "latency", "400ms"], check=True, capture_output=True)


def run_row(hosts, work: Path, name: str, kind: str, cfg: dict, extra: dict, steps: int, warmup: int,
            port: int) -> dict:
    out = work / f"row-{port}"
    out.mkdir(parents=True)
    procs = []
    for h in (0, 1):
        argv = [_python(kind), "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(h),
                "--nproc_per_node", "2", "--master_addr", hosts.addr[0], "--master_port", str(port),
                str(work / "worker.py"), str(out), kind, json.dumps(cfg), str(steps), str(warmup)]
        procs.append(hosts.start(h, argv, _env(kind, extra, hosts.veth[h])))
    errors = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            errors.append("timed out after 900 s")
        if p.returncode != 0:
            lines = [ln for ln in err.strip().splitlines() if ln.strip() and not ln.startswith("=")]
            ranked = [ln for ln in lines if ln.startswith("[rank") and "Error" in ln]  # the worker's own error
            errors.append(ranked[-1] if ranked else next((ln for ln in reversed(lines) if "Error" in ln),
                                                         lines[-1] if lines else f"exit {p.returncode}"))
            (out / f"stderr-{len(errors)}.txt").write_text(err)
    if errors or not (out / "result.json").exists():
        return {"error": "; ".join(errors)[:300] or "no result"}
    return json.loads((out / "result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--onebit-warmup", type=int, default=20, help="1-bit Adam's freeze_step (and its Adam twin's)")
    parser.add_argument("--rows", default="", help="comma-separated row-name substrings (default: all)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each row per link, interleaved across rows (step time: the median)")
    parser.add_argument("--caps", default="none,1gbit,200mbit")
    parser.add_argument("--work", default="/tmp/zerospeed-comm-bench")
    args = parser.parse_args()
    from netns_hosts import TwoHosts, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"comm_bench: {reason}")
    work = Path(args.work) / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True)
    (work / "worker.py").write_text(WORKER)
    wanted = [r for r in ROWS if not args.rows or any(s.strip() in r[0] for s in args.rows.split(","))]
    caps = [None if c == "none" else c for c in args.caps.split(",")]
    rows, port = [], 29700
    with TwoHosts(names=("hostA", "hostB")) as hosts:
        for cap in caps:
            _cap(hosts, cap)
            runs: dict[str, list[dict]] = {name: [] for name, *_ in wanted}
            loads: dict[str, list[float]] = {name: [] for name, *_ in wanted}
            for _ in range(args.repeat):  # interleaved: a load change on the shared machine hits every row alike
                for name, kind, cfg, extra, factor in wanted:
                    if runs[name] and "error" in runs[name][-1]:
                        continue
                    port += 1
                    warmup = ROW_WARMUP.get(name, args.onebit_warmup if "1-bit" in name else args.warmup)
                    if kind == "ds":
                        cfg = {**cfg, "steps_per_print": 1 << 30}  # DeepSpeed 0.19.8 divides by it
                    loads[name].append(os.getloadavg()[0])
                    runs[name].append(run_row(hosts, work, name, kind, cfg, extra, args.steps, warmup, port))
                    print(name, cap, runs[name][-1], flush=True)
            for name, kind, cfg, extra, factor in wanted:
                warmup = ROW_WARMUP.get(name, args.onebit_warmup if "1-bit" in name else args.warmup)
                row = {"link": cap or "uncapped", "row": name}
                ok = [g for g in runs[name] if "error" not in g]
                if not ok:
                    row["error"] = runs[name][-1]["error"]
                else:
                    got = sorted(ok, key=lambda g: g["step_s"])[len(ok) // 2]  # the median run
                    formula = factor * 4 * got["num_params"]
                    row.update({"params": got["num_params"], "step_s": round(got["step_s"], 3),
                                "step_s min-max": f"{min(g['step_s'] for g in ok):.3f}-"
                                                  f"{max(g['step_s'] for g in ok):.3f}",
                                "runs": len(ok), "load avg": f"{min(loads[name]):.1f}-{max(loads[name]):.1f}",
                                "rank-0 CPU s/step": round(got["cpu_s"], 3),
                                "fwd / bwd / opt s": "/".join(f"{got[k]:.3f}" for k in ("forward_s", "backward_s",
                                                                                        "optimizer_s"))
                                if "forward_s" in got else "",
                                "veth_MB_per_step": round(got["veth_bytes_per_step"] / 1e6, 2),
                                "formula_MB": round(formula / 1e6, 2),
                                "veth / formula": round(got["veth_bytes_per_step"] / formula, 3),
                                "steps": warmup + args.steps, "loss after the last step": round(got["loss"], 5)})
                    if got.get("kernel"):
                        row["quantizer"] = got["kernel"]
                rows.append(row)
                print(row, flush=True)
    for cap in {r["link"] for r in rows}:  # ratios against the plain rows of the same link, as the issue asks
        by = {r["row"]: r for r in rows if r["link"] == cap and "error" not in r}
        z3 = by.get("ZeRO-3 hierarchical")
        for r in by.values():
            if z3 and r["row"].startswith("ZeRO++"):
                r["bytes / ZeRO-3"] = round(r["veth_MB_per_step"] / z3["veth_MB_per_step"], 3)
                r["time / ZeRO-3"] = round(r["step_s"] / z3["step_s"], 3)
            twin = by.get(TWINS.get(r["row"], ""))
            if twin:
                r["bytes / twin"] = round(r["veth_MB_per_step"] / twin["veth_MB_per_step"], 3)
                r["time / twin"] = round(r["step_s"] / twin["step_s"], 3)
                r["loss - twin's"] = round(r["loss after the last step"] - twin["loss after the last step"], 5)
    notes = [
        f"CPU: {platform.processor() or platform.machine()}, shared 2-core machine with other jobs running: step "
        "times are noisy; bytes are exact counters of the veth (rx+tx on host A's end, TCP/IP headers included).",
        "Formula: per host link, rx+tx, 2 hosts: 2Ψ x 4 B (stages 0-2, and the 1-bit row's uncompressed Adam), "
        "3Ψ x 4 B (stage 3). ZeRO-3 rows use stage3_max_reuse_distance 0 (backward re-gathers, the 3Ψ case).",
        "1-bit Adam runs zerospeed.ops.onebit_adam.OneBitAdam in a plain loop (no engine; it owns the gradient "
        "and momentum communication); its warm-up steps are outside the timed window.",
        f"0/1 Adam and 1-bit LAMB run through zerospeed.initialize at ZeRO stage 0 with DeepSpeedExamples' bing_bert "
        "seq128 settings (lr, weight decay, bias_correction false, LAMB's coefficient clamps and factors as "
        "published), step counts scaled down 1000x in samples: 0/1 Adam lr 4e-4, var_freeze_step 12500 -> "
        f"{ZO_VAR_FREEZE}, local_step_scaler 32678 -> {ZO_LOCAL_SCALER} (var_update_scaler and local_step_clipper "
        f"16, the defaults), {ZO_VAR_FREEZE + 1} warm-up steps; 1-bit LAMB lr 0.011, freeze_step 1000 at a 64K "
        f"batch -> {LAMB_FREEZE}, {LAMB_FREEZE} warm-up steps. The timed steps are all compressed (0/1 Adam: "
        "frozen variance, local_step_interval 1 throughout, so one 1-bit all-reduce per step). Twins: the same "
        "lr and weight decay uncompressed: AdamW (with its bias correction), and DeepSpeed's published LAMB "
        "config (bing_bert bsz64k seq128).",
        "Loss: mean over ranks of the last step's loss; quantized rows against their plain twin in the same link.",
    ]
    paths = write_results("comm_bench", rows, params=vars(args), notes=notes)
    print(f"results: {paths[1]}")


if __name__ == "__main__":
    main()
