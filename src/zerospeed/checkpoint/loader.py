"""Loading a checkpoint into a training engine at any world size and ZeRO stage.

Three phases, so that a bad checkpoint never leaves the model half-loaded:

1. plan and read (every rank): resolve the tag, read and validate ``index.json``, map each piece
   this rank owns in *its* layout to the source pieces by parameter name and offset
   (:mod:`zerospeed.checkpoint.shards`), check names and shapes, and read every tensor needed
   (each file size-checked, each tensor CRC-checked) into memory;
2. agree: every rank reports success or its error; any error makes every rank raise it;
3. apply: copy into the existing tensors (parameters, fp32 masters, optimizer states; never
   replacing a tensor the strategy holds), restore hyperparameters, scheduler, loss scaler,
   counters and this rank's RNG, then let the strategy refresh replicated parameters (the
   all-gather after a step, for stages 1-2).

Which weights feed which tensor: the fp32 master comes from the checkpoint's fp32 master when it
has one (bf16/fp16 training) and from its weights otherwise; with ``load_module_only`` masters are
rebuilt from the module weights (DeepSpeed's warm-start semantics). RNG states are restored only
when the world size is unchanged (they are per rank).

Memory: zerospeed's own shards are read (and CRC-checked) in phase 1. A source that maps its files instead
(DeepSpeed's ``.pt`` files, :class:`~zerospeed.checkpoint.deepspeed.layout.DeepSpeedSource`) only checks them
there; phase 3 then copies one kind (weights, masters, one optimizer state) of one source file at a time and
releases the file after each (``source.release(file)``), so the touched pages of at most one source tensor are
resident beyond the state the load ends with (issue #26).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from zerospeed import comm
from zerospeed.checkpoint import publish
from zerospeed.checkpoint.deepspeed.layout import is_deepspeed_folder
from zerospeed.checkpoint.deepspeed.layout import open_folder as open_deepspeed
from zerospeed.checkpoint.errors import (CheckpointCorruptError, CheckpointError, CheckpointMismatchError,
                                         CheckpointNotFoundError)
from zerospeed.checkpoint.index import CheckpointIndex, rank_file
from zerospeed.checkpoint.jsonstate import decode, restore_rng
from zerospeed.checkpoint.reader import TensorSource
from zerospeed.checkpoint.shards import (
    RANK_LOCAL,
    CopyOp,
    all_views,
    master_is_weight,
    opt_mode,
    owned_pieces,
    pipeline_stages,
    plan_range,
    resident_for_checkpoint,
)
from zerospeed.checkpoint.tensor_io import dtype_from_name

logger = logging.getLogger("zerospeed")


@dataclass
class _Job:
    """Copies into one 1-D target, resolved at apply time (optimizer state may not exist yet)."""

    target: Callable[[], torch.Tensor]
    kind: str
    ops: list[CopyOp]
    state: tuple[int, str] | None = None  # (id(optimizer tensor), state key) of an optimizer-state target


@dataclass
class _Plan:
    jobs: list[_Job] = field(default_factory=list)
    extras: list[tuple[torch.Tensor, str, list[CopyOp]]] = field(default_factory=list)  # (module tensor, kind, ops)
    optim: list[tuple[torch.Tensor, str]] = field(default_factory=list)  # (optimizer tensor, name of its scalars)
    state_keys: list[str] = field(default_factory=list)
    #: id(optimizer tensor) -> the state keys it gets, where not all of ``state_keys`` (Muon's buckets hold
    #: momentum_buffer, its Adam buckets exp_avg / exp_avg_sq: a bucket never mixes optimizer groups)
    keys_of: dict[int, list[str]] = field(default_factory=dict)
    clear_optim: list[torch.Tensor] = field(default_factory=list)
    rng_keys: list[str] = field(default_factory=list)

    def wanted(self, index: CheckpointIndex) -> set[tuple[str, str]]:
        out = set()
        for job in self.jobs:
            out.update(index.key(op.shard, job.kind) for op in job.ops)
        for _, kind, ops in self.extras:
            out.update(index.key(op.shard, kind) for op in ops)
        return out


def resolve(load_dir: str, tag: str | None) -> tuple[str | None, str | None]:
    """``(tag, directory)``; ``(None, None)`` when there is no ``latest`` and no tag (DeepSpeed's behaviour)."""
    load_dir = os.fspath(load_dir)
    if not os.path.exists(load_dir):
        raise CheckpointNotFoundError(f"checkpoint directory {load_dir} does not exist")
    if not os.path.isdir(load_dir):
        raise CheckpointNotFoundError(f"checkpoint directory {load_dir} is not a directory")
    from_latest = tag is None
    if tag is None:
        tag = publish.read_latest(load_dir)
        if tag is None and os.path.isfile(os.path.join(load_dir, "latest_universal")):
            # a DeepSpeed universal checkpoint alone: follow DeepSpeed's latest_universal (issue #26)
            with open(os.path.join(load_dir, "latest_universal"), encoding="utf-8") as f:
                tag = f.read().strip()
        if tag is None:
            return None, None
    tag = publish.validate_tag(str(tag))
    return tag, publish.resolve_tag_dir(load_dir, tag, from_latest)


def _check_names(index: CheckpointIndex, shapes: dict[str, list[int]], strict: bool,
                 held_elsewhere: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    """``held_elsewhere``: names other ranks of the model hold (mixture-of-experts experts), which
    are expected in the checkpoint although this rank has no such parameter."""
    have = set(index.params)
    model_keys = set(shapes)
    missing = sorted(k for k in model_keys if index.canonical(k) not in have)
    unexpected = sorted(k for k in index.params if k not in model_keys and k not in held_elsewhere)
    problems = []
    for name in sorted(model_keys):
        src = index.canonical(name)
        if src in have:
            want = shapes[name]
            if [int(d) for d in index.params[src]["shape"]] != want:
                problems.append(f"{name}: checkpoint shape {tuple(index.params[src]['shape'])}, "
                                f"model shape {tuple(want)}")
    if problems:
        raise CheckpointMismatchError(f"{index.path}: shapes differ:\n  " + "\n  ".join(problems[:20]))
    if strict and (missing or unexpected):
        def show(xs: list[str]) -> str:
            return ", ".join(xs[:10]) + (f" ... ({len(xs)} in all)" if len(xs) > 10 else "")

        raise CheckpointMismatchError(
            f"{index.path} does not match the model (load_module_strict=True): "
            + (f"missing from the checkpoint: {show(missing)}; " if missing else "")
            + (f"not in the model: {show(unexpected)}; " if unexpected else "")
            + "pass load_module_strict=False to load the parameters they share")


def _weight_kind(index: CheckpointIndex, name: str, want_master: bool) -> str:
    return "master" if want_master and index.has_kind(name, "master") else "weight"


def _ranged(tp: Any) -> Callable[..., list[CopyOp]]:
    """``plan_range`` in this rank's local coordinates (tensor-parallel pieces map to full-tensor runs)."""
    if tp is None:
        return plan_range

    def ranged(src: str, sources: Any, param_start: int, numel: int, dst: int) -> list[CopyOp]:
        return [op for full, off, n in tp.runs(src, param_start, numel)
                for op in plan_range(src, sources, full, n, dst + off)]

    return ranged


def plan(engine: Any, index: CheckpointIndex, strict: bool, load_optimizer: bool, module_only: bool) -> _Plan:
    rank, world = engine.dp_rank, engine.dp_world_size
    tp = getattr(engine, "checkpoint_layout", None)
    ranged = _ranged(tp)
    views = all_views(engine.strategy)
    bucketed = {s.name for v in views for s in v.layout.slots}
    by_id = {id(p) for n, p in engine.module.named_parameters(remove_duplicate=False) if n in bucketed}
    extras = {k: t for k, t in engine.module.state_dict(keep_vars=True).items()
              if k not in bucketed and torch.is_tensor(t) and id(t) not in by_id}
    shapes = {s.name: list(s.shape) if tp is None else tp.full_shape(s.name, list(s.shape))
              for v in views for s in v.layout.slots}
    split_extras = [k for k in extras if tp is not None and tp.is_split(k)]
    if split_extras:
        raise CheckpointMismatchError(f"{split_extras[0]}: a frozen tensor-parallel parameter outside the ZeRO "
                                      "buckets cannot be loaded from a checkpoint yet")
    shapes.update((k, list(t.shape)) for k, t in extras.items())
    held_elsewhere: set[str] = set()
    if any(getattr(v, "split", None) is not None for v in views):  # experts differ between ranks
        for names in comm.all_gather_object(sorted(shapes), engine.dp_group):
            held_elsewhere.update(names)
    if pipeline_stages(engine) > 1:  # the other stages' layers are theirs to load
        for names in comm.all_gather_object(sorted(shapes)):
            held_elsewhere.update(names)
    _check_names(index, shapes, strict, held_elsewhere)
    out = _Plan()
    opt_info = index.data.get("optimizer") or {}
    scalars = opt_info.get("scalars") or {}
    if load_optimizer and not module_only and engine.optimizer is not None:
        out.state_keys = list(opt_info.get("state_keys") or [])
    for v in views:
        aliased = master_is_weight(v)
        owned = owned_pieces(v, rank, world, split_replicated=False)
        weight_ops: dict[str, list[CopyOp]] = {}
        master_ops: dict[str, list[CopyOp]] = {}
        optim_ops: dict[tuple[int, str], list[CopyOp]] = {}
        mode = opt_mode(v) if out.state_keys and v.opt_tensors else None
        slot_pos = {s.name: i for i, s in enumerate(v.layout.slots)}
        in_ckpt = [index.canonical(s.name) for s in v.layout.slots if index.canonical(s.name) in index.params]
        bucket_keys = [k for k in out.state_keys if any(index.has_kind(n, f"optim.{k}") for n in in_ckpt)] \
            if in_ckpt else out.state_keys  # the keys this bucket's optimizer group saved
        for piece, pos in owned:
            src = index.canonical(piece.slot.name)
            if src not in index.params:
                continue  # non-strict: left as it is
            sources = index.sources(src)
            ops = ranged(src, sources, piece.param_start, piece.numel, pos)
            kind = _weight_kind(index, src, want_master=aliased and not module_only)
            weight_ops.setdefault(kind, []).extend(ops)
            if not aliased:
                master_ops.setdefault(_weight_kind(index, src, want_master=not module_only), []).extend(ops)
            if mode is not None:
                if mode == "flat":
                    tgt_ops, t_index = ops, 0
                else:
                    tgt_ops = ranged(src, sources, piece.param_start, piece.numel, piece.param_start)
                    t_index = slot_pos[piece.slot.name]
                for key in bucket_keys:
                    if not index.has_kind(src, f"optim.{key}"):
                        raise CheckpointError(f"{index.path}: optimizer state {key!r} of {src!r} is missing")
                    optim_ops.setdefault((t_index, key), []).extend(tgt_ops)
        for kind, ops in weight_ops.items():
            out.jobs.append(_Job(lambda v=v: v.param_shard, kind, ops))
        for kind, ops in master_ops.items():
            out.jobs.append(_Job(lambda v=v: v.master, kind, ops))
        if mode is not None:
            # which of this bucket's optimizer tensors get state, and whose scalars (step) they take
            if mode == "flat":
                names = [p.slot.name for p, _ in owned] or [s.name for s in v.layout.slots]
                candidates = [(0, [index.canonical(n) for n in names])]
            else:
                candidates = [(i, [index.canonical(s.name)]) for i, s in enumerate(v.layout.slots)]
            for t_index, names in candidates:
                present = [n for n in names if n in index.params]
                t = v.opt_tensors[t_index]
                if not present:  # non-strict load of a parameter the checkpoint lacks: fresh state
                    out.clear_optim.append(t)
                    continue
                out.optim.append((t, next((n for n in present if n in scalars), present[0])))
                out.keys_of[id(t)] = bucket_keys
                for key in bucket_keys:
                    out.jobs.append(_Job(lambda t=t, key=key: engine.optimizer.state[t][key].view(-1), f"optim.{key}",
                                         optim_ops.get((t_index, key), []), (id(t), key)))
        elif load_optimizer and not module_only and engine.optimizer is not None:
            out.clear_optim.extend(v.opt_tensors)
    for key, t in extras.items():
        src = index.canonical(key)
        if src in index.params:
            out.extras.append((t, "weight", plan_range(src, index.sources(src), 0, index.numel(src), 0)))
    return out


def _make_optimizer_state(engine: Any, p: _Plan, index: CheckpointIndex, source: TensorSource) -> None:
    opt = engine.optimizer
    scalars = (index.data.get("optimizer") or {}).get("scalars") or {}
    dtypes: dict[str, torch.dtype] = {}
    for job in p.jobs:
        if job.kind.startswith("optim.") and job.ops:
            dtypes.setdefault(job.kind[6:], source.shard(job.ops[0].shard, job.kind).dtype)
    groups_of = {id(t): g for g in opt.param_groups for t in g["params"]}
    covered: dict[tuple[int, str], list[CopyOp]] = {}
    for job in p.jobs:
        if job.state is not None:
            covered.setdefault(job.state, []).extend(job.ops)
    for t, name in p.optim:
        group = groups_of.get(id(t), {})
        on_device = bool(group.get("capturable") or group.get("fused"))
        new: dict[str, Any] = {}
        for key, enc in (scalars.get(name) or {}).items():
            if "t" in enc:
                new[key] = torch.tensor(enc["v"], dtype=dtype_from_name(enc["t"]),
                                        device=t.device if on_device else "cpu")
            else:
                new[key] = decode(enc["v"])
        for key in p.keys_of.get(id(t), p.state_keys):
            new[key] = _fresh_state(t, dtypes.get(key, t.dtype), covered.get((id(t), key), []))
        opt.state[t] = new
    for t in p.clear_optim:
        opt.state.pop(t, None)


def _fresh_state(t: torch.Tensor, dtype: torch.dtype, ops: list[CopyOp]) -> torch.Tensor:
    """A state tensor like ``t`` whose elements the copies ``ops`` do not write are zero: the copies fill the rest
    (zero-filling all of it first wrote every moment twice: an extra pass over the optimizer state at each load)."""
    out = torch.empty_like(t, dtype=dtype, memory_format=torch.contiguous_format)
    flat, cursor = out.view(-1), 0
    with torch.no_grad():
        for op in sorted(ops, key=lambda o: o.dst):
            if op.dst > cursor:
                flat[cursor:op.dst].zero_()
            cursor = max(cursor, op.dst + op.numel)
        if cursor < flat.numel():
            flat[cursor:].zero_()
    return out


def _restore_param_groups(engine: Any, index: CheckpointIndex) -> None:
    info = index.data.get("optimizer") or {}
    saved = info.get("param_groups")
    if saved is None:
        return
    if info.get("class") != type(engine.optimizer).__name__ and engine.dp_rank == 0:
        logger.warning("zerospeed: checkpoint %s holds %s optimizer state, loading it into %s", index.directory,
                       info.get("class"), type(engine.optimizer).__name__)
    groups = engine.optimizer.param_groups
    if len(saved) != len(groups):
        raise CheckpointMismatchError(f"{index.path}: the checkpoint's optimizer has {len(saved)} parameter groups, "
                                      f"this engine's has {len(groups)}; pass load_optimizer_states=False")
    for group, values in zip(groups, saved):
        for key, enc in values.items():
            value = decode(enc)
            current = group.get(key)
            if torch.is_tensor(current) and not torch.is_tensor(value):
                current.fill_(value)
            elif torch.is_tensor(current) and torch.is_tensor(value):
                current.copy_(value)
            else:
                group[key] = value


def refresh_strategy(engine: Any) -> None:
    """Let the strategy rebuild what derives from the loaded shards (a collective on every rank).

    A strategy says how with ``after_checkpoint_load()``. Until every strategy has one, the
    fallback does what follows an optimizer step: refresh the 16-bit shards from the masters and
    all-gather replicated parameters (stages 1-2), and re-gather stage 3's persistent buckets.
    """
    strategy = engine.strategy
    hook = getattr(strategy, "after_checkpoint_load", None)
    if callable(hook):
        hook()
    else:
        publish_params = getattr(getattr(strategy, "state", None), "_publish_params", None)
        if callable(publish_params):
            publish_params()
        regather = getattr(getattr(strategy, "runtime", None), "gather_persistent", None)
        if callable(regather):
            regather()
    if hasattr(strategy, "zero_grad"):
        strategy.zero_grad()


def load(engine: Any, load_dir: str, tag: str | None, load_module_strict: bool, load_optimizer_states: bool,
         load_lr_scheduler_states: bool, load_module_only: bool) -> tuple[str | None, dict[str, Any] | None]:
    group, rank, world = engine.dp_group, engine.dp_rank, engine.dp_world_size
    tp = getattr(engine, "checkpoint_layout", None)
    if tp is not None:  # every rank of the world loads its own pieces; they agree (and restore RNG) as one
        group, rank, world = tp.group, tp.rank, tp.world_size
    elif pipeline_stages(engine) > 1:  # each stage loads its own layers; all stages agree as one
        group, rank, world = None, comm.get_rank(), comm.get_world_size()
    # DeepSpeed 0.19.8 looks only for load_dir/latest: a directory not created yet (an elastic job's first attempt)
    # is "nothing to load", (None, None) with the warning below, not an error (issue #33); with a tag it is one
    first_attempt = tag is None and not os.path.exists(os.fspath(load_dir))
    tag, directory = (None, None) if first_attempt else resolve(load_dir, tag)
    tags = comm.all_gather_object(tag, group=group)
    if len(set(tags)) > 1:
        raise CheckpointError(f"ranks resolved different checkpoint tags in {load_dir}: {tags} ('latest' changed "
                              "during the load?); pass tag= explicitly")
    if directory is None:
        if rank == 0:
            logger.warning("zerospeed: no 'latest' file in %s and no tag given: nothing loaded (pass tag= to load a "
                           "specific checkpoint)", load_dir)
        return None, None
    error, source, p, index, rng_file, ds_folder = None, None, None, None, None, None
    try:
        if not os.path.isfile(os.path.join(directory, "index.json")) and is_deepspeed_folder(directory):
            index, source, ds_folder = open_deepspeed(directory)  # DeepSpeed's layout as pieces (issue #26)
        else:
            index = CheckpointIndex.read(directory)
        p = plan(engine, index, load_module_strict, load_optimizer_states, load_module_only)
        wanted = p.wanted(index)
        client = index.data.get("client_state") or {}
        wanted.update((client["file"], k) for k in client.get("keys", []))
        if load_optimizer_states and not load_module_only:
            wanted.update(_rank_local_wanted(engine, index))
        restore = (not load_module_only) and index.world_size == world and rank < len(index.data["rng"])
        if restore:
            rng_file = index.data["rng"][rank]["file"]
            num_cuda = int(index.data["rng"][rank]["meta"].get("num_cuda", 0))
            p.rng_keys = ["rng.python", "rng.numpy", "rng.torch_cpu"] + [f"rng.cuda.{i}" for i in range(num_cuda)]
            wanted.update((rng_file, k) for k in p.rng_keys)
        if source is None:
            source = TensorSource(index)
        source.prefetch(wanted)
    except (KeyError, TypeError, IndexError, AttributeError) as e:  # malformed JSON content deep in the index
        where = index.path if index is not None else os.path.join(directory, "index.json")
        error = CheckpointCorruptError(f"{where}: unexpected content ({type(e).__name__}: {e}): the index is "
                                       "corrupted or was written by an incompatible version")
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        error = e
    reports = comm.all_gather_object(None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        if source is not None:
            source.close()
        raise error
    failed = [f"rank {r}: {e}" for r, e in enumerate(reports) if e]
    if failed:
        raise CheckpointError("checkpoint load failed on another rank; nothing was loaded:\n  " + "\n  ".join(failed))
    assert index is not None and p is not None and source is not None
    try:
        with resident_for_checkpoint(engine.strategy, write_back=True):
            _apply(engine, index, p, source, load_optimizer_states, load_lr_scheduler_states, load_module_only,
                   rng_file)
        if ds_folder is not None and not load_module_only:  # DeepSpeed does not save its micro-step count
            engine.micro_steps = int(engine.global_steps) * int(engine.gradient_accumulation_steps())
        if ds_folder is not None:  # what DeepSpeed's load_checkpoint returns for the same options
            client_state = ds_folder.client_state(load_optimizer_states, load_lr_scheduler_states, load_module_only)
        else:
            client = index.data.get("client_state") or {}
            tensors = {k: source.get(client["file"], k).clone() for k in client.get("keys", [])}
            client_state = decode(client.get("json", {}), tensors)
    finally:
        source.close()
    if not (index.world_size == world) and rank == 0 and not load_module_only and ds_folder is None:
        logger.warning("zerospeed: checkpoint %s was saved at data-parallel world size %d, loading at %d: RNG states "
                       "are per rank and were not restored", directory, index.world_size, world)
    return directory, client_state


def _rank_local_wanted(engine: Any, index: CheckpointIndex) -> list[tuple[str, str]]:
    """(file, key) of every saved rank's per-rank optimizer tensors, when this engine's optimizer takes them."""
    names = (index.data.get("optimizer") or {}).get("rank_local") or []
    if not names or not callable(getattr(engine.optimizer, "load_rank_local_state", None)):
        return []
    return [(rank_file(r), RANK_LOCAL + n) for r in range(index.world_size) for n in names]


def _apply_rank_local(engine: Any, index: CheckpointIndex, source: TensorSource) -> None:
    wanted = _rank_local_wanted(engine, index)
    if not wanted:
        return
    saved: list[dict[str, torch.Tensor]] = [{} for _ in range(index.world_size)]
    for r in range(index.world_size):
        for fname, key in wanted:
            if fname == rank_file(r):
                saved[r][key[len(RANK_LOCAL):]] = source.get(fname, key).clone()
    engine.optimizer.load_rank_local_state(saved, engine.dp_rank, engine.dp_world_size)


def _apply(engine: Any, index: CheckpointIndex, p: _Plan, source: TensorSource, load_optimizer_states: bool,
           load_lr_scheduler_states: bool, module_only: bool, rng_file: str | None) -> None:
    from zerospeed.checkpoint.shards import copy_pieces

    if p.state_keys or p.clear_optim:
        _make_optimizer_state(engine, p, index, source)
    release = getattr(source, "release", None)
    if callable(release):  # a memory-mapped source (DeepSpeed's files): one file's tensors of one kind at a time
        groups = sorted({(index.shards[op.shard]["file"], job.kind) for job in p.jobs for op in job.ops})
        for fname, kind in groups:
            for job in p.jobs:
                ops = [op for op in job.ops if job.kind == kind and index.shards[op.shard]["file"] == fname]
                if ops:
                    copy_pieces(ops, lambda s, k=job.kind: source.shard(s, k), job.target())
            release(fname)
    else:
        for job in p.jobs:
            copy_pieces(job.ops, lambda s, k=job.kind: source.shard(s, k), job.target())
    with torch.no_grad():
        for t, kind, ops in p.extras:
            flat = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
            copy_pieces(ops, lambda s, k=kind: source.shard(s, k), flat)
            t.copy_(flat.view(t.shape))
    if not module_only:
        if load_optimizer_states and engine.optimizer is not None:
            _restore_param_groups(engine, index)
            _apply_rank_local(engine, index, source)
        sched = engine.lr_scheduler
        if load_lr_scheduler_states and sched is not None and index.data.get("lr_scheduler") is not None:
            sched.load_state_dict(decode(index.data["lr_scheduler"]))
        scaler = getattr(engine, "loss_scaler", None)
        if scaler is not None and index.data.get("loss_scaler") is not None:
            scaler.load_state_dict(decode(index.data["loss_scaler"]))
        counters = index.data["engine"]
        engine.global_steps = int(counters.get("global_steps", 0))
        engine.global_samples = int(counters.get("global_samples", 0))
        engine.micro_steps = int(counters.get("micro_steps", 0))
        engine.skipped_steps = int(counters.get("skipped_steps", 0))
        data = index.data.get("data_loader")
        restore_position = getattr(getattr(engine, "training_dataloader", None), "load_state_dict", None)
        if data is not None and callable(restore_position):  # resume the data where the saved run was
            restore_position(data)
        if rng_file is not None:
            meta = next(r["meta"] for r in index.data["rng"] if r["file"] == rng_file)
            restore_rng(meta, {k: source.get(rng_file, k) for k in p.rng_keys})
    refresh_strategy(engine)
