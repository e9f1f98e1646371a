"""A folder written by ``DeepSpeedEngine.save_checkpoint`` seen as a zerospeed checkpoint index.

zerospeed's loader reshards by (parameter name, element offset): its index maps each parameter to
pieces ``[shard, key_offset, param_start, numel]`` of 1-D tensors of kinds ``weight``, ``master``
and ``optim.<state>``. DeepSpeed's files hold exactly such 1-D tensors, so this module describes
them in that form and :class:`DeepSpeedSource` hands the loader the tensors by the same keys; the
loader then restores any DeepSpeed folder at any world size, ZeRO stage and offload setting, with
the checks and the all-ranks-agree step it applies to its own checkpoints.

Layouts read (DeepSpeed 0.19.8; pipeline-parallel and tensor-parallel folders are read rank by rank as
these, see :mod:`zerospeed.checkpoint.deepspeed.model_parallel`):

* ZeRO 1 and 2 (``zero_pp_rank_R_mp_rank_00_optim_states.pt``, ``bf16_`` prefix for bf16): per
  optimizer group, the flat fp32 partition ``single_partition_of_fp32_groups[g]`` of rank R covers
  elements ``[R*P, R*P + len)`` of the group's parameters flattened in ``param_shapes[g]`` order
  (P = rank 0's length; the last rank's padding is not saved); the Adam moments are the base
  optimizer's state of group g (the padding cut off). Weights come from ``module`` of
  ``mp_rank_00_model_states.pt``. bf16 at ZeRO 0 uses the same files when DeepSpeed's BF16_Optimizer
  wrote them.
* ZeRO 3 (``zero_pp_rank_R_mp_rank_00_model_states.pt`` + ``..._optim_states.pt``): every parameter is
  split on its own into ``ceil(numel / dp)`` elements per rank, and rank R's flat partition is the
  concatenation of its part of each parameter (``fp32_flat_groups`` of all sub-groups in order);
  the 16-bit weight is the master rounded.
* ZeRO 0: fp32 keeps a torch optimizer ``state_dict`` in ``mp_rank_00_model_states.pt`` (state by
  parameter index, in parameter order); fp16/bf16 without ZeRO keep DeepSpeed's FP16_Optimizer state
  there: one flat fp32 group (``fp32_groups_flat``) over all trainable parameters in order, its flat
  moments, and the dynamic loss scale.

Scalar optimizer state (Adam's ``step``) is per group; every parameter of the group gets it. The
loss scaler maps to zerospeed's (scale, hysteresis left, clean steps since the last overflow).
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from zerospeed.checkpoint.deepspeed.errors import (DeepSpeedFileMissingError, DeepSpeedLayoutError,
                                                   DeepSpeedUnsupportedError)
from zerospeed.checkpoint.deepspeed.model_parallel import parse_model_parallel
from zerospeed.checkpoint.deepspeed.names import (_DS_FILE, _LAYER_FILE_RE, _MODEL_FILE_RE, MODEL_FILE,  # noqa: F401
                                                  OPTIM_FILE, ZERO3_MODEL_FILE, _need)
from zerospeed.checkpoint.deepspeed.remap import rebuild, skeleton
from zerospeed.checkpoint.deepspeed.safe_load import load_pickle
from zerospeed.checkpoint.deepspeed.source import DeepSpeedSource
from zerospeed.checkpoint.deepspeed.universal import UNIVERSAL_DIR, parse_universal
from zerospeed.checkpoint.deepspeed.values import _flat_module, _loss_scaler, _moment_keys, _numel, _step_scalar
from zerospeed.checkpoint.index import FORMAT, FORMAT_VERSION, CheckpointIndex
from zerospeed.checkpoint.jsonstate import encode
from zerospeed.checkpoint.tensor_io import dtype_name

#: the model-states entry (DeepSpeed's OPTIMIZER constant) holding a ZeRO-0 optimizer's state_dict; the same name
#: is the optimizer entry of zerospeed's index
OPTIMIZER = "optimizer"
#: top-level keys of mp_rank_XX_model_states.pt that are DeepSpeed's own (the rest is the user's client state)
DEEPSPEED_STATES = ("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler",
                    "random_ltd")


def is_deepspeed_folder(directory: str) -> bool:
    """True when ``directory`` holds files named as DeepSpeed's ``save_checkpoint`` names them."""
    try:
        names = os.listdir(directory)
    except OSError:
        return False
    return any(_DS_FILE.match(n) for n in names)


