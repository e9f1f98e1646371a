"""Saving a training engine: snapshot, per-rank write, agreement, atomic publish (sync or async).

Each data-parallel rank writes only its own shards (one safetensors file); no rank ever gathers
the model. The phases, with an agreement among all ranks after each one that can fail, so that a
failure on any rank makes every rank raise the same :class:`CheckpointSaveError` and nothing is
published:

1. snapshot (every rank): tensors to write and their piece records; rank 0 adds the JSON header
   (optimizer hyperparameters, scheduler, loss scaler, counters, client_state, config). Tags are
   compared across ranks (``checkpoint.tag_validation``).
2. prepare (rank 0): create ``save_dir``, repair leftovers of an interrupted save, create the
   temporary directory; its name travels to the other ranks.
3. write (every rank): ``rank<r>.safetensors`` into the temporary directory, ``fsync``.
4. publish (rank 0): ``index.json``, rename to ``save_dir/<tag>``, then ``latest``
   (see :mod:`zerospeed.checkpoint.publish`).

A pipeline engine with several stages saves one checkpoint for the whole world: every rank (of every
stage) writes ``rank<global rank>.safetensors`` into the one temporary directory global rank 0
created, the agreements span the world, and global rank 0 alone writes ``index.json`` (each stage's
first replica sends its layers' parameter records, buffers and keys; a weight tied across stages
keeps its lowest stage's pieces only) and publishes. The loader plans each stage from that index by
parameter name, so the folder loads at another data-parallel size or stage count.

Asynchronous save (``checkpoint.async_save``): phases 1-2 run in the caller (the snapshot copies
tensors to CPU memory, so training may change them right after), phases 3-4 in a background
thread whose agreements use a dedicated gloo process group, so they never interleave with the
training loop's collectives. ``wait(engine)`` joins it and re-raises its error.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zerospeed import comm
from zerospeed._version import __version__
from zerospeed.checkpoint import publish
from zerospeed.comm import lifecycle
from zerospeed.checkpoint.errors import CheckpointSaveError, CheckpointTagMismatchError
from zerospeed.checkpoint.index import INDEX_FILE, build_index, rank_file
from zerospeed.checkpoint.jsonstate import capture_rng, encode
from zerospeed.checkpoint.shards import (
    RANK_LOCAL,
    LocalShards,
    add_full_tensor,
    all_views,
    collect_shards,
    master_is_weight,
    pipeline_stages,
    resident_for_checkpoint,
)
from zerospeed.checkpoint.tensor_io import dtype_name, write_safetensors

logger = logging.getLogger("zerospeed")


@dataclass
class SaveStats:
    """Timings (seconds) and bytes of the last save on this rank."""

    tag: str = ""
    snapshot_s: float = 0.0  # blocking part of an async save
    write_s: float = 0.0
    publish_s: float = 0.0
    total_s: float = 0.0
    bytes_written: int = 0
    path: str = ""


@dataclass
class _Snapshot:
    shards: LocalShards
    rng_meta: dict[str, Any]
    header: dict[str, Any] | None  # rank 0 only
    param_info: dict[str, dict[str, Any]] | None  # rank 0 only


@dataclass
class _AsyncSave:
    thread: threading.Thread
    error: BaseException | None = None
    stats: SaveStats = field(default_factory=SaveStats)


_PENDING: weakref.WeakKeyDictionary[Any, _AsyncSave] = weakref.WeakKeyDictionary()
_LAST_STATS: weakref.WeakKeyDictionary[Any, SaveStats] = weakref.WeakKeyDictionary()
#: the mesh's purpose name of the gloo copies of the dp groups (:meth:`zerospeed.comm.Mesh.subgroups`)
_CKPT_PURPOSE = "checkpoint.gloo"


# -- agreement ----------------------------------------------------------------------------------------

_UNCHANGED = "nothing was published and the previous checkpoint and 'latest' are unchanged"


def _agree(group: Any, what: str, error: str | None, payload: Any = None, consequence: str = _UNCHANGED) -> list[Any]:
    """Gather ``(error, payload)`` from every rank; raise the same error on all if any rank failed."""
    reports = comm.all_gather_object((error, payload), group=group)
    failures = [f"rank {r}: {e}" for r, (e, _) in enumerate(reports) if e]
    if failures:
        raise CheckpointSaveError(f"checkpoint save failed while {what}; {consequence}:\n  " + "\n  ".join(failures))
    return [p for _, p in reports]


def _error_text(e: BaseException, action: str, path: str) -> str:
    if isinstance(e, OSError):
        return publish.describe_os_error(action, path, e)
    return f"{type(e).__name__}: {e}"


# -- snapshot -----------------------------------------------------------------------------------------

def _module_entries(engine: Any, views: list[Any]) -> tuple[list[str], dict[str, str], dict[str, torch.Tensor]]:
    """``state_dict`` keys in order, tied aliases of bucketed parameters, and the unbucketed entries."""
    bucketed = {s.name for v in views for s in v.layout.slots}
    module = engine.module
    by_id = {id(p): n for n, p in module.named_parameters(remove_duplicate=False) if n in bucketed}
    aliases, extras = {}, {}
    sd = module.state_dict(keep_vars=True)
    for key, value in sd.items():
        if key in bucketed:
            continue
        if id(value) in by_id:
            aliases[key] = by_id[id(value)]
        elif torch.is_tensor(value):
            extras[key] = value
    return list(sd), aliases, extras


def _param_groups_json(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        out = {}
        for key, value in group.items():
            if key == "params":
                continue
            try:
                out[key] = encode(value, f"optimizer.param_groups[{gi}][{key!r}]", None)
            except TypeError as e:
                logger.warning("zerospeed: not saving optimizer hyperparameter %s (%s)", key, e)
        groups.append(out)
    return groups


def _config_json(engine: Any) -> Any:
    record = getattr(engine.config, "json_record", None)  # the user's config as given (ZeroSpeedConfig)
    return record() if record is not None else None


def _tp_layout(engine: Any) -> Any:
    """The engine's tensor-parallel coordinate translator (``module_inject.ckpt_layout``), or None."""
    return getattr(engine, "checkpoint_layout", None)


