"""Per-rank bodies of the tensor-parallel tests (importable by name for run_distributed)."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from zerospeed import comm


def mesh_layout(pp: int, tp: int) -> dict[str, Any]:
    """Build the mesh and report this rank's coordinates and the global ranks of its three groups."""
    mesh = comm.build_mesh(pp=pp, tp=tp)
    assert comm.get_mesh() is mesh
    out = {"degrees": mesh.degrees, "coord": (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank),
           "pipe": mesh.group_ranks("pipe"), "data": mesh.group_ranks("data"), "model": mesh.group_ranks("model")}
    # the groups really communicate among exactly those ranks
    for axis, group in (("pipe", mesh.pp_group), ("data", mesh.dp_group), ("model", mesh.tp_group)):
        t = torch.tensor([float(dist.get_rank())])
        comm.all_reduce(t, group=group)
        out[f"sum_{axis}"] = t.item()
    comm.reset_mesh()
    return out


def mesh_error(pp: int, tp: int) -> str:
    try:
        comm.build_mesh(pp=pp, tp=tp)
    except comm.MeshError as exc:
        return str(exc)
    return "no error"


class _Mpu:
    def __init__(self, tp_group: Any, dp_group: Any, tp_rank: int, tp_size: int) -> None:
        self._tp, self._dp, self._rank, self._size = tp_group, dp_group, tp_rank, tp_size

    def get_model_parallel_rank(self) -> int:
        return self._rank

    def get_model_parallel_world_size(self) -> int:
        return self._size

    def get_model_parallel_group(self) -> Any:
        return self._tp

    def get_data_parallel_group(self) -> Any:
        return self._dp


