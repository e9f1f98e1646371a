"""Per-rank bodies for tests/test_sequence_parallel.py (module-level functions, started by name).

Parity tolerance (fp32): sequence parallelism moves whole heads and whole tokens between ranks, so every
activation is computed by the same formula; what changes is the order of sums (a weight's gradient is summed
over the tokens of each shard, then over the ranks; projections run on fewer rows, which can change the
kernel's blocking). Each such sum of n terms is within ~n ulps of the other order, far below RTOL = 1e-5
relative (norm-wise, per tensor) for these sizes (n <= 64 tokens, hidden 32). Weights are compared through
their change over the run (``w_end - w_start``), plus 4 ulps of the weight's magnitude for the rounding of
``w - lr * g`` itself.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

warnings.filterwarnings("ignore")

VOCAB = 64
RTOL = 1e-5
LR = 0.5
CLIP = 1.0  # DeepSpeed's default gradient_clipping: the global norm under SP is checked too
PROMPT = 3  # the first tokens of each sample are a prompt: label -100 (SFT), so shards hold different counts


def llama(seed: int = 0, **over):
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, attn_implementation="sdpa")
    kw.update(over)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**kw))


def qwen2(seed: int = 0, **over):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=False, attn_implementation="sdpa",
              use_sliding_window=False)
    kw.update(over)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**kw))


MODELS = {"llama": llama, "qwen2": qwen2}


def sample(step: int, dp_rank: int, seq: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + 31 * dp_rank + seq)
    ids = torch.randint(1, VOCAB, (1, seq), generator=g)
    labels = ids.clone()
    labels[:, :PROMPT] = -100
    return {"input_ids": ids, "position_ids": torch.arange(seq).unsqueeze(0), "labels": labels}


def shard_loss(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """This shard's mean over its real tokens (0 when it has none)."""
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shift_labels.reshape(-1), ignore_index=-100,
                            reduction="sum")
    return total / max(int((shift_labels != -100).sum()), 1)


def full_loss(model, b: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
    shift = F.pad(b["labels"], (0, 1), value=-100)[:, 1:]
    return shard_loss(logits, shift)


def reference(arch: str, dp: int, steps: int, seq: int) -> tuple[list[list[float]], dict[str, torch.Tensor],
                                                                  dict[str, torch.Tensor]]:
    """One process at the full length: per step, the mean over the dp samples of each sample's loss; clipped SGD."""
    model = MODELS[arch]()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for t in range(steps):
        per = [full_loss(model, sample(t, d, seq)) for d in range(dp)]
        (sum(per) / dp).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append([float(x) for x in per])
    return losses, start, {k: v.detach().clone() for k, v in model.state_dict().items()}


def tile_mlps(model, tiles: int) -> None:
    """Every decoder layer's MLP through TiledMLP (set on the instances, as a user script patches them)."""
    from zerospeed.sequence.tiled import TiledMLP

    def mlp_forward(module, x):
        return module.down_proj(module.act_fn(module.gate_proj(x)) * module.up_proj(x))

    for layer in model.model.layers:
        mlp = layer.mlp
        mlp.forward = lambda x, mlp=mlp: TiledMLP.apply(mlp_forward, mlp, x, tiles)


class SharedBatches(list):
    """A list of batches marked as zerospeed's loader marks its own under sp (the sp ranks share samples)."""

    sp_shared_samples = True


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare_updates(got: dict[str, torch.Tensor], ref_end: dict[str, torch.Tensor],
                    start: dict[str, torch.Tensor]) -> float:
    """Largest excess of |Δw_got - Δw_ref| over the bound (<= 0: within it)."""
    worst = -1.0
    for name, end in ref_end.items():
        if name not in got or not end.is_floating_point():
            continue
        d_ref, d_got = end - start[name], got[name].to(end.dtype) - start[name]
        bound = RTOL * d_ref.norm() + 4 * torch.finfo(torch.float32).eps * start[name].abs().max() * math.sqrt(
            end.numel())
        worst = max(worst, float((d_got - d_ref).norm() - bound))
    return worst


def sp_config(stage: int, sp: int, **over):
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": stage},
           "sequence_parallel_size": sp}
    cfg.update(over)
    return cfg


