"""The search space: which config keys the tuner varies, and the candidate configs they make.

A user writes the space into the DeepSpeed config as DeepSpeed allows: a list where a value would
be (``"zero_optimization": {"stage": [1, 2]}``, ``"train_micro_batch_size_per_gpu": [4, 8]``),
``"stage": "all"``, and ``"auto"`` (or nothing) for the micro-batch size, which the tuner then
finds by bisection. A scalar pins a key. Only the keys in :data:`SEARCHABLE` may hold a list
(others, such as ``optimizer.params.betas``, are lists by nature and are left alone).

Decisions:

* Without ``fast``, the tuner adds the knobs of :data:`KNOBS` that the user left unset, for the
  stages they apply to: ``overlap_comm``, bucket sizes, and offload of the optimizer (stages 1-3)
  and of the parameters (stage 3) to ``cpu``; NVMe offload is searched only when the user lists
  ``"nvme"`` (it needs an ``nvme_path``). With ``fast`` (DeepSpeed's default) only the stage and
  the micro-batch size (and what the user listed) are searched.
* Tensor- and pipeline-parallel degrees are searched when listed (``tensor_parallel.autotp_size``,
  ``pipeline.stages``); a pipeline degree reaches the script through ``arg_mappings``, since the
  script builds its ``PipelineModule``.
* A candidate is a flat ``{dotted path: value}`` dict; :func:`materialize` writes it over the
  user's config. Its name is readable and unique (a short hash of the values).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

STAGE = "zero_optimization.stage"
MBS = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"
TBS = "train_batch_size"
OFFLOAD_OPT = "zero_optimization.offload_optimizer.device"
OFFLOAD_PARAM = "zero_optimization.offload_param.device"
ALL_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Knob:
    """A key the full (non-fast) search varies when the user left it unset."""

    path: str
    values: tuple[Any, ...]
    stages: tuple[int, ...]


KNOBS: tuple[Knob, ...] = (
    Knob("zero_optimization.overlap_comm", (False, True), (0, 1, 2, 3)),
    Knob("zero_optimization.reduce_bucket_size", (5_000_000, 500_000_000), (0, 1, 2)),
    Knob("zero_optimization.stage3_prefetch_bucket_size", (5_000_000, 50_000_000), (3,)),
    Knob(OFFLOAD_OPT, ("none", "cpu"), (1, 2, 3)),
    Knob(OFFLOAD_PARAM, ("none", "cpu"), (3,)),
)

#: keys that may hold a list of values to search (anything else keeps its list as the value)
SEARCHABLE = frozenset({
    STAGE, MBS, GAS,
    "zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients", "zero_optimization.reduce_scatter",
    "zero_optimization.reduce_bucket_size", "zero_optimization.allgather_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.stage3_max_live_parameters", "zero_optimization.sub_group_size",
    OFFLOAD_OPT, OFFLOAD_PARAM, "tensor_parallel.autotp_size", "pipeline.stages",
})

#: knobs that only mean something at some stages (a user list is still restricted to these)
STAGES_OF = {
    OFFLOAD_OPT: (1, 2, 3),
    OFFLOAD_PARAM: (3,),
    "zero_optimization.stage3_prefetch_bucket_size": (3,),
    "zero_optimization.stage3_param_persistence_threshold": (3,),
    "zero_optimization.stage3_max_live_parameters": (3,),
}


class SpaceError(ValueError):
    """A search space that cannot be searched; the message names the key."""


def get_path(raw: dict[str, Any], path: str, default: Any = None) -> Any:
    node: Any = raw
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def set_path(raw: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = raw
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[leaf] = value


def _walk(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict):
                out += _walk(value, f"{path}.")
            else:
                out.append((path, value))
    return out


@dataclass
class Space:
    """The user's config split into fixed values and searched dimensions."""

    base: dict[str, Any]
    dims: dict[str, tuple[Any, ...]]
    stages: tuple[int, ...]
    mbs_values: tuple[int, ...] | None  # None: find by bisection
    fixed_train_batch_size: int | None
    fast: bool
    knobs: dict[int, dict[str, tuple[Any, ...]]] = field(default_factory=dict)  # stage -> dims