def mesh_from_mpu() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """A Megatron-style mpu with tp groups [0,1],[2,3] and dp groups [0,2],[1,3] gives the same mesh."""
    rank = dist.get_rank()
    tp_groups = [comm.new_group([0, 1]), comm.new_group([2, 3])]
    dp_groups = [comm.new_group([0, 2]), comm.new_group([1, 3])]
    mesh = comm.from_mpu(_Mpu(tp_groups[rank // 2], dp_groups[rank % 2], rank % 2, 2))
    assert comm.get_mesh() is mesh
    comm.reset_mesh()
    # no rank leaves (and tears its gloo pairs down) while a peer still connects to a subgroup: seen
    # once in the full suite as "Connection closed by peer" on ranks 1 and 3
    dist.barrier()
    return mesh.degrees, (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank)


# -- models ------------------------------------------------------------------------------------------
def hf_model(kind: str, tp: int, seed: int = 0) -> torch.nn.Module:
    """A tiny random-init HuggingFace model (never downloaded), the same on every rank."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "llama":  # GQA: 2 query heads per KV head; odd vocabulary (padded LM head)
        heads = 8 if tp == 4 else 4
        cfg = tf.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=64,
                             tie_word_embeddings=False)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "gpt2":  # Conv1D, fused c_attn, tied embedding
        cfg = tf.GPT2Config(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=64)
        model = tf.GPT2LMHeadModel(cfg)
    elif kind == "neox":
        cfg = tf.GPTNeoXConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=False)
        model = tf.GPTNeoXForCausalLM(cfg)
    else:
        raise ValueError(kind)
    return model.eval()


class CustomNet(torch.nn.Module):
    """No ModuleList, no usual names: driven only by partition_config. ``fused`` packs 3 projections."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.inp = torch.nn.Linear(8, 16)
        self.fused = torch.nn.Linear(16, 3 * 24)
        self.back = torch.nn.Linear(24, 16)
        self.out = torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c = self.fused(torch.tanh(self.inp(x))).chunk(3, dim=-1)
        return self.out(self.back(a * torch.sigmoid(b) + c))


CUSTOM_SPECS = {"use_default_specs": False, "layer_specs": [
    {"patterns": [r"^fused$"], "partition_type": "column", "shape": [3, -1]},
    {"patterns": [r"^back\.weight$"], "partition_type": "row"}]}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def forward_parity(kinds: list[str]) -> dict[str, Any]:
    """Logits of the split model against the unsharded one; greedy generation with a KV cache."""
    from zerospeed.module_inject import auto_tp, tp_param_splits

    tp = dist.get_world_size()
    mesh = comm.build_mesh(tp=tp)
    out: dict[str, Any] = {}
    for kind in kinds:
        torch.manual_seed(100)
        if kind == "custom":
            model = CustomNet()
            x = torch.randn(3, 4, 8)
            with torch.no_grad():
                ref = model(x)
            full_bytes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
            auto_tp(model, mesh.tp_group, partition_config=CUSTOM_SPECS)
            with torch.no_grad():
                got = model(x)
            out[kind] = {"err": _rel_err(got, ref), "types": {n: type(m).__name__ for n, m in model.named_children()}}
        else:
            model = hf_model(kind, tp)
            ids = torch.randint(0, model.config.vocab_size, (2, 7))
            with torch.no_grad():
                ref = model(ids).logits
                ref_gen = model.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
            full_bytes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
            auto_tp(model, mesh.tp_group)
            comm.COUNTER.reset()
            with torch.no_grad():
                got = model(ids).logits
            reduces = comm.COUNTER.count("all_reduce")
            with torch.no_grad():
                gen = model.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
            # training-mode forward + backward run through the autograd functions
            loss = model(ids, labels=ids).loss
            comm.COUNTER.reset()
            loss.backward()
            out[kind] = {"err": _rel_err(got, ref), "gen_equal": torch.equal(gen, ref_gen), "all_reduces": reduces,
                         "loss": float(loss), "backward_all_reduces": comm.COUNTER.count("all_reduce")}
        splits = tp_param_splits(model)
        local = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
        out[kind]["sharded_bytes"] = sum(local[n] for n in splits if n in local)
        out[kind]["sharded_full_bytes"] = sum(full_bytes[n] for n in splits if n in local)
        out[kind]["padded_full_bytes"] = sum(math.prod(s.view[:s.dim] + (s.total,) + s.view[s.dim + 1:]) * 4
                                             for n, s in splits.items() if n in local)
        out[kind]["num_sharded"] = len([n for n in splits if n in local])
    comm.reset_mesh()
    return out


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc_a = torch.nn.Linear(4, 8)
        self.fc_b = torch.nn.Linear(8, 4)


def bad_inputs() -> dict[str, str]:
    """Each bad input's one-line error (run at tp=2)."""
    import transformers as tf

    from zerospeed.config import ConfigError
    from zerospeed.module_inject import TPError, auto_tp

    mesh = comm.build_mesh(tp=dist.get_world_size())
    out: dict[str, str] = {}

    def err(key: str, fn: Any) -> None:
        try:
            fn()
            out[key] = "no error"
        except (TPError, ConfigError, ValueError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"

    def llama(**kw: Any) -> Any:
        base = dict(vocab_size=50, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=12)
        base.update(kw)
        torch.manual_seed(0)
        return tf.LlamaForCausalLM(tf.LlamaConfig(**base))

    err("kv_heads", lambda: auto_tp(llama(num_key_value_heads=1), mesh.tp_group))
    err("heads", lambda: auto_tp(llama(num_attention_heads=3, num_key_value_heads=3), mesh.tp_group))
    err("mlp", lambda: auto_tp(llama(intermediate_size=63), mesh.tp_group))
    err("no_blocks", lambda: auto_tp(_TwoLayers(), mesh.tp_group))
    err("preset", lambda: auto_tp(llama(), mesh.tp_group, partition_config={"preset_model": "gpt5"}))
    err("regex", lambda: auto_tp(llama(), mesh.tp_group, partition_config={
        "layer_specs": [{"patterns": [r".*\.o_proj$", r".*\.nonexistent$"], "partition_type": "row"}]}))
    torch.manual_seed(dist.get_rank())  # a different model on each rank
    err("differ", lambda: auto_tp(_TwoLayers(), mesh.tp_group, partition_config={
        "use_default_specs": False, "layer_specs": [{"patterns": ["fc_a"]}, {"patterns": ["fc_b"], "partition_type": "row"}]}))
    comm.reset_mesh()
    return out


# -- training ----------------------------------------------------------------------------------------
TRAIN_STEPS = 2
MICRO = 2
SEQ = 8


def tiny_llama(seed: int = 0, kv_heads: int = 2) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=32,
                         tie_word_embeddings=False)
    return tf.LlamaForCausalLM(cfg)


def train_batches(dp: int) -> list[list[torch.Tensor]]:
    """``TRAIN_STEPS`` global batches, each a list of ``dp`` micro-batches (token ids)."""
    g = torch.Generator().manual_seed(1234)
    return [[torch.randint(0, 64, (MICRO, SEQ), generator=g) for _ in range(dp)] for _ in range(TRAIN_STEPS)]


def train_config(stage: int, dp: int, tp: int, **extra: Any) -> dict[str, Any]:
    cfg = {"train_batch_size": MICRO * dp, "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.05,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage},
           "steps_per_print": 0}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    cfg.update(extra)
    return cfg


def reference_training(dp: int, kv_heads: int = 2) -> dict[str, Any]:
    """One process, the whole global batch per step (HF's mean loss over equal-size micro-batches)."""
    model = tiny_llama(kv_heads=kv_heads)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses, norms = [], []
    for batch in train_batches(dp):
        ids = torch.cat(batch)
        loss = model(ids, labels=ids).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def full_weights(engine: Any, mesh: Any) -> dict[str, torch.Tensor]:
    """The engine's consolidated state dict: gathered over ZeRO and tp shards (full on dp rank 0)."""
    return engine.consolidated_state_dict()


def tp_training(cases: list[tuple[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Train the tiny Llama with each (dp, config); return losses, norms, gathered weights (global rank 0)."""
    import zerospeed

    results = []
    for case in cases:
        dp, cfg = case[0], case[1]
        mode = case[2] if len(case) > 2 else "config"
        model = tiny_llama(kv_heads=4 if mode == "tp4" else 2)  # tp4 needs 4 KV heads
        if mode == "loader":  # the loader initialize returns: the same micro-batch on every rank of a tp group
            data = torch.utils.data.TensorDataset(torch.arange(64).reshape(16, 4))
            engine, _, loader, _ = zerospeed.initialize(model=model, config=cfg, training_data=data)
            results.append({"first_batch": next(iter(loader))[0]})
            comm.reset_mesh()
            continue
        if mode == "diverge":
            engine, _, _, _ = zerospeed.initialize(model=model, config=cfg)
            ids = torch.full((MICRO, SEQ), dist.get_rank())
            try:
                engine(ids, labels=ids)
                results.append({"error": "no error"})
            except ValueError as exc:
                results.append({"error": str(exc)})
            comm.reset_mesh()
            continue
        if mode == "mpu":  # a Megatron-style mpu: tp over the whole world, dp of one
            world = dist.get_world_size()
            tp_group = comm.new_group(list(range(world)))
            dp_group = None
            for r in range(world):
                g = comm.new_group([r])
                dp_group = g if r == dist.get_rank() else dp_group
            engine, _, _, _ = zerospeed.initialize(model=model, config=cfg,
                                                   mpu=_Mpu(tp_group, dp_group, dist.get_rank(), world))
        elif mode == "tp_model_init":  # DeepSpeed's order: split first (builds the mesh), then initialize
            model = zerospeed.tp_model_init(model, tp_size=dist.get_world_size(), dtype=torch.float32)
            engine, _, _, _ = zerospeed.initialize(model=model, config=cfg)
        else:
            engine, _, _, _ = zerospeed.initialize(model=model, config=cfg)
        mesh = comm.get_mesh()
        dp_rank = mesh.dp_rank if mesh is not None else dist.get_rank()
        comm.COUNTER.reset()
        losses, norms = [], []
        for step, batch in enumerate(train_batches(dp)):
            ids = batch[dp_rank]
            loss = engine(ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            comm.all_reduce(mean)  # over the world: every tp rank of a dp replica has the same loss
            losses.append(float(mean) / dist.get_world_size())
            norms.append(engine.get_global_grad_norm())
        counts = comm.COUNTER.snapshot()
        weights = full_weights(engine, mesh)
        local_param_bytes = sum(p.numel() * p.element_size() for p in engine.module.parameters())
        results.append({"losses": losses, "norms": norms, "weights": weights if dist.get_rank() == 0 else {},
                        "comms": counts, "param_bytes": local_param_bytes})
        engine.destroy()
        comm.reset_mesh()
    return results


# -- checkpoints -------------------------------------------------------------------------------------
def _engine(tp: int, stage: int, seed: int, world: int) -> Any:
    import zerospeed

    dp = world // tp
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4 // dp, "gradient_clipping": 0.05,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage},
           "steps_per_print": 0}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    engine, _, _, _ = zerospeed.initialize(model=tiny_llama(seed), config=cfg)
    return engine


def _step(engine: Any, batch: torch.Tensor) -> float:
    mesh = comm.get_mesh()
    dp, dp_rank = (mesh.dp_size, mesh.dp_rank) if mesh is not None else (dist.get_world_size(), dist.get_rank())
    ids = batch.chunk(dp)[dp_rank]
    loss = engine(ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    comm.all_reduce(mean)
    return float(mean) / dist.get_world_size()


def _gathered(engine: Any) -> dict[str, torch.Tensor]:
    w = full_weights(engine, comm.get_mesh())
    got = comm.all_gather_object(w if dist.get_rank() == 0 else None)
    return got[0]


def checkpoint_round_trips(save_dir: str) -> dict[str, Any]:
    """tp2 -> save -> load at tp1 x dp2 (ZeRO-2) -> save -> load at tp2 (ZeRO-3); each continues one step."""
    import os

    world = dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 64, (4, SEQ), generator=g) for _ in range(4)]
    out: dict[str, Any] = {}
    a = _engine(tp=2, stage=1, seed=0, world=world)
    for b in batches[:2]:
        _step(a, b)
    a.save_checkpoint(os.path.join(save_dir, "tp2"), tag="t")
    a.save_16bit_model(os.path.join(save_dir, "16bit"), "model.safetensors")  # fp32 here: the full weights
    out["saved"] = _gathered(a)
    out["next_loss"] = _step(a, batches[2])
    out["next_weights"] = _gathered(a)
    a.destroy()
    comm.reset_mesh()

    b = _engine(tp=1, stage=2, seed=5, world=world)  # other seed: the load must overwrite everything
    b.load_checkpoint(os.path.join(save_dir, "tp2"), tag="t")
    out["tp1_loaded"] = _gathered(b)
    out["tp1_next_loss"] = _step(b, batches[2])
    out["tp1_next_weights"] = _gathered(b)
    b.save_checkpoint(os.path.join(save_dir, "dp2"), tag="t")
    b.destroy()

    c = _engine(tp=2, stage=3, seed=9, world=world)
    c.load_checkpoint(os.path.join(save_dir, "dp2"), tag="t")
    out["tp2_loaded"] = _gathered(c)
    out["tp2_next_loss"] = _step(c, batches[3])
    c.destroy()
    comm.reset_mesh()
    b2 = _engine(tp=1, stage=2, seed=5, world=world)
    b2.load_checkpoint(os.path.join(save_dir, "dp2"), tag="t")
    out["tp1_next_next_loss"] = _step(b2, batches[3])
    b2.destroy()

    import transformers as tf  # a model whose layout cannot map: other sizes
    torch.manual_seed(0)
    other = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    import zerospeed
    engine, _, _, _ = zerospeed.initialize(model=other, config={
        "train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "tensor_parallel": {"autotp_size": 2}})
    try:
        engine.load_checkpoint(os.path.join(save_dir, "tp2"), tag="t")
        out["mismatch"] = "no error"
    except Exception as exc:  # noqa: BLE001
        out["mismatch"] = f"{type(exc).__name__}: {exc}"
    comm.reset_mesh()
    return out if dist.get_rank() == 0 else {}


# -- pipeline x tensor parallel ------------------------------------------------------------------------
PP_DIM, PP_HIDDEN, PP_BLOCKS, PP_BATCH = 6, 8, 4, 8


class TPBlock(torch.nn.Module):
    """A residual MLP block: fc_in (column-parallel under tp) -> gelu -> fc_out (row-parallel)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_in = torch.nn.Linear(PP_HIDDEN, 2 * PP_HIDDEN)
        self.fc_out = torch.nn.Linear(2 * PP_HIDDEN, PP_HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(torch.nn.functional.gelu(self.fc_in(x)))


PP_SPECS = {"use_default_specs": False, "layer_specs": [
    {"patterns": [r"^\d+\.fc_in$"], "partition_type": "column"},
    {"patterns": [r"^\d+\.fc_out$"], "partition_type": "row"}]}


def _pp_layers() -> list[Any]:
    from zerospeed.pipe import LayerSpec

    return ([LayerSpec(torch.nn.Linear, PP_DIM, PP_HIDDEN)] + [LayerSpec(TPBlock) for _ in range(PP_BLOCKS)]
            + [LayerSpec(torch.nn.Linear, PP_HIDDEN, PP_DIM)])


def _pp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(PP_BATCH, PP_DIM, generator=g), torch.randn(PP_BATCH, PP_DIM, generator=g)


def pp_reference(steps: int, gas: int) -> dict[str, Any]:
    model = torch.nn.Module()
    for i, spec in enumerate(_pp_layers()):
        torch.manual_seed(77 + i)
        model.add_module(str(i), spec.build())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = _pp_batch(step)
        total = 0.0
        for xs, ys in zip(x.chunk(gas), y.chunk(gas)):
            h = xs
            for layer in model.children():
                h = layer(h)
            loss = torch.nn.functional.mse_loss(h, ys) / gas
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def pp_tp_training(steps: int, gas: int, zero: int, save_dir: str) -> dict[str, Any]:
    """pp2 x tp2: a PipelineModule of residual MLP blocks, split by partition_config."""
    import zerospeed
    from zerospeed.module_inject.gather import gather_tp_state_dict
    from zerospeed.pipe import PipelineModule

    net = PipelineModule(_pp_layers(), num_stages=2, loss_fn=torch.nn.functional.mse_loss, seed_layers=True,
                         base_seed=77, partition_method="uniform")
    cfg = {"train_batch_size": PP_BATCH, "gradient_accumulation_steps": gas, "gradient_clipping": 0.1,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "steps_per_print": 0,
           "zero_optimization": {"stage": zero}, "pipeline": {"schedule": "1f1b"},
           "tensor_parallel": {"autotp_size": 2, "partition_config": PP_SPECS}}
    engine, _, _, _ = zerospeed.initialize(model=net, config=cfg)
    losses = []
    for step in range(steps):
        x, y = _pp_batch(step)
        data = iter(list(zip(x.chunk(gas), y.chunk(gas))))
        losses.append(float(engine.train_batch(data if engine.is_first_stage() or engine.is_last_stage() else None)))
    mesh = comm.get_mesh()
    local = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    weights = gather_tp_state_dict(local, engine.module, mesh)
    kinds = sorted({type(m).__name__ for m in engine.module.modules() if "Linear" in type(m).__name__})
    try:
        engine.save_checkpoint(save_dir, tag="t")
        refused = "no error"
    except Exception as exc:  # noqa: BLE001
        refused = f"{type(exc).__name__}: {exc}"
    comm.reset_mesh()
    return {"losses": losses, "weights": weights, "kinds": kinds, "stage": engine.stage_id, "refused": refused}
