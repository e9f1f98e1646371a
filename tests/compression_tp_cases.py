"""Per-rank bodies of the compression x tensor-parallelism tests (importable by run_distributed)."""

from __future__ import annotations

import json
from typing import Any

import torch

from compression_cases import DS_CONFIGS, aq, group, prune, tiny_gpt2, wq
from zerospeed import comm

MODULES = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
STEPS = 3
REAL_CONFIG = "compression__gpt2__config__ds_config_W8A8_Qgroup64_fp32.json"

# each method on the tiny HF GPT-2 (Conv1D storage, fused c_attn: rank r holds rows of q, k and v);
# under tp2 c_attn / c_fc are column-parallel and c_proj row-parallel
METHODS: dict[str, dict[str, Any]] = {
    # 8 groups: c_fc's pieces are whole groups (local path), c_attn's and c_proj's straddle (reduced)
    "wq": {"weight_quantization": wq(4, MODULES, start=8, period=1, groups=8)},
    "wq_low": {"weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_groups": 16, "quantization_type": "asymmetric"},
        "different_groups": {"ternary": group({"start_bits": 2, "target_bits": 2, "quantization_period": 0},
                                              ["mlp.c_fc", "mlp.c_proj"]),
                             "three": group({"start_bits": 3, "target_bits": 3, "quantization_period": 0},
                                            ["attn.c_attn"]),
                             "binary": group({"start_bits": 1, "target_bits": 1, "quantization_period": 0},
                                             ["attn.c_proj"])}}},
    "aq": {"activation_quantization": aq(4, MODULES)},
    "aq_static": {"activation_quantization": aq(6, MODULES, calibration="static", qtype="asymmetric")},
    "sparse": {"sparse_pruning": prune(0.5, MODULES, offset=1)},
    "sparse_topk": {"sparse_pruning": prune(0.4, ["mlp.c_fc", "attn.c_proj"], method="topk")},
    "sparse_snip": {"sparse_pruning": prune(0.5, ["mlp.c_"], method="snip_momentum", block_pattern="4x1",
                                            schedule_offset_end=2)},
    "row": {"row_pruning": prune(0.5, ["mlp.c_fc"], offset=1, related=[["mlp.c_proj"]])},
    "row_topk": {"row_pruning": prune(0.5, ["mlp.c_fc", "attn.c_proj"], method="topk")},
    "head": {"head_pruning": prune(0.5, ["attn.c_proj"], offset=1, num_heads=4, related=[["attn.c_attn"]])},
    "head_topk": {"head_pruning": prune(0.5, ["attn.c_proj"], method="topk", num_heads=4)},
}


def method_config(name: str, tp: int) -> dict[str, Any]:
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
           "compression_training": METHODS[name]}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return cfg


def real_config(tp: int) -> dict[str, Any]:
    cfg = json.loads((DS_CONFIGS / REAL_CONFIG).read_text())
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return cfg


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, 64, (4, 16), generator=g)


