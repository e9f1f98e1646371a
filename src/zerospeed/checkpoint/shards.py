"""The resharding map: this rank's shards <-> (parameter name, global offset) pieces.

Save side (:func:`collect_shards`): for every bucket (a :class:`~zerospeed.zero.partitioned_optimizer.ShardView`)
the rank writes one 1-D tensor per *kind* covering the elements it owns, ``b<i>.weight`` (model
dtype), ``b<i>.master`` (fp32, only when it is not the weight itself) and ``b<i>.optim.<state>``
for each element-wise optimizer state (``exp_avg``, ...), and records for each parameter piece
``[shard, key_offset, param_start, numel]``: elements ``[param_start, param_start + numel)`` of the
flattened parameter are elements ``[key_offset, key_offset + numel)`` of every kind's tensor of
that shard. Scalar optimizer state (``step``) is recorded per parameter in JSON.

Who writes what: a sharded bucket (``layout.world_size > 1``, stages 1-3) is written by the rank
that owns each shard; a replicated bucket (stage 0, every rank holds all of it) is split as if it
were sharded over the data-parallel ranks, so all ranks write 1/N of it in parallel and the
files look the same at every stage.

Load side (:func:`plan_targets` / :func:`copy_pieces`): for each piece the loading rank owns in
*its* layout, the overlapping source pieces are found by parameter name and offset, whatever world
size and stage wrote them, and copied (with a dtype cast when needed) into the rank's existing
tensors. Nothing here knows about files; :mod:`zerospeed.checkpoint.reader` supplies the tensors.
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from zerospeed.checkpoint.errors import CheckpointCorruptError
from zerospeed.checkpoint.jsonstate import encode
from zerospeed.checkpoint.tensor_io import dtype_name
from zerospeed.zero.layout import BucketLayout, ShardPiece

#: Prefix of the per-rank optimizer tensors in each rank's file (the 1-bit optimizers' error buffers, see
#: zerospeed.ops.onebit_common): every rank writes its own (``optimizer.rank_local_state()``, keys the optimizer
#: lists in ``rank_local_keys`` are left out of the element-wise pieces) and a load hands every saved rank's to
#: ``optimizer.load_rank_local_state(saved, rank, world)``, which reshards them.
RANK_LOCAL = "rank_local."

#: Optimizer state entries that are one value per parameter tensor even when 0-d tensors.
SCALAR_STATE_KEYS = ("step",)


@dataclass
class LocalShards:
    """What one rank contributes: tensors to write and the JSON record describing them."""

    tensors: dict[str, torch.Tensor | list[torch.Tensor]]  # a list: 1-D parts written as one tensor
    shards: list[dict[str, Any]]  # {"prefix": "b3", "kinds": [...]} in local numbering
    pieces: dict[str, list[list[int]]]  # name -> [[local shard, key_offset, param_start, numel], ...]
    scalars: dict[str, dict[str, Any]]  # name -> {state key: {"v": value, "t": dtype name or absent}}
    state_keys: list[str]  # element-wise optimizer state keys present
    #: this rank's view of its bucketed parameters and module keys; rank 0 merges every rank's, since
    #: ranks can hold parameters rank 0 does not (mixture-of-experts experts on other ranks)
    param_info: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    keys: list[str] = dataclasses.field(default_factory=list)
    #: a pipeline engine's stage (None otherwise) and, on a stage's first replica, its tied-weight aliases
    stage: int | None = None
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)


def pipeline_stages(engine: Any) -> int:
    """Pipeline stages of a pipeline engine (each holds its own layers), 1 for any other engine."""
    return int(getattr(engine, "num_stages", 1) or 1) if getattr(engine, "pipe_group", None) is not None else 1


def all_views(strategy: Any) -> list[Any]:
    """Every sharded bucket of a strategy: trainable ones (``shard_views()``), then frozen ones
    (``frozen_shard_views()``, stage 3: weights only, ``opt_tensors == []``), in a rank-independent order."""
    frozen = getattr(strategy, "frozen_shard_views", None)
    return list(strategy.shard_views()) + (list(frozen()) if callable(frozen) else [])


@contextmanager
def resident_for_checkpoint(strategy: Any, write_back: bool) -> Iterator[None]:
    """Everything a checkpoint reads or writes, in memory for the duration of the block.

    Offloaded state may live on NVMe between steps: optimizer states
    (``strategy.state.resident_for_checkpoint(write_back)``) and stage-3 parameter shards
    (``strategy.resident_params()``). ``write_back`` (a load) stores what the block left in
    them; a save only reads. Strategies without offload have neither hook.
    """
    with ExitStack() as stack:
        params = getattr(strategy, "resident_params", None)
        if callable(params):
            stack.enter_context(params())
        states = getattr(getattr(strategy, "state", None), "resident_for_checkpoint", None)
        if callable(states):
            stack.enter_context(states(write_back))
        yield


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device and a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


def master_is_weight(view: Any) -> bool:
    """True when the fp32 master of a shard is the parameter buffer itself (fp32 training)."""
    return _same_memory(view.master, view.param_shard)


def opt_mode(view: Any) -> str:
    """``"flat"``: one optimizer tensor over the shard; ``"slots"``: one parameter-shaped tensor per slot."""
    opt = view.opt_tensors
    if len(opt) == 1 and opt[0].numel() == view.shard_end - view.shard_start:
        return "flat"
    if len(opt) == len(view.layout.slots) and all(t.numel() == s.numel for t, s in zip(opt, view.layout.slots)):
        return "slots"
    raise ValueError(f"bucket {view.layout.index}: cannot map its {len(opt)} optimizer tensor(s) onto its "
                     f"{len(view.layout.slots)} parameter(s)")


def owned_pieces(view: Any, rank: int, world_size: int, split_replicated: bool) -> list[tuple[ShardPiece, int]]:
    """``(piece, local position in the view's flat tensors)`` for the pieces this rank handles.

    ``split_replicated``: a replicated bucket is divided over ``world_size`` ranks (saving); else
    the rank handles all of it (loading, where each replica needs everything).
    """
    layout: BucketLayout = view.layout
    if layout.world_size == 1 and split_replicated and world_size > 1:
        padded = -(-layout.numel // world_size) * world_size
        virtual = dataclasses.replace(layout, padded_numel=padded, world_size=world_size)
        lo = virtual.shard_range(rank)[0]
        return [(p, lo - view.shard_start + p.shard_start) for p in virtual.pieces(rank)]
    layout_rank = view.shard_start // layout.shard_numel if layout.world_size > 1 else 0
    lo = layout.shard_range(layout_rank)[0]
    return [(p, lo - view.shard_start + p.shard_start) for p in layout.pieces(layout_rank)]


def _slot_positions(layout: BucketLayout) -> dict[str, int]:
    return {s.name: i for i, s in enumerate(layout.slots)}


def _elementwise(key: str, value: Any, like: torch.Tensor) -> bool:
    if not torch.is_tensor(value):
        return False
    if key in SCALAR_STATE_KEYS and value.dim() == 0:
        return False
    if value.shape == like.shape:
        return True
    if value.dim() == 0:
        return False
    raise ValueError(f"optimizer state {key!r} has shape {tuple(value.shape)}, not its parameter's "
                     f"{tuple(like.shape)}: zerospeed checkpoints support element-wise optimizer states only")


def _scalar(value: Any, where: str) -> dict[str, Any]:
    if torch.is_tensor(value):
        return {"v": value.item(), "t": dtype_name(value.dtype)}
    return {"v": encode(value, where, None)}


def collect_shards(views: Sequence[Any], optimizer: torch.optim.Optimizer | None, rank: int, world_size: int,
                   copy: bool) -> LocalShards:
    """This rank's bucket tensors (CPU; cloned when ``copy``) and their piece records."""
    out = LocalShards({}, [], {}, {}, [])
    state_keys: set[str] = set()
    # per-rank optimizer state (the 1-bit optimizers' error buffers) is written by the saver, per rank
    rank_local = set(getattr(optimizer, "rank_local_keys", ()))

    def cpu(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            return t.to("cpu")
        return t.clone() if copy else t.contiguous()

    for bi, view in enumerate(views):
        split = getattr(view, "split", None)  # a replicated bucket of another group (MoE experts)
        owned = owned_pieces(view, *(split or (rank, world_size)), split_replicated=True)
        if not owned:
            continue
        lo = owned[0][1]
        n = sum(p.numel for p, _ in owned)
        prefix = f"b{bi}"
        kinds: dict[str, torch.Tensor | list[torch.Tensor]] = {"weight": cpu(view.param_shard.narrow(0, lo, n))}
        if not master_is_weight(view):
            kinds["master"] = cpu(view.master.narrow(0, lo, n))
        if optimizer is not None and view.opt_tensors:
            mode = opt_mode(view)
            slot_pos = _slot_positions(view.layout)
            if mode == "flat":
                state = optimizer.state.get(view.opt_tensors[0], {})
                for key, value in state.items():
                    if key in rank_local:
                        continue
                    if _elementwise(key, value, view.opt_tensors[0]):
                        kinds[f"optim.{key}"] = cpu(value.reshape(-1).narrow(0, lo, n))
                    else:
                        for p, _ in owned:
                            out.scalars.setdefault(p.slot.name, {})[key] = _scalar(value, f"optimizer state {key!r}")
            else:
                parts: dict[str, list[torch.Tensor]] = {}
                for p, _ in owned:
                    t = view.opt_tensors[slot_pos[p.slot.name]]
                    for key, value in optimizer.state.get(t, {}).items():
                        if key in rank_local:
                            continue
                        if _elementwise(key, value, t):
                            parts.setdefault(key, []).append(value.reshape(-1).narrow(0, p.param_start, p.numel))
                        else:
                            out.scalars.setdefault(p.slot.name, {})[key] = _scalar(value, f"optimizer state {key!r}")
                for key, pieces in parts.items():
                    if len(pieces) != len(owned):
                        raise ValueError(f"optimizer state {key!r} exists for some parameters of bucket {bi} but not "
                                         "others; cannot save it by offset")
                    # a list is written as its concatenation; copy only when a snapshot is needed
                    kinds[f"optim.{key}"] = torch.cat([x.to("cpu") for x in pieces]) if copy and len(pieces) > 1 \
                        else [cpu(x) for x in pieces]
            state_keys.update(k.removeprefix("optim.") for k in kinds if k.startswith("optim."))
        local = len(out.shards)
        out.shards.append({"prefix": prefix, "kinds": sorted(kinds)})
        for kind, t in kinds.items():
            out.tensors[f"{prefix}.{kind}"] = t.contiguous() if torch.is_tensor(t) else t
        offset = 0
        for p, _ in owned:
            out.pieces.setdefault(p.slot.name, []).append([local, offset, p.param_start, p.numel])
            offset += p.numel
    out.state_keys = sorted(state_keys)
    return out


def add_full_tensor(out: LocalShards, name: str, tensor: torch.Tensor, prefix: str, copy: bool) -> None:
    """Record a whole, unsharded tensor (a buffer or frozen parameter) as one piece of kind ``weight``."""
    t = tensor.detach().reshape(-1)
    t = t.to("cpu") if t.device.type != "cpu" else (t.clone() if copy else t.contiguous())
    local = len(out.shards)
    out.shards.append({"prefix": prefix, "kinds": ["weight"]})
    out.tensors[f"{prefix}.weight"] = t
    out.pieces.setdefault(name, []).append([local, 0, 0, t.numel()])


# -- load side --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SourcePiece:
    shard: int  # global shard index in the index
    key_offset: int
    param_start: int
    numel: int


@dataclass(frozen=True)
class CopyOp:
    """Copy ``numel`` elements: source shard ``shard``'s kind tensor at ``src`` -> target at ``dst``."""

    shard: int
    src: int
    dst: int
    numel: int


def plan_range(name: str, sources: Sequence[SourcePiece], param_start: int, numel: int, dst: int) -> list[CopyOp]:
    """Copies that fill elements ``[param_start, param_start + numel)`` of parameter ``name``."""
    ops = []
    cursor, end = param_start, param_start + numel
    for sp in sorted(sources, key=lambda s: s.param_start):
        if cursor >= end:
            break
        if sp.param_start <= cursor < sp.param_start + sp.numel:
            stop = min(end, sp.param_start + sp.numel)
            ops.append(CopyOp(sp.shard, sp.key_offset + cursor - sp.param_start, dst + cursor - param_start,
                              stop - cursor))
            cursor = stop
    if cursor < end:
        raise CheckpointCorruptError(f"the checkpoint index has no data for elements [{cursor}, {end}) of parameter "
                                     f"{name!r}: the index is corrupted or was written by an interrupted save")
    return ops


def copy_pieces(ops: Sequence[CopyOp], source: Callable[[int], torch.Tensor], target: torch.Tensor) -> None:
    """Execute ``ops`` into the 1-D ``target``; ``source(shard)`` gives that shard's 1-D tensor."""
    with torch.no_grad():
        for op in ops:
            src = source(op.shard)
            if op.src + op.numel > src.numel():
                raise CheckpointCorruptError(f"checkpoint shard {op.shard} is shorter than its index says")
            target.narrow(0, op.dst, op.numel).copy_(src.narrow(0, op.src, op.numel))