def _save_rank_group(engine: Any) -> tuple[int, Any]:
    """(this rank's file number, the group that agrees): the dp group; the whole world under tp, and for a
    pipeline engine with several stages (one checkpoint folder for all stages: every rank writes
    ``rank<global rank>`` into the same staging folder, the world agrees, global rank 0 alone publishes)."""
    tp = _tp_layout(engine)
    if tp is not None:
        return tp.rank, tp.group
    if pipeline_stages(engine) > 1:
        return comm.get_rank(), None
    return engine.dp_rank, engine.dp_group


def _add_extras(engine: Any, shards: LocalShards, extras: dict[str, torch.Tensor],
                param_info: dict[str, dict[str, Any]], copy: bool) -> None:
    """Unbucketed module entries (buffers, frozen parameters), written whole by one rank of the model copy."""
    tp = _tp_layout(engine)
    for j, (key, t) in enumerate(extras.items()):
        if tp is not None and tp.is_split(key):
            raise ValueError(f"{key}: a frozen tensor-parallel parameter outside the ZeRO buckets cannot be "
                             "checkpointed yet (make it trainable or use ZeRO stage 3)")
        add_full_tensor(shards, key, t, f"x{j}", copy=copy)
        param_info[key] = {"shape": list(t.shape), "dtype": dtype_name(t.dtype),
                           "kind": "frozen" if isinstance(t, torch.nn.Parameter) else "buffer", "group": None,
                           "master": False}


def _loader_state(engine: Any) -> dict[str, int] | None:
    """The position of the engine's training data loader (``initialize(training_data=...)``), if it has one."""
    state_dict = getattr(getattr(engine, "training_dataloader", None), "state_dict", None)
    return dict(state_dict()) if callable(state_dict) else None