@dataclass
class _Shard:
    """One 1-D source tensor per kind, made on demand from a DeepSpeed file."""

    file: str
    prefix: str
    kinds: dict[str, Callable[[], torch.Tensor]]


@dataclass
class _Builder:
    directory: str
    shards: list[_Shard] = field(default_factory=list)
    params: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add_shard(self, file: str, prefix: str, kinds: dict[str, Callable[[], torch.Tensor]]) -> int:
        self.shards.append(_Shard(file, prefix, kinds))
        return len(self.shards) - 1

    #: a tensor-parallel folder's rank being read: name -> (full shape, ``(local_start, full_start, numel)`` runs of
    #: the elements this rank contributes); pieces are then recorded in full coordinates (model_parallel.py)
    to_full: dict[str, tuple[list[int], list[tuple[int, int, int]]]] | None = None
    #: parameters another pipeline stage provides (a tied layer's copy on a later stage): not added again
    skip: set[str] = field(default_factory=set)

    def add_param(self, name: str, shape: Iterable[int], dtype: torch.dtype, kind: str,
                  group: int | None = None) -> None:
        """``group``: the optimizer group (parameters are added in the group's own order)."""
        if name in self.skip:
            return
        if self.to_full is not None and name in self.to_full:
            if name in self.params:
                return  # another tensor-parallel rank's slice of it
            shape = self.to_full[name][0]
        elif name in self.params:
            raise DeepSpeedLayoutError(f"{self.directory}: parameter {name!r} appears twice in the folder's layout")
        self.params[name] = {"shape": [int(d) for d in shape], "dtype": dtype_name(dtype), "kind": kind, "pieces": [],
                             "group": group, "order": len(self.params)}

    def add_piece(self, name: str, shard: int, key_offset: int, param_start: int, numel: int) -> None:
        if numel <= 0 or name in self.skip:
            return
        pieces = self.params[name]["pieces"]
        if self.to_full is None or name not in self.to_full:
            pieces.append([shard, key_offset, param_start, numel])
            return
        for local, full, n in self.to_full[name][1]:  # local [param_start, +numel) in full coordinates
            a, b = max(local, param_start), min(local + n, param_start + numel)
            if b > a:
                pieces.append([shard, key_offset + a - param_start, full + a - local, b - a])