def train(cfg: dict[str, Any], mode: str = "config", steps: int = STEPS) -> dict[str, Any]:
    """Compress the tiny GPT-2 and train it ``steps`` optimizer steps through the engine.

    mode ``config``: init_compression on the whole model, tp from the config (initialize splits it);
    ``mpu``: tp_model_init first (DeepSpeed's order), then init_compression(mpu=<a Megatron-style mpu>);
    ``mpu_unsplit``: init_compression(mpu=...) on the whole model (it splits it), initialize(mpu=...).
    """
    import torch.distributed as dist

    import zerospeed
    from zerospeed.compression import init_compression

    model = tiny_gpt2().train()
    mpu = None
    if mode == "mpu_unsplit":  # init_compression splits the whole model over the mpu's group, then initialize
        from tp_cases import _Mpu

        world, rank = dist.get_world_size(), dist.get_rank()
        tp_group = comm.new_group(list(range(world)))
        singles = [comm.new_group([r]) for r in range(world)]
        mpu = _Mpu(tp_group, singles[rank], rank, world)
        model = init_compression(model, cfg, mpu=mpu)
    elif mode == "mpu":
        model = zerospeed.tp_model_init(model, tp_size=dist.get_world_size())
        mesh = comm.get_mesh()
        from tp_cases import _Mpu

        model = init_compression(model, cfg, mpu=_Mpu(mesh.tp_group, mesh.dp_group, mesh.tp_rank, mesh.tp_size))
    elif "compression_training" in cfg:
        model = init_compression(model, cfg)
    engine, *_ = zerospeed.initialize(model=model, config=cfg, mpu=mpu)
    gas = engine.gradient_accumulation_steps()
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(gas):
            ids = batch(step * gas + micro)
            loss = engine(ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            total += float(loss.detach()) / gas
        losses.append(total)
    from zerospeed.compression.layers import CompressedLayer

    sharded = sorted(n for n, m in engine.module.named_modules() if isinstance(m, CompressedLayer) and m.tp is not None)
    state = engine.consolidated_state_dict()
    engine.destroy()
    comm.reset_mesh()
    return {"losses": losses, "sharded": sharded, "state": {k: v for k, v in state.items() if v.is_floating_point()}}


def train_cases(cases: list[tuple[str, str]], tp: int | None = None) -> list[dict[str, Any]]:
    """``(method name or "real", mode)`` each at tp degree ``tp`` (default: the world size); the rest
    of the world is data parallel, every rank fed the same batch (so any dp degree equals one process)."""
    import torch.distributed as dist

    tp = tp or dist.get_world_size()
    dp = dist.get_world_size() // tp
    out = []
    for name, mode in cases:
        cfg = real_config(tp) if name == "real" else method_config(name, tp)
        cfg["train_batch_size"] *= dp
        if mode.startswith("mpu"):
            cfg.pop("tensor_parallel", None)
        if mode.startswith("zero"):  # ZeRO partitions each rank's tp shard (over a dp group of one here)
            cfg["zero_optimization"] = {"stage": int(mode[4:])}
        run = train(cfg, mode if mode.startswith("mpu") else "config")
        out.append(run if dist.get_rank() == 0 else {"losses": run["losses"], "sharded": run["sharded"]})
    return out


def bad_inputs() -> dict[str, str]:
    """One-line errors of compression under tp=2 (world 2)."""
    import zerospeed
    from zerospeed.compression import init_compression

    out = {}

    def err(key: str, fn: Any) -> None:
        try:
            fn()
            out[key] = "no error"
        except (TypeError, ValueError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
        comm.reset_mesh()

    class NoRank:
        def get_model_parallel_group(self) -> Any:
            return None

        def get_model_parallel_world_size(self) -> int:
            return 2

    cfg = method_config("wq", 1)
    err("mpu", lambda: init_compression(tiny_gpt2(), cfg, mpu=NoRank()))
    groups = {"weight_quantization": wq(8, ["mlp.c_fc"], groups=3)}
    err("groups", lambda: init_compression(zerospeed.tp_model_init(tiny_gpt2(), tp_size=2), {"compression_training": groups}))
    from tp_cases import _Mpu
    from zerospeed.compression import redundancy_clean

    whole = init_compression(tiny_gpt2(), cfg)
    err("clean_mpu", lambda: redundancy_clean(whole, cfg, mpu=_Mpu(None, None, comm.get_rank(), 2)))
    singles = [comm.new_group([r]) for r in range(2)]  # (collective: every rank creates both)
    alone = _Mpu(singles[comm.get_rank()], None, 0, 1)
    err("other_mpu", lambda: init_compression(zerospeed.tp_model_init(tiny_gpt2(), tp_size=2), cfg, mpu=alone))
    from zerospeed.compression import quantize

    err("ptq", lambda: quantize(zerospeed.tp_model_init(tiny_gpt2(), tp_size=2), bits=8, modules=["mlp"]))
    head = {"weight_quantization": wq(8, ["lm_head", "mlp.c_fc"])}
    err("lm_head", lambda: init_compression(zerospeed.tp_model_init(tiny_gpt2(), tp_size=2), {"compression_training": head}))
    return out


# redundancy_clean under tp: every technique at once, and asymmetric grids with topk rows
CLEAN: dict[str, dict[str, Any]] = {
    "mixed": {"weight_quantization": wq(4, MODULES, groups=8), "activation_quantization": aq(8, MODULES),
              "sparse_pruning": prune(0.5, ["attn.c_attn"]),
              "row_pruning": prune(0.5, ["mlp.c_fc"], related=[["mlp.c_proj"]]),
              # 3 of 4 heads: every tp rank (2 heads each) keeps at least one
              "head_pruning": prune(0.75, ["attn.c_proj"], num_heads=4, related=[["attn.c_attn"]])},
    "asym_topk": {"weight_quantization": wq(3, ["mlp.c_fc", "mlp.c_proj"], groups=2, qtype="asymmetric"),
                  "activation_quantization": aq(8, ["attn.c_proj", "mlp.c_proj"], calibration="static",
                                                qtype="asymmetric"),
                  "row_pruning": prune(0.5, ["mlp.c_fc"], method="topk", related=[["mlp.c_proj"]])},
}


def clean_case(name: str | dict[str, Any], tmp_dir: str | None = None) -> dict[str, Any]:
    """Train 2 steps at the world's tp degree, then clean each rank's shard; outputs against the simulated model."""
    import torch.distributed as dist

    import zerospeed
    from zerospeed.compression import init_compression, model_bytes, redundancy_clean

    tp = dist.get_world_size()
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
           "compression_training": CLEAN[name] if isinstance(name, str) else name,
           "tensor_parallel": {"autotp_size": tp}}
    model = init_compression(tiny_gpt2().train(), cfg)
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    for step in range(2):
        ids = batch(step)
        engine.backward(engine(ids, labels=ids).loss)
        engine.step()
    model = engine.module.eval()
    ids = batch(9)
    with torch.no_grad():
        simulated = model(ids).logits
    before = model_bytes(model)
    redundancy_clean(model, cfg, mpu=comm.get_mesh())
    with torch.no_grad():
        cleaned = model(ids).logits
    reloaded_err = None
    if tmp_dir is not None:  # each rank saves its shard and loads it into a freshly split skeleton
        from zerospeed.compression import load_compressed, save_compressed

        path = f"{tmp_dir}/{name}-rank{dist.get_rank()}.safetensors"
        save_compressed(model, path)
        skeleton = zerospeed.tp_model_init(tiny_gpt2(seed=1), tp_size=tp)
        load_compressed(skeleton, path)
        with torch.no_grad():
            reloaded_err = float((skeleton.eval()(ids).logits - cleaned).abs().max())
    h0 = model.transformer.h[0]
    inner = {n: getattr(m, "inner", m) for n, m in h0.named_modules() if n in ("mlp.c_fc", "mlp.c_proj")}
    out = {"err": float((cleaned - simulated).abs().max() / simulated.abs().max()), "before": before,
           "after": model_bytes(model), "types": {n: type(m).__name__ for n, m in h0.named_modules() if n.count(".") == 1},
           "c_fc_out": getattr(inner["mlp.c_fc"], "out_features", None), "c_proj_in": inner["mlp.c_proj"].in_features,
           "heads": h0.attn.num_heads, "split_size": h0.attn.split_size, "reloaded_err": reloaded_err}
    engine.destroy()
    comm.reset_mesh()
    return out


def clean_cases(names: list[str], tmp_dir: str | None = None) -> list[dict[str, Any]]:
    return [clean_case(name, tmp_dir) for name in names]


COMPILE = {"weight_quantization": wq(4, MODULES, groups=8), "activation_quantization": aq(8, MODULES),
           "sparse_pruning": prune(0.5, ["attn.c_attn"]),
           "row_pruning": prune(0.5, ["mlp.c_fc"], method="topk", related=[["mlp.c_proj"]]),
           "head_pruning": prune(0.75, ["attn.c_proj"], num_heads=4, related=[["attn.c_attn"]])}


def eager_vs_compiled() -> dict[str, Any]:
    """The compressed tp2 GPT-2 trained 3 steps eagerly and through engine.compile(backend="eager")."""
    import torch._dynamo

    import zerospeed
    from zerospeed.compression import init_compression

    out = {}
    for backend in (None, "eager"):
        torch._dynamo.reset()
        cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 0,
               "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
               "compression_training": COMPILE, "tensor_parallel": {"autotp_size": 2}}
        model = tiny_gpt2().train()
        model.loss_type = "ForCausalLM"  # else HF warns once from inside the loss: a graph break
        engine, *_ = zerospeed.initialize(model=init_compression(model, cfg), config=cfg)
        if backend:
            engine.compile(backend=backend)
        losses, calls = [], []
        for step in range(3):
            ids = batch(step)
            comm.COUNTER.reset()
            loss = engine(ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            calls.append({op: s["count"] for op, s in comm.COUNTER.snapshot().items()})
        out[backend or "none"] = {"losses": losses, "calls": calls, "report": engine.compile_report()}
        engine.destroy()
        comm.reset_mesh()
    return out


CKPT = {"weight_quantization": wq(4, MODULES, start=8, period=1, groups=8),
        "activation_quantization": aq(6, MODULES, calibration="static", qtype="asymmetric"),
        "sparse_pruning": prune(0.5, ["mlp.c_"], method="snip_momentum", block_pattern="4x1", schedule_offset_end=3),
        "row_pruning": prune(0.5, ["attn.c_proj"], method="topk"),
        "head_pruning": prune(0.5, ["attn.c_proj"], offset=1, num_heads=4)}


def checkpoint_round_trip(ckpt_dir: str) -> dict[str, Any]:
    """tp2: 4 steps straight; 2 steps, save, then 2 more in a new tp2 engine, and in a tp1 (dp2) one."""
    import zerospeed
    from zerospeed.compression import init_compression

    def build(tp: int):
        cfg = {"train_batch_size": 4 * (2 // tp), "train_micro_batch_size_per_gpu": 4, "steps_per_print": 0,
               "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}, "compression_training": CKPT}
        if tp > 1:
            cfg["tensor_parallel"] = {"autotp_size": tp}
        return zerospeed.initialize(model=init_compression(tiny_gpt2().train(), cfg), config=cfg)[0]

    def train(engine, first: int, last: int) -> list[float]:
        out = []
        for step in range(first, last):
            ids = batch(step)
            loss = engine(ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            out.append(float(loss.detach()))
        return out

    def done(engine) -> None:
        engine.destroy()
        comm.reset_mesh()

    engine = build(2)
    straight = train(engine, 0, 4)
    done(engine)
    engine = build(2)
    first = train(engine, 0, 2)
    engine.save_checkpoint(ckpt_dir, tag="mid")
    done(engine)
    out = {"straight": straight}
    for tp in (2, 1):
        engine = build(tp)
        engine.load_checkpoint(ckpt_dir, tag="mid")
        out[f"tp{tp}"] = first + train(engine, 2, 4)
        done(engine)
    return out