def _rank_local_tensors(optimizer: Any) -> dict[str, torch.Tensor]:
    state = getattr(optimizer, "rank_local_state", None)
    if not callable(state):
        return {}
    return {RANK_LOCAL + k: t.detach().to("cpu", copy=True).contiguous() for k, t in state().items()}


def snapshot(engine: Any, tag: str, client_state: dict[str, Any], copy: bool) -> _Snapshot:
    rank, world = engine.dp_rank, engine.dp_world_size
    tp = _tp_layout(engine)
    # shards swapped out again after the block must be copied while they are in memory
    copy = copy or bool(getattr(engine.strategy, "checkpoint_needs_copy", False)) \
        or bool(getattr(getattr(engine.strategy, "state", None), "checkpoint_needs_copy", False))
    with resident_for_checkpoint(engine.strategy, write_back=False):
        views = all_views(engine.strategy)
        shards = collect_shards(views, engine.optimizer, rank, world, copy=copy)
    if tp is not None:  # pieces of tp-split parameters in full-tensor coordinates
        shards.pieces = tp.to_full(shards.pieces)
    rank_local = _rank_local_tensors(engine.optimizer)
    shards.tensors.update(rank_local)
    rng_meta = capture_rng(shards.tensors)
    param_info: dict[str, dict[str, Any]] = {}
    for v in views:
        separate = not master_is_weight(v)
        kind = "param" if v.opt_tensors else "frozen"
        for s in v.layout.slots:
            shape = list(s.shape) if tp is None else tp.full_shape(s.name, list(s.shape))
            param_info[s.name] = {"shape": shape, "dtype": dtype_name(v.param_shard.dtype), "kind": kind,
                                  "group": v.layout.group_index if v.opt_tensors else None, "master": separate}
    stages = pipeline_stages(engine) if tp is None else 1
    if stages > 1:  # global rank 0 publishes the one index: it needs every stage's rank files in stage order
        shards.stage = int(engine.stage_id)
    if _save_rank_group(engine)[0] != 0:
        if stages > 1 and rank == 0:  # the first replica of another stage: its layers' entries for the index
            keys, aliases, extras = _module_entries(engine, views)
            _add_extras(engine, shards, extras, param_info, copy)
            shards.param_info, shards.keys, shards.aliases = param_info, keys, aliases
        elif any(getattr(v, "split", None) is not None for v in views):  # parameters rank 0 may not hold
            shards.param_info, shards.keys = param_info, list(engine.module.state_dict(keep_vars=True))
        return _Snapshot(shards, rng_meta, None, None)
    keys, aliases, extras = _module_entries(engine, views)
    _add_extras(engine, shards, extras, param_info, copy)
    client_tensors: dict[str, torch.Tensor] = {}
    client_json = encode(client_state, "client_state", client_tensors, key_prefix="client.")
    shards.tensors.update(client_tensors)
    opt = engine.optimizer
    sched = engine.lr_scheduler
    scaler = getattr(engine, "loss_scaler", None)
    files = tp.world_size if tp is not None else comm.get_world_size() if stages > 1 else world
    header = {
        "tag": tag, "world_size": files, "zero_stage": int(engine.zero_stage),
        "compute_dtype": dtype_name(engine.compute_dtype),
        "zerospeed_version": __version__, "torch_version": torch.__version__, "created_unix": time.time(),
        "state_dict_keys": keys, "aliases": aliases,
        "optimizer": None if opt is None else {"class": type(opt).__name__, "param_groups": _param_groups_json(opt),
                                               "rank_local": sorted(k[len(RANK_LOCAL):] for k in rank_local)},
        "lr_scheduler": None if sched is None else encode(sched.state_dict(), "lr_scheduler.state_dict()", None),
        "loss_scaler": None if scaler is None else encode(scaler.state_dict(), "loss_scaler.state_dict()", None),
        "engine": {"global_steps": int(engine.global_steps), "global_samples": int(engine.global_samples),
                   "micro_steps": int(engine.micro_steps), "skipped_steps": int(engine.skipped_steps)},
        "client_state": {"file": rank_file(0), "keys": sorted(client_tensors), "json": client_json},
        "config": _config_json(engine),
        "data_loader": _loader_state(engine),
    }
    return _Snapshot(shards, rng_meta, header, param_info)