class _Files:
    """DeepSpeed's files of one folder, each unpickled (memory-mapped) once, on first use; a file forgotten
    (its mapping dropped) is mapped again from its skeleton (:mod:`.remap`), not unpickled again."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._loaded: dict[str, Any] = {}
        self._skeletons: dict[str, Any] = {}
        self._lock = threading.Lock()

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def exists(self, name: str) -> bool:
        return os.path.isfile(self.path(name))

    def require(self, name: str, why: str) -> None:
        if not self.exists(name):
            raise DeepSpeedFileMissingError(f"{self.path(name)} is missing: {why}")

    def get(self, name: str, kind: type | None = dict) -> Any:
        with self._lock:
            if name not in self._loaded and name in self._skeletons:
                stamp, skel = self._skeletons.pop(name)
                if stamp == _stamp(self.path(name)):  # else the file changed since: unpickled again below
                    self._loaded[name] = rebuild(self.path(name), skel)
                    self._skeletons[name] = (stamp, skel)
            if name not in self._loaded:
                obj = load_pickle(self.path(name))
                if kind is not None and not isinstance(obj, kind):
                    raise DeepSpeedLayoutError(f"{self.path(name)}: holds a {type(obj).__name__}, not the dict "
                                               "DeepSpeed saves")
                self._loaded[name] = obj
            return self._loaded[name]

    def forget(self, name: str) -> None:
        with self._lock:
            obj = self._loaded.pop(name, None)
            if obj is not None and name not in self._skeletons:
                stamp = _stamp(self.path(name))
                skel = skeleton(self.path(name), obj)
                if skel is not None:
                    self._skeletons[name] = (stamp, skel)

    def close(self) -> None:
        self._loaded.clear()
        self._skeletons.clear()


def _stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


class DeepSpeedFolder:
    """The parsed layout of one DeepSpeed tag folder: a zerospeed index dict plus its tensor shards."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.files = _Files(directory)
        self._b = _Builder(directory)
        self.meta: dict[str, Any] = {}
        self.model_file = ""
        self.stage = 0
        self.param_groups: list[dict[str, Any]] = []
        self.scalars: dict[str, dict[str, Any]] = {}
        self.state_keys: set[str] = set()
        self.loss_scaler: dict[str, Any] | None = None
        self.zero_optimizer = False
        self.mp = 0
        self._aliases: dict[str, str] = {}
        self._parse()

    # -- parsing ---------------------------------------------------------------------------------
    def _parse(self) -> None:
        names = set(os.listdir(self.directory))
        mp_ranks = sorted({int(m.group(1)) for m in map(_MODEL_FILE_RE.match, names) if m})
        if any(_LAYER_FILE_RE.match(n) for n in names) or mp_ranks[1:]:
            parse_model_parallel(self, names, mp_ranks)  # pipeline stages / tensor-parallel ranks (issue #26)
            return
        module = self._parse_rank(names, 0)
        self._extras(module)
        self._aliases = {str(k): str(v) for k, v in (self.meta.get("shared_params") or {}).items()}

    def _parse_rank(self, names: set[str], mp: int, module: dict[str, Any] | None = None) -> dict[str, Any]:
        """The files of model-parallel rank ``mp`` (``module``: its weights when not in its model file, as for
        pipeline stages); returns the module dict read."""
        self.mp = mp
        if MODEL_FILE.format(mp=mp) in names:
            self.model_file = MODEL_FILE.format(mp=mp)
        elif ZERO3_MODEL_FILE.format(rank=0, mp=mp) in names:
            self.model_file = ZERO3_MODEL_FILE.format(rank=0, mp=mp)
        else:
            raise DeepSpeedFileMissingError(f"{os.path.join(self.directory, MODEL_FILE.format(mp=mp))} is missing: a "
                                            f"DeepSpeed folder holds mp_rank_{mp:02d}_model_states.pt (or, for ZeRO "
                                            f"3, zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt)")
        where = self.files.path(self.model_file)
        self.meta = self.files.get(self.model_file)
        if module is None:
            module = _need(self.meta, "module", where, dict)
        self.dp_world_size = int(_need(self.meta, "dp_world_size", where, int))
        if self.dp_world_size < 1:
            raise DeepSpeedLayoutError(f"{where}: dp_world_size is {self.dp_world_size}")
        # the stage from the files themselves (the config recorded in them is the user's, not read here)
        self.stage = 3 if self.model_file.startswith("zero_pp_rank_") else 0
        optim_prefix = next((p for p in ("", "bf16_") if OPTIM_FILE.format(prefix=p, rank=0, mp=mp) in names), None)
        self.buffer_names = [str(n) for n in (self.meta.get("buffer_names") or [])]
        # the 16-bit training dtype, where there was one (ZeRO 3 saves only fp32 partitions: its weights are the
        # masters rounded to it)
        dtypes = {t.dtype for n, t in module.items() if torch.is_tensor(t) and n not in self.buffer_names}
        self.weight_dtype = torch.bfloat16 if optim_prefix == "bf16_" or torch.bfloat16 in dtypes else \
            torch.float16 if torch.float16 in dtypes else torch.float32
        if os.path.isdir(os.path.join(self.directory, UNIVERSAL_DIR)):
            parse_universal(self)
        elif self.stage == 3:
            self._zero3(optim_prefix)
        elif optim_prefix is not None:
            self._zero12(optim_prefix, module)
        elif isinstance(self.meta.get(OPTIMIZER), dict) and "fp32_groups_flat" in self.meta[OPTIMIZER]:
            self._fp16_optimizer(module)
        else:
            self._plain(module)
        return module

    def _optim_files(self, prefix: str) -> list[str]:
        files = [OPTIM_FILE.format(prefix=prefix, rank=r, mp=self.mp) for r in range(self.dp_world_size)]
        for r, f in enumerate(files):
            self.files.require(f, f"the folder was saved at data-parallel size {self.dp_world_size} "
                               f"({self.model_file} says so) and rank {r}'s optimizer shard is not there")
        extra = OPTIM_FILE.format(prefix=prefix, rank=self.dp_world_size, mp=self.mp)
        if self.files.exists(extra):
            raise DeepSpeedLayoutError(f"{self.files.path(extra)}: a rank file beyond dp_world_size "
                                       f"{self.dp_world_size} recorded in {self.model_file}: files of two saves mixed")
        return files

    def _osd(self, fname: str) -> dict[str, Any]:
        return _need(self.files.get(fname), "optimizer_state_dict", self.files.path(fname), dict)

    def _set_groups(self, groups: list[Any], where: str) -> None:
        self.param_groups = []
        for g in groups:
            if not isinstance(g, dict):
                raise DeepSpeedLayoutError(f"{where}: an optimizer param group is a {type(g).__name__}")
            self.param_groups.append({k: v for k, v in g.items() if k not in ("params", "step")})

    def _zero12(self, prefix: str, module: dict[str, Any]) -> None:
        self.zero_optimizer = True
        where_model = self.files.path(self.model_file)
        shapes = _need(self.meta, "param_shapes", where_model, list)
        files = self._optim_files(prefix)
        first = self._osd(files[0])
        where0 = self.files.path(files[0])
        self.loss_scaler = _loss_scaler(first.get("loss_scaler"))
        base = _need(first, "base_optimizer_state", where0, dict)
        self._set_groups(_need(base, "param_groups", where0, list), where0)
        fp32 = _need(first, "single_partition_of_fp32_groups", where0, list)
        if len(fp32) != len(shapes):
            raise DeepSpeedLayoutError(f"{where0}: {len(fp32)} fp32 groups, but {where_model} lists "
                                       f"{len(shapes)} groups in param_shapes")
        for pads in first.get("param_alignment_paddings") or []:
            if any(int(p) for p in pads):
                raise DeepSpeedUnsupportedError(f"{where0}: parameters padded inside a ZeRO partition "
                                                "(param_alignment_paddings); not read yet")
        for g, group_shapes in enumerate(shapes):
            names = [str(n) for n in group_shapes]
            for n in names:
                self._b.add_param(n, group_shapes[n], torch.float32, "param", g)
            lengths = []
            for r, f in enumerate(files):
                parts = _need(self._osd(f), "single_partition_of_fp32_groups", self.files.path(f), list)
                if len(parts) != len(shapes) or not torch.is_tensor(parts[g]) or parts[g].dim() != 1:
                    raise DeepSpeedLayoutError(f"{self.files.path(f)}: single_partition_of_fp32_groups[{g}] is not "
                                               "a 1-D tensor per group")
                lengths.append(parts[g].numel())
            total = sum(_numel(group_shapes[n]) for n in names)
            part = lengths[0]
            if sum(lengths) != total or any(n > part for n in lengths):
                raise DeepSpeedLayoutError(f"{self.directory}: the fp32 partitions of group {g} hold {sum(lengths)} "
                                           f"elements (per rank {lengths}) but its parameters in param_shapes of "
                                           f"{self.model_file} have {total}")
            for r, f in enumerate(files):
                self._zero12_shard(g, r, f, names, group_shapes, module, r * part, lengths[r])

    def _zero12_shard(self, g: int, r: int, fname: str, names: list[str], shapes: dict[str, Any],
                      module: dict[str, Any], lo: int, length: int) -> None:
        where = self.files.path(fname)
        osd = self._osd(fname)
        state = (_need(osd, "base_optimizer_state", where, dict).get("state") or {}).get(g) or {}
        keys = _moment_keys(state)
        self.state_keys.update(keys)
        if g not in self.scalars and state:
            self.scalars[g] = _step_scalar(state)
        for k in keys:
            if state[k].numel() < length:
                raise DeepSpeedLayoutError(f"{where}: optimizer state {k!r} of group {g} has {state[k].numel()} "
                                           f"elements, the fp32 partition {length}")
        model_where = self.files.path(self.model_file)
        kinds: dict[str, Callable[[], torch.Tensor]] = {
            "master": lambda: self._osd(fname)["single_partition_of_fp32_groups"][g].reshape(-1),
            "weight": lambda: _flat_module(module, names, model_where).narrow(0, lo, length),
        }
        for k in keys:
            kinds[f"optim.{k}"] = lambda k=k: self._osd(fname)["base_optimizer_state"]["state"][g][k] \
                .reshape(-1).narrow(0, 0, length)
        shard = self._b.add_shard(fname, f"g{g}", kinds)
        offset = 0
        for n in names:
            numel = _numel(shapes[n])
            start, end = max(offset, lo), min(offset + numel, lo + length)
            if end > start:
                self._b.add_piece(n, shard, start - lo, start - offset, end - start)
            offset += numel
        for n in names:
            self.scalar_group[n] = g

    def _zero3(self, prefix: str | None) -> None:
        self.zero_optimizer = True
        where_model = self.files.path(self.model_file)
        if prefix is None:
            raise DeepSpeedFileMissingError(f"{self.files.path(OPTIM_FILE.format(prefix='', rank=0, mp=self.mp))} is "
                                            "missing: a ZeRO-3 folder holds one optimizer shard per rank")
        shapes = _need(self.meta, "param_shapes", where_model, list)
        if self.meta.get("frozen_param_shapes"):
            raise DeepSpeedUnsupportedError(f"{where_model}: frozen parameters of a ZeRO-3 folder (frozen_param_"
                                            "fragments) are not read yet")
        files = self._optim_files(prefix)
        for r in range(self.dp_world_size):
            self.files.require(ZERO3_MODEL_FILE.format(rank=r, mp=self.mp), "a ZeRO-3 folder saved at data-parallel "
                               f"size {self.dp_world_size} holds every rank's model states")
        first = self._osd(files[0])
        where0 = self.files.path(files[0])
        self.loss_scaler = _loss_scaler(first.get("loss_scaler"))
        inner = _need(first, "optimizer_state_dict", where0, dict)
        self._set_groups(_need(inner, "param_groups", where0, list)[:len(shapes)], where0)
        ordered = [(str(n), s) for group in shapes for n, s in group.items()]
        group_of = {str(n): g for g, group in enumerate(shapes) for n in group}
        world = self.dp_world_size
        per_rank = sum(math.ceil(_numel(s) / world) for _, s in ordered)
        for n, s in ordered:
            self._b.add_param(n, s, torch.float32, "param", group_of[n])
        # Every rank's file holds the same layout (ceil(numel / world) elements of each parameter, the same
        # optimizer state keys), so only rank 0's is read here; the others are unpickled when a copy needs them
        # (a reader of 2 of 4 source ranks never opens the other two) and checked then (``flat``).
        state = _need(first, "optimizer_state_dict", where0, dict).get("state") or {}
        sub_groups = sorted(state)
        keys = _moment_keys(state[sub_groups[0]]) if sub_groups else []
        self.state_keys.update(keys)
        if sub_groups:
            self.scalars[0] = _step_scalar(state[sub_groups[0]])
        checked: set[str] = set()
        for r, f in enumerate(files):

            def flat(kind: str, f: str = f) -> torch.Tensor:
                o = self._osd(f)
                if f not in checked:
                    self._check_zero3_file(f, o, per_rank, keys)
                    checked.add(f)
                if kind == "master":
                    parts = o["fp32_flat_groups"]
                else:
                    st = o["optimizer_state_dict"]["state"]
                    parts = [st[i][kind] for i in sorted(st)]
                return torch.cat([p.reshape(-1) for p in parts]) if len(parts) > 1 else parts[0].reshape(-1)

            kinds: dict[str, Callable[[], torch.Tensor]] = {
                "master": lambda flat=flat: flat("master"),
                "weight": lambda flat=flat: flat("master").to(self.weight_dtype)}
            for k in keys:
                kinds[f"optim.{k}"] = lambda k=k, flat=flat: flat(k)
            shard = self._b.add_shard(f, "flat", kinds)
            offset = 0
            for n, s in ordered:
                numel = _numel(s)
                part = math.ceil(numel / world)
                start = r * part
                self._b.add_piece(n, shard, offset, start, max(0, min(part, numel - start)))
                offset += part
                self.scalar_group[n] = 0

    def _check_zero3_file(self, f: str, osd: dict[str, Any], per_rank: int, keys: list[str]) -> None:
        where = self.files.path(f)
        flats = _need(osd, "fp32_flat_groups", where, list)
        have = sum(t.numel() for t in flats if torch.is_tensor(t))
        if have < per_rank:
            raise DeepSpeedLayoutError(f"{where}: fp32_flat_groups hold {have} elements, the parameters in "
                                       f"param_shapes need {per_rank} per rank at data-parallel size "
                                       f"{self.dp_world_size}")
        state = _need(osd, "optimizer_state_dict", where, dict).get("state") or {}
        for i in sorted(state):
            missing = [k for k in keys if k not in state[i]]
            if missing:
                raise DeepSpeedLayoutError(f"{where}: optimizer state of sub-group {i} lacks {missing}, which rank 0's "
                                           "file holds: files of two saves mixed")

    def _fp16_optimizer(self, module: dict[str, Any]) -> None:
        where = self.files.path(self.model_file)
        opt = self.meta[OPTIMIZER]
        flats = _need(opt, "fp32_groups_flat", where, list)
        if len(flats) != 1:
            raise DeepSpeedUnsupportedError(f"{where}: {len(flats)} fp32 groups of DeepSpeed's fp16 optimizer at ZeRO "
                                            "0: the parameters of each group are not recorded; only one group is read")
        names = self._param_names(module)
        total = sum(module[n].numel() for n in names)
        if flats[0].numel() != total:
            raise DeepSpeedLayoutError(f"{where}: fp32_groups_flat[0] has {flats[0].numel()} elements, the module's "
                                       f"trainable parameters {total}")
        inner = _need(opt, "optimizer_state_dict", where, dict)
        self._set_groups(_need(inner, "param_groups", where, list), where)
        state = (inner.get("state") or {}).get(0) or {}
        keys = _moment_keys(state)
        self.state_keys.update(keys)
        self.scalars[0] = _step_scalar(state) if state else {}
        self.loss_scaler = _loss_scaler(opt)
        kinds: dict[str, Callable[[], torch.Tensor]] = {
            "master": lambda: self.meta[OPTIMIZER]["fp32_groups_flat"][0].reshape(-1),
            "weight": lambda: _flat_module(module, names, where)}
        for k in keys:
            kinds[f"optim.{k}"] = lambda k=k: self.meta[OPTIMIZER]["optimizer_state_dict"]["state"][0][k].reshape(-1)
        shard = self._b.add_shard(self.model_file, "g0", kinds)
        offset = 0
        for n in names:
            t = module[n]
            self._b.add_param(n, t.shape, t.dtype, "param", 0)
            self._b.add_piece(n, shard, offset, 0, t.numel())
            self.scalar_group[n] = 0
            offset += t.numel()

    def _param_names(self, module: dict[str, Any]) -> list[str]:
        buffers = set(self.buffer_names)
        return [str(n) for n, t in module.items() if n not in buffers and torch.is_tensor(t)]

    def _plain(self, module: dict[str, Any]) -> None:
        """ZeRO 0 in fp32: module weights plus a torch optimizer state_dict keyed by parameter index."""
        where = self.files.path(self.model_file)
        names = self._param_names(module)
        opt = self.meta.get(OPTIMIZER)
        state: dict[Any, Any] = {}
        index_of: dict[str, tuple[int, int]] = {}
        if isinstance(opt, dict):
            groups = _need(opt, "param_groups", where, list)
            self._set_groups(groups, where)
            order = [(gi, int(i)) for gi, g in enumerate(groups) for i in g.get("params", [])]
            if len(order) != len(names):
                raise DeepSpeedLayoutError(f"{where}: the optimizer holds {len(order)} parameters, 'module' "
                                           f"{len(names)} trainable ones; the folder does not match itself")
            index_of = {n: o for n, o in zip(names, order)}
            state = opt.get("state") or {}
            # DeepSpeed's FusedAdam steps a whole group with the step count of its *last* parameter's state
            # (the others keep the count they were created with): that count is the group's step.
            for gi, g in enumerate(groups):
                last = next((state[int(i)] for i in reversed(g.get("params", [])) if int(i) in state), None)
                if last:
                    self.scalars[("g", gi)] = _step_scalar(last)
        for n in names:
            t = module[n]
            gi, i = index_of.get(n, (0, -1))
            self._b.add_param(n, t.shape, t.dtype, "param", gi)
            kinds: dict[str, Callable[[], torch.Tensor]] = {"weight": lambda n=n: module[n].reshape(-1)}
            kinds["master"] = kinds["weight"]
            st = state.get(i) or {}
            for k in _moment_keys(st):
                kinds[f"optim.{k}"] = lambda k=k, st=st: st[k].reshape(-1)
                self.state_keys.add(k)
            if st:
                self.scalar_group[n] = ("g", gi)
            shard = self._b.add_shard(self.model_file, f"p.{n}", kinds)
            self._b.add_piece(n, shard, 0, 0, t.numel())

    def _extras(self, module: dict[str, Any]) -> None:
        """Buffers (and, below ZeRO 3, frozen parameters): whole tensors of ``module``, kind ``weight``."""
        for n, t in module.items():
            n = str(n)
            if n in self._b.params or not torch.is_tensor(t):
                continue
            if n in (self.meta.get("shared_params") or {}):
                continue  # a tied name: an alias of the parameter that holds the data
            if self.stage == 3 and n not in self.buffer_names:
                continue  # ZeRO-3's module entries of parameters are empty placeholders
            self._b.add_param(n, t.shape, t.dtype, "buffer" if n in self.buffer_names else "frozen")
            shard = self._b.add_shard(self.model_file, f"x.{n}", {"weight": lambda t=t: t.reshape(-1)})
            self._b.add_piece(n, shard, 0, 0, t.numel())

    # -- the index ---------------------------------------------------------------------------------
    @property
    def scalar_group(self) -> dict[str, Any]:
        if not hasattr(self, "_scalar_group"):
            self._scalar_group: dict[str, Any] = {}
        return self._scalar_group

    def index(self) -> CheckpointIndex:
        shards = [{"file": s.file, "prefix": s.prefix, "kinds": sorted(s.kinds)} for s in self._b.shards]
        for p in self._b.params.values():
            p["pieces"].sort(key=lambda x: x[2])
        files = {}
        for s in self._b.shards:
            files.setdefault(s.file, {"bytes": os.path.getsize(self.files.path(s.file)), "crc32": {}})
        files.setdefault(self.model_file, {"bytes": os.path.getsize(self.files.path(self.model_file)), "crc32": {}})
        scalars = {n: self.scalars[g] for n, g in self.scalar_group.items() if g in self.scalars}
        optimizer = None
        if self.param_groups or self.state_keys:
            optimizer = {"class": "DeepSpeed",
                         "param_groups": [{k: encode(v, f"param_groups[{i}][{k!r}]", None) for k, v in g.items()}
                                          for i, g in enumerate(self.param_groups)] or None,
                         "state_keys": sorted(self.state_keys), "scalars": scalars}
        lr = self.meta.get("lr_scheduler")
        data = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "files": files, "shards": shards,
            "params": self._b.params, "aliases": self._aliases, "rng": [], "world_size": self.dp_world_size,
            "engine": {"global_steps": int(self.meta.get("global_steps", 0)),
                       "global_samples": int(self.meta.get("global_samples", 0)),
                       "skipped_steps": int(self.meta.get("skipped_steps", 0))},
            OPTIMIZER: optimizer,
            "lr_scheduler": None if lr is None else encode(lr, "lr_scheduler", None),
            "loss_scaler": None if self.loss_scaler is None else encode(self.loss_scaler, "loss_scaler", None),
            "client_state": None,
            "source": "deepspeed",
        }
        return CheckpointIndex(self.directory, data)

    def client_state(self, load_optimizer_states: bool, load_lr_scheduler_states: bool,
                     load_module_only: bool) -> dict[str, Any]:
        """What DeepSpeed's ``load_checkpoint`` returns as client state for the same options."""
        if load_module_only:
            skip = {"module"}
        else:
            skip = set(DEEPSPEED_STATES)
        if load_lr_scheduler_states:
            skip.add("lr_scheduler")
        if load_optimizer_states:
            skip.add(OPTIMIZER)
        out = {k: v for k, v in self.meta.items() if k not in skip}
        if not load_module_only and load_optimizer_states and not self.zero_optimizer \
                and self.meta.get(OPTIMIZER) is not None:
            out[OPTIMIZER] = self.meta[OPTIMIZER]
        return out


def open_folder(directory: str) -> tuple[CheckpointIndex, DeepSpeedSource, DeepSpeedFolder]:
    folder = DeepSpeedFolder(directory)
    index = folder.index()
    index.path = folder.files.path(folder.model_file)  # the file errors about the model's names point at
    _check_pieces(folder, index)
    return index, DeepSpeedSource(folder, index), folder


def _check_pieces(folder: DeepSpeedFolder, index: CheckpointIndex) -> None:
    """Every parameter's pieces tile it exactly once (a layout this module misread fails here, not in a copy)."""
    for name, p in index.params.items():
        covered = 0
        for _, _, start, numel in sorted(p["pieces"], key=lambda x: x[2]):
            if start != covered:
                break
            covered += numel
        if covered != index.numel(name):
            raise DeepSpeedLayoutError(f"{folder.directory}: the files cover {covered} of the {index.numel(name)} "
                                       f"elements of {name!r}: a rank's shard is short or the folder is inconsistent")