def parity_body(arch: str, sp: int, stages: list[int], variants: list[str], steps: int = 2, seq: int = 16,
                checkpointing: bool | str = False, tiles: int = 0) -> dict:
    """SP (x DP) training through zerospeed.initialize vs one process at the full length, per ZeRO stage.

    ``checkpointing``: True configures host offload of the checkpoints in the script (``configure(None,
    checkpoint_in_cpu=True)``, as DeepSpeed's ALST scripts do); "config" through the engine config's
    ``activation_checkpointing.cpu_checkpointing``. Either way every decoder layer is checkpointed, and the inputs
    each checkpoint holds for the backward (the offloaded tensors) are recorded: their sequence dimension."""
    import zerospeed
    from zerospeed.checkpointing.storage import InputStore
    from zerospeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from zerospeed.sequence.loss import real_tokens, sp_loss_all_gather, sp_loss_all_reduce
    from zerospeed.utils import groups

    torch.set_num_threads(1)
    world = dist.get_world_size()
    dp = world // sp
    ref_losses, start, ref_end = reference(arch, dp, steps, seq)  # before the hook is registered
    mpu = UlyssesSPAttentionHF.register_with_transformers(MODELS[arch](), "sdpa", sp, 1)
    out: dict = {"runs": []}
    try:
        sp_group, sp_rank = groups._get_sequence_parallel_group(), groups._get_sequence_parallel_rank()
        assert groups._get_sequence_parallel_world_size() == sp
        for stage, variant in zip(stages, variants):
            model = MODELS[arch]()
            calls = [0]
            held: list[int] = []  # per checkpoint: the sequence length of the hidden states it holds
            over = {}
            if checkpointing:
                import zerospeed.checkpointing as ckpt

                def counted(*args):
                    calls[0] += 1
                    return ckpt.checkpoint(*args)

                if checkpointing == "config":
                    over["activation_checkpointing"] = {"cpu_checkpointing": True}
                else:
                    ckpt.configure(None, checkpoint_in_cpu=True)
                model._set_gradient_checkpointing(True, counted)
                pack = InputStore.pack

                def recording_pack(store, inputs, pack=pack):
                    held.extend(t.shape[1] for t in inputs if t.is_floating_point() and t.dim() == 3)
                    return pack(store, inputs)

                InputStore.pack = recording_pack  # this rank's process only
            if tiles:
                tile_mlps(model, tiles)
            engine, _, _, _ = zerospeed.initialize(model=model, config=sp_config(stage, sp, **over), mpu=mpu)
            if checkpointing:
                assert ckpt.settings.current().cpu_checkpointing  # the offload path (the store holds the inputs)
            assert engine.get_sequence_parallel_group() is sp_group  # DeepSpeed's engine method, the mesh's group
            dp_rank = mpu.get_data_parallel_rank()
            loader = UlyssesSPDataLoaderAdapter(SharedBatches(sample(t, dp_rank, seq) for t in range(steps)),
                                                sp_rank=sp_rank, sp_group=sp_group, sp_world_size=sp, device="cpu")
            combine = sp_loss_all_gather if variant == "all_gather" else sp_loss_all_reduce
            losses = []
            for t in range(steps):
                b = next(loader)
                logits = engine(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
                loss = combine(shard_loss(logits, b["shift_labels"]), real_tokens(b["shift_labels"]), sp_group)
                engine.backward(loss)
                engine.step()
                losses.append(float(loss))
            state = engine.consolidated_state_dict()
            run = {"stage": stage, "variant": variant, "losses": losses,
                   "ref_losses": [ref_losses[t][dp_rank] for t in range(steps)],
                   "sp_dp_size": engine.dp_world_size, "checkpoints": calls[0], "held_seq": held}
            if checkpointing:
                InputStore.pack = pack
            if state:
                run["excess"] = compare_updates(state, ref_end, start)
            out["runs"].append(run)
    finally:
        UlyssesSPAttentionHF.unregister_from_transformers()
    return out


def attention_body(sp: int, heads: int, kv_heads: int, seq: int = 8) -> dict:
    """DistributedAttention over [s/sp, b, h, d] shards vs causal attention over the whole sequence."""
    from zerospeed import comm
    from zerospeed.sequence.layer import DistributedAttention

    torch.set_num_threads(1)
    mesh = comm.build_mesh(sp=sp)
    rank = mesh.sp_rank
    g = torch.Generator().manual_seed(5)
    b, d = 2, 4
    q = torch.randn(seq, b, heads, d, generator=g)
    k = torch.randn(seq, b, kv_heads, d, generator=g)
    v = torch.randn(seq, b, kv_heads, d, generator=g)
    w = torch.randn(seq, b, heads, d, generator=g)  # a fixed cotangent

    def local(q_, k_, v_):  # [s, b, h, d] -> causal sdpa over s, GQA by repetition
        rep = q_.shape[2] // k_.shape[2]
        k_, v_ = k_.repeat_interleave(rep, 2), v_.repeat_interleave(rep, 2)
        o = F.scaled_dot_product_attention(q_.permute(1, 2, 0, 3), k_.permute(1, 2, 0, 3), v_.permute(1, 2, 0, 3),
                                           is_causal=True)
        return o.permute(2, 0, 1, 3)

    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = local(*full)
    (ref * w).sum().backward()
    chunk = seq // sp
    mine = [t[rank * chunk:(rank + 1) * chunk].clone().requires_grad_(True) for t in (q, k, v)]
    attn = DistributedAttention(local, mesh.sp_group, scatter_idx=2, gather_idx=0)
    comm.COUNTER.reset()
    got = attn(*mine)
    forward_a2a = comm.COUNTER.count("all_to_all")
    (got * w[rank * chunk:(rank + 1) * chunk]).sum().backward()
    sl = slice(rank * chunk, (rank + 1) * chunk)
    return {"out": rel(got.detach(), ref.detach()[sl]),
            "grads": [rel(m.grad, f.grad[sl]) for m, f in zip(mine, full)],
            "forward_a2a": forward_a2a, "total_a2a": comm.COUNTER.count("all_to_all")}


def errors_body(sp: int) -> dict:
    """Bad input at sp > 1: heads sp cannot split (attention and HF registration), uneven sequence shards."""
    from zerospeed import comm
    from zerospeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from zerospeed.sequence.layer import DistributedAttention

    torch.set_num_threads(1)
    out = {}
    mesh = comm.build_mesh(sp=sp)
    attn = DistributedAttention(lambda q, k, v: q, mesh.sp_group)
    for name, heads, kv in (("q_heads", 3, 3), ("kv_heads", 4, 3)):
        try:
            attn(torch.zeros(2, 1, heads, 4), torch.zeros(2, 1, kv, 4), torch.zeros(2, 1, kv, 4))
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    try:
        UlyssesSPAttentionHF.register_with_transformers(llama(num_attention_heads=6, num_key_value_heads=3,
                                                              hidden_size=48), "sdpa", sp, 1)
        out["hf_heads"] = None
    except ValueError as exc:
        out["hf_heads"] = str(exc)
    finally:
        UlyssesSPAttentionHF.unregister_from_transformers()
    try:  # a degree that does not divide the world, at registration (before initialize)
        UlyssesSPAttentionHF.register_with_transformers(llama(), "sdpa", 2 * sp, 1)
        out["register_world"] = None
    except ValueError as exc:
        out["register_world"] = str(exc)
    finally:
        UlyssesSPAttentionHF.unregister_from_transformers()
    import zerospeed

    for name, cfg in (("world", sp_config(1, 2 * sp)),
                      ("tp", sp_config(1, sp, tensor_parallel={"autotp_size": 2}))):
        try:
            zerospeed.initialize(model=llama(), config=cfg)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    adapter = UlyssesSPDataLoaderAdapter(SharedBatches([sample(0, 0, 15)]), mesh.sp_rank, mesh.sp_group, sp, "cpu")
    try:
        next(adapter)
        out["uneven"] = None
    except ValueError as exc:
        out["uneven"] = str(exc)
    return out


def exchange_body(sp: int) -> dict:
    """DeepSpeed's adapter semantics: each sp rank's own batch (different lengths), processed by all in turn."""
    from zerospeed import comm
    from zerospeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    mesh = comm.build_mesh(sp=sp)
    rank = mesh.sp_rank
    mine = [sample(0, rank, 8 * (rank + 1)), sample(1, rank, 8 * (rank + 1))]
    adapter = UlyssesSPDataLoaderAdapter(mine, rank, mesh.sp_group, sp, "cpu")
    got = list(adapter)
    expected = []
    for step in range(2):
        for owner in range(sp):
            b = sample(step, owner, 8 * (owner + 1))
            n = b["input_ids"].shape[1] // sp
            shift = F.pad(b["labels"], (0, 1), value=-100)[:, 1:]
            expected.append({"input_ids": b["input_ids"][:, rank * n:(rank + 1) * n],
                             "position_ids": b["position_ids"][:, rank * n:(rank + 1) * n],
                             "shift_labels": shift[:, rank * n:(rank + 1) * n]})
    same = len(got) == len(expected) and all(
        set(g) == set(e) and all(torch.equal(g[k], e[k]) for k in e) for g, e in zip(got, expected))
    return {"same": same, "n": len(got)}


def _sp_engine(sp: int, stage: int):
    import zerospeed
    from zerospeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    if sp > 1:  # the hook and the mesh; initialize then finds the mesh from the config's degree alone
        UlyssesSPAttentionHF.register_with_transformers(llama(), "sdpa", sp, 1)
    engine, _, _, _ = zerospeed.initialize(model=llama(), config=sp_config(stage, sp))
    return engine


def _sp_step(engine, sp: int, step: int, seq: int = 16) -> float:
    from zerospeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    from zerospeed.sequence.loss import real_tokens, sp_loss_all_gather
    from zerospeed.utils import groups

    group = groups._get_sequence_parallel_group()
    b = next(UlyssesSPDataLoaderAdapter(SharedBatches([sample(step, 0, seq)]), groups._get_sequence_parallel_rank(),
                                        group, sp, "cpu"))
    logits = engine(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
    loss = sp_loss_all_gather(shard_loss(logits, b["shift_labels"]), real_tokens(b["shift_labels"]), group)
    engine.backward(loss)
    engine.step()
    return float(loss)


def checkpoint_save_body(save_dir: str, sp: int, stage: int) -> dict:
    """Train 1 step at ``sp``, save, train 2 more: the losses and weights a resumed run must reproduce."""
    torch.set_num_threads(1)
    engine = _sp_engine(sp, stage)
    _sp_step(engine, sp, 0)
    engine.save_checkpoint(save_dir, tag="sp")
    losses = [_sp_step(engine, sp, t) for t in (1, 2)]
    return {"losses": losses, "state": engine.consolidated_state_dict()}


def checkpoint_load_body(save_dir: str, sp: int, stage: int) -> dict:
    torch.set_num_threads(1)
    engine = _sp_engine(sp, stage)
    engine.load_checkpoint(save_dir, tag="sp")
    losses = [_sp_step(engine, sp, t) for t in (1, 2)]
    return {"losses": losses, "state": engine.consolidated_state_dict()}


def tutorial_body() -> dict:
    """DeepSpeed's ALST tutorial loop (docs/_tutorials/ulysses-alst-sequence-parallelism.md) with only its imports
    changed (deepspeed -> zerospeed), on a random-init Llama instead of a hub download, gloo instead of nccl."""
    from torch import tensor

    import zerospeed as deepspeed
    import zerospeed.comm as dist_
    from zerospeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from zerospeed.runtime.utils import move_to_device
    from zerospeed.utils import groups

    torch.set_num_threads(1)
    sequence_parallel_size, micro_batch_size = 2, 1
    config_dict = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                   "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                   "sequence_parallel_size": sequence_parallel_size}
    input_ids = tensor([[1, 10, 10, 10, 2, 2], [1, 20, 20, 20, 2, 2]])
    position_ids = tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
    ds = torch.utils.data.TensorDataset(input_ids, position_ids)

    def collate_fn(batch):
        input_ids, position_ids = batch[0]
        return dict(input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0),
                    labels=input_ids.unsqueeze(0))

    dist_.init_distributed(dist_backend="gloo", dist_init_required=True)
    reference = llama()
    ref_losses = [float(full_loss(reference, collate_fn([ds[i]]))) for i in range(2)]
    model = llama()
    mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model, core_attn_implementation="sdpa",
                                                          sequence_parallel_size=sequence_parallel_size,
                                                          micro_batch_size=micro_batch_size, seq_length=6,
                                                          seq_length_is_variable=True)
    try:
        model, _, _, _ = deepspeed.initialize(config=config_dict, model=model, model_parameters=model.parameters(),
                                              mpu=mpu)
        sp_group = groups._get_sequence_parallel_group()
        sp_world_size = groups._get_sequence_parallel_world_size()
        sp_rank = groups._get_sequence_parallel_rank()
        dl = torch.utils.data.DataLoader(ds, batch_size=micro_batch_size, collate_fn=collate_fn)
        dl = UlyssesSPDataLoaderAdapter(dl, sp_rank=sp_rank, sp_group=sp_group, sp_world_size=sp_world_size,
                                        device=model.device)
        losses = []
        for batch in dl:
            batch = move_to_device(batch, model.device)
            outputs = model(**batch)
            shift_labels = batch["shift_labels"]
            loss = model.module.loss_function(logits=outputs.logits, labels=None, shift_labels=shift_labels,
                                              vocab_size=model.module.config.vocab_size)
            losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
            good_tokens = (shift_labels != -100).view(-1).sum()
            good_tokens_per_rank = torch.distributed.nn.functional.all_gather(good_tokens, group=sp_group)
            total_loss = sum(losses_per_rank[rank] * good_tokens_per_rank[rank] for rank in range(sp_world_size))
            total_good_tokens = sum(good_tokens_per_rank)
            loss = total_loss / max(total_good_tokens, 1)
            losses.append(float(loss))
            model.backward(loss)
            model.step()
    finally:
        UlyssesSPAttentionHF.unregister_from_transformers()
    return {"losses": losses, "ref_first": ref_losses[0]}


class _Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        s = sample(0, i, 16)
        return {k: v[0] for k, v in s.items()}


def loader_body(sp: int) -> dict:
    """initialize(training_data=...) under sp: the ranks of an sp group read the same samples, dp groups differ."""
    import zerospeed
    from zerospeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    from zerospeed.utils import groups

    torch.set_num_threads(1)
    engine, _, loader, _ = zerospeed.initialize(model=llama(), config=sp_config(1, sp), training_data=_Samples())
    ids = [b["input_ids"].clone() for b in loader]
    loader.set_epoch(0)  # the same pass again, through the adapter
    adapter = UlyssesSPDataLoaderAdapter(loader, groups._get_sequence_parallel_rank(),
                                         groups._get_sequence_parallel_group(), sp, "cpu")
    shards = [b["input_ids"].clone() for b in adapter]
    return {"ids": torch.cat(ids), "shards": shards, "len": len(adapter),
            "sp_rank": groups._get_sequence_parallel_rank(), "dp_rank": groups._get_data_parallel_rank(),
            "sp_dp_size": engine.dp_world_size}