def split_space(raw: dict[str, Any], fast: bool) -> Space:
    """Separate searched keys (lists, ``"all"``, ``"auto"``) from the fixed config."""
    base = copy.deepcopy(raw)
    base.pop("autotuning", None)
    dims: dict[str, tuple[Any, ...]] = {}
    for path, value in _walk(base):
        if path in SEARCHABLE and isinstance(value, list):
            if not value:
                raise SpaceError(f"{path}: an empty list leaves nothing to search")
            dims[path] = tuple(value)
    stage_value = get_path(base, STAGE)
    if stage_value == "all" or stage_value is None:
        stages = ALL_STAGES
    elif STAGE in dims:
        stages = dims.pop(STAGE)
    else:
        stages = (stage_value,)
    for s in stages:
        if isinstance(s, bool) or s not in ALL_STAGES:
            raise SpaceError(f"{STAGE}: {s!r} is not one of 0, 1, 2, 3 (or \"all\")")
    mbs_value = base.get(MBS)
    if MBS in dims:
        mbs_values: tuple[int, ...] | None = tuple(int(v) for v in dims.pop(MBS))
    elif mbs_value is None or mbs_value == "auto":
        mbs_values = None
    else:
        mbs_values = (int(mbs_value),)
    tbs = base.get(TBS)
    fixed_tbs = None if tbs is None or tbs == "auto" or isinstance(tbs, list) else int(tbs)
    for path in (STAGE, MBS, GAS, TBS, *dims):
        # a searched list never stays in the fixed part: a stage the key does not apply to (offload
        # at stage 0) gets the default, not the list
        _delete(base, path)
    if GAS not in dims:
        gas = raw.get(GAS)
        dims[GAS] = (1,) if gas in (None, "auto") or fixed_tbs is not None else (int(gas),)
    space = Space(base=base, dims=dims, stages=tuple(stages), mbs_values=mbs_values,
                  fixed_train_batch_size=fixed_tbs, fast=fast)
    for stage in space.stages:
        per: dict[str, tuple[Any, ...]] = {}
        for path, values in dims.items():
            if stage in STAGES_OF.get(path, ALL_STAGES):
                per[path] = values
        if not fast:
            for knob in KNOBS:
                if stage in knob.stages and path_unset(base, knob.path) and knob.path not in per:
                    per[knob.path] = knob.values
        space.knobs[stage] = per
    return space


def path_unset(raw: dict[str, Any], path: str) -> bool:
    return get_path(raw, path) is None


def _delete(raw: dict[str, Any], path: str) -> None:
    *parents, leaf = path.split(".")
    node: Any = raw
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(leaf, None)


def candidates(space: Space, stage: int, mbs_values: tuple[int, ...], dp_world_size: int,
               max_train_batch_size: int | None = None, min_train_batch_size: int = 1) -> list[dict[str, Any]]:
    """Every candidate of one stage: the product of its dims and the micro-batch sizes, keeping the
    batch arithmetic consistent (a fixed ``train_batch_size`` derives the accumulation steps)."""
    dims = space.knobs[stage]
    names = [p for p in dims if p != GAS]
    out: list[dict[str, Any]] = []
    for mbs in mbs_values:
        gas_values: tuple[int, ...]
        if space.fixed_train_batch_size is not None:
            per_step = mbs * dp_world_size
            if space.fixed_train_batch_size % per_step:
                continue
            gas_values = (space.fixed_train_batch_size // per_step,)
        else:
            gas_values = tuple(int(g) for g in dims.get(GAS, (1,)))
        for gas in gas_values:
            tbs = mbs * gas * dp_world_size
            if max_train_batch_size is not None and tbs > max_train_batch_size:
                continue
            if tbs < min_train_batch_size:
                continue
            for combo in itertools.product(*(dims[p] for p in names)):
                cand = {STAGE: stage, MBS: mbs, GAS: gas}
                cand.update(zip(names, combo))
                if cand.get(OFFLOAD_PARAM, "none") != "none" and stage != 3:
                    continue
                out.append(cand)
    return out


def materialize(space: Space, candidate: dict[str, Any], dp_world_size: int) -> dict[str, Any]:
    """The concrete DeepSpeed config of a candidate (no lists, no ``"auto"`` in searched keys)."""
    raw = copy.deepcopy(space.base)
    for path, value in candidate.items():
        set_path(raw, path, value)
    raw[TBS] = candidate[MBS] * candidate[GAS] * dp_world_size
    return raw


_SHORT = {
    STAGE: "z", MBS: "mbs", GAS: "gas", "zero_optimization.overlap_comm": "oc",
    "zero_optimization.reduce_bucket_size": "rbs", "zero_optimization.allgather_bucket_size": "abs",
    "zero_optimization.stage3_prefetch_bucket_size": "pbs", OFFLOAD_OPT: "oo", OFFLOAD_PARAM: "op",
    "tensor_parallel.autotp_size": "tp", "pipeline.stages": "pp",
}


def candidate_name(candidate: dict[str, Any]) -> str:
    """A readable, unique, filesystem-safe name: ``z2_mbs8_gas1_oc1_oocpu_3f2a1c``."""
    parts = []
    for path, value in candidate.items():
        tag = _SHORT.get(path, path.rsplit(".", 1)[-1][:4])
        if isinstance(value, bool):
            value = int(value)
        elif isinstance(value, int) and value >= 1_000_000 and value % 1_000_000 == 0:
            value = f"{value // 1_000_000}m"
        parts.append(f"{tag}{value}")
    digest = hashlib.sha1(json.dumps(candidate, sort_keys=True).encode()).hexdigest()[:6]
    return "_".join(parts + [digest])