# -- the phases ---------------------------------------------------------------------------------------

def _checkpoint_group(engine: Any) -> Any:
    """A gloo group with the data-parallel ranks, for the background thread's agreements."""
    group = _save_rank_group(engine)[1]
    if comm.get_world_size(group) == 1:
        return None
    ranks = tuple(sorted(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())))
    mesh = comm.current_mesh()
    if not mesh.has_subgroup(_CKPT_PURPOSE, ranks, "gloo"):
        # creating a group is collective over the whole world: every rank creates every dp group's copy
        all_ranks = comm.all_gather_object(ranks)
        mesh.subgroups(_CKPT_PURPOSE, list(dict.fromkeys(all_ranks)), backend="gloo")
    return mesh.subgroups(_CKPT_PURPOSE, [ranks], backend="gloo")[ranks]


def _merge_other_ranks(snap: _Snapshot, records: list[dict[str, Any]]) -> None:
    """Add parameters and module keys that only other ranks hold (mixture-of-experts experts, other
    pipeline stages' layers). A parameter several pipeline stages hold (a tied weight, kept equal on
    every stage that uses it) keeps the pieces of its lowest stage only, so it is stored once."""
    assert snap.header is not None and snap.param_info is not None
    keys = snap.header["state_dict_keys"]
    known = set(keys)
    if any(rec.get("stage") is not None for rec in records):
        owner: dict[str, int] = {}
        for rec in records:
            for name in rec["pieces"]:
                owner[name] = min(owner.get(name, rec["stage"]), rec["stage"])
        for rec in records:
            rec["pieces"] = {n: p for n, p in rec["pieces"].items() if owner[n] == rec["stage"]}
            for alias, target in (rec.pop("aliases", None) or {}).items():
                snap.header["aliases"].setdefault(alias, target)
    for rec in records:
        for name, info in (rec.pop("param_info", None) or {}).items():
            snap.param_info.setdefault(name, info)
        for key in rec.pop("keys", None) or []:
            if key not in known:
                known.add(key)
                keys.append(key)


def _write_and_publish(engine_rank: int, snap: _Snapshot, save_dir: str, tag: str, nonce: str, save_latest: bool,
                       group: Any, stats: SaveStats) -> str:
    tmp = publish.tmp_dir(save_dir, tag, nonce)
    path = os.path.join(tmp, rank_file(engine_rank))
    t0 = time.perf_counter()
    error, record = None, None
    publish.pause("write")
    try:
        publish.injected_failure(engine_rank, path)
        rec = write_safetensors(path, snap.shards.tensors, {"format": "pt", "zerospeed": "checkpoint shard"})
        stats.bytes_written = rec.num_bytes
        record = {"file": dict(rec.to_json(), name=rec.name), "shards": snap.shards.shards,
                  "pieces": snap.shards.pieces, "scalars": snap.shards.scalars,
                  "state_keys": snap.shards.state_keys, "rng": snap.rng_meta,
                  "param_info": snap.shards.param_info, "keys": snap.shards.keys,
                  "stage": snap.shards.stage, "aliases": snap.shards.aliases}
    except Exception as e:  # noqa: BLE001 - every failure must reach the agreement
        error = _error_text(e, "write", path)
    snap.shards.tensors.clear()  # free the snapshot as soon as it is on disk
    stats.write_s = time.perf_counter() - t0
    publish.pause("shards")
    try:
        records = _agree(group, "writing shards", error, record)
    except CheckpointSaveError:
        if engine_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    t1 = time.perf_counter()
    final, error = os.path.join(save_dir, tag), None
    if engine_rank == 0:
        index_path = os.path.join(tmp, INDEX_FILE)
        try:
            assert snap.header is not None and snap.param_info is not None
            _merge_other_ranks(snap, records)
            index = build_index(snap.header, records, snap.param_info)
            text = json.dumps(index, separators=(",", ":"))
            with open(index_path, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            publish.pause("index")
            final = publish.publish_dir(tmp, save_dir, tag, nonce)
            publish.pause("latest")
            if save_latest:
                publish.write_text_atomic(os.path.join(save_dir, publish.LATEST_FILE), tag)
        except Exception as e:  # noqa: BLE001
            error = _error_text(e, "publish", index_path)
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    _agree(group, "publishing", error, consequence="'latest' still names the previous checkpoint")
    stats.publish_s = time.perf_counter() - t1
    stats.path = final
    return final


def wait(engine: Any) -> SaveStats | None:
    """Block until this engine's asynchronous save (if any) is published; re-raise its error."""
    pending = _PENDING.pop(engine, None)
    if pending is None:
        return None
    pending.thread.join()
    if pending.error is not None:
        raise pending.error
    return pending.stats


def wait_all() -> None:
    """Block until every engine's asynchronous save is published (run before the process group's teardown)."""
    for engine in list(_PENDING.keys()):
        try:
            wait(engine)
        except Exception as e:  # noqa: BLE001 - at exit: report, keep tearing down
            logger.error("zerospeed: asynchronous checkpoint save failed: %s", e)


lifecycle.add_before_teardown(wait_all)


def pending(engine: Any) -> bool:
    """True while an asynchronous save of this engine is still being written or published."""
    job = _PENDING.get(engine)
    return job is not None and job.thread.is_alive()


def last_stats(engine: Any) -> SaveStats | None:
    return _LAST_STATS.get(engine)


def save(engine: Any, save_dir: str, tag: str | None, client_state: dict[str, Any] | None,
         save_latest: bool, async_save: bool) -> bool:
    """Save ``engine`` (see the module docstring). Returns True once published (sync) or started (async)."""
    wait(engine)
    rank, group = _save_rank_group(engine)
    stats = SaveStats()
    t0 = time.perf_counter()
    if tag is None:
        tag = f"global_step{engine.global_steps}"
    tag = publish.validate_tag(str(tag) if not isinstance(tag, str) else tag)
    save_dir = os.fspath(save_dir)
    error, snap = None, None
    try:
        snap = snapshot(engine, tag, dict(client_state or {}), copy=async_save)
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    tags = _agree(group, "taking the snapshot", error, tag)
    if len(set(tags)) > 1:
        mode = str(engine.config.checkpoint.tag_validation).lower()
        msg = f"checkpoint tags differ across ranks ({', '.join(f'rank {r}: {t!r}' for r, t in enumerate(tags))})"
        if mode == "fail":
            raise CheckpointTagMismatchError(msg + " and checkpoint.tag_validation is 'Fail'")
        if mode == "warn" and rank == 0:
            logger.warning("zerospeed: %s; saving under rank 0's tag %r", msg, tags[0])
        tag = tags[0]
    error, nonce = None, None
    if rank == 0:
        nonce = publish.new_nonce()
        try:
            publish.prepare_save_dir(save_dir)
            os.mkdir(publish.tmp_dir(save_dir, tag, nonce))
        except Exception as e:  # noqa: BLE001
            error = _error_text(e, "create", publish.tmp_dir(save_dir, tag, nonce))
    nonce = _agree(group, "preparing the directory", error, nonce)[0]
    assert snap is not None
    stats.tag = tag
    if not async_save:
        _write_and_publish(rank, snap, save_dir, tag, nonce, save_latest, group, stats)
        stats.total_s = time.perf_counter() - t0
        _LAST_STATS[engine] = stats
        return True
    bg_group = _checkpoint_group(engine)
    stats.snapshot_s = time.perf_counter() - t0
    job = _AsyncSave(threading.Thread(target=lambda: None), stats=stats)

    def run() -> None:
        try:
            _write_and_publish(rank, snap, save_dir, tag, nonce, save_latest, bg_group, stats)
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            job.error = e
        stats.total_s = time.perf_counter() - t0

    job.thread = threading.Thread(target=run, name=f"zerospeed-ckpt-{tag}", daemon=False)
    _PENDING[engine] = job
    _LAST_STATS[engine] = stats
    job.thread.start()
    return True
