"""Writing a checkpoint (either layout) as a folder DeepSpeed 0.19.8's ``load_checkpoint`` resumes from.

``write_deepspeed(src, dst, world_size, zero_stage, precision)`` lays the fp32 masters, the Adam
moments and step, the scheduler and the counters out as ``DeepSpeedEngine.save_checkpoint`` would
have at that data-parallel size and ZeRO stage (DeepSpeed cannot reshard optimizer state itself, so
the target size is chosen here):

* ZeRO 1/2: ``mp_rank_00_model_states.pt`` (module weights in the training dtype, ``param_shapes``,
  counters, scheduler) and one ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per rank: each
  optimizer group flattened in parameter order, padded to a multiple of ``2 * world_size`` (DeepSpeed's
  NCCL start alignment) and split evenly; the fp32 partition is saved without the last rank's padding,
  the moments with it (as DeepSpeed saves them); the base optimizer's param groups carry FusedAdam's keys.
* ZeRO 0 in fp32: the module and a torch optimizer ``state_dict`` (state by parameter index) in
  ``mp_rank_00_model_states.pt``; every parameter's step is the group's (FusedAdam reads the last one).

* ZeRO 3: per rank ``zero_pp_rank_R_mp_rank_00_model_states.pt`` (buffers, parameters as empty
  placeholders, ``param_shapes``) and ``..._optim_states.pt``: one sub-group per optimizer group, the
  concatenation of the rank's ``ceil(numel / world)`` elements of each parameter (zero-padded), its
  moments alike, and a static loss scaler record (ZeRO 3 requires one).

Only plain types are pickled (tensors, dicts, lists, ``torch.Size``) plus, at ZeRO 3, DeepSpeed's static
``LossScaler`` named by a pickler that writes the class name without importing DeepSpeed. At ZeRO 0-2
DeepSpeed keeps its own loss scaler when the files have none, so 16-bit runs with a dynamic loss scale
restart at the configured initial scale. Frozen parameters and fp16 targets are refused with a one-line
error. The folder is written under a temporary name in ``dst`` and renamed to the tag, then
``latest`` is replaced: an interrupted conversion leaves no partial tag.
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
from collections import OrderedDict
from typing import Any

import torch

from zerospeed.checkpoint.deepspeed.errors import DeepSpeedUnsupportedError
from zerospeed.checkpoint.deepspeed.layout import MODEL_FILE, OPTIM_FILE, OPTIMIZER, ZERO3_MODEL_FILE
from zerospeed.checkpoint.full_tensors import FullTensors
from zerospeed.checkpoint.jsonstate import decode
from zerospeed.checkpoint.publish import new_nonce, publish_dir, validate_tag, write_text_atomic

DEEPSPEED_VERSION = "0.19.8"
NCCL_START_ALIGNMENT_FACTOR = 2
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: FusedAdam's param-group keys (torch's Optimizer.load_state_dict replaces the groups with the saved ones)
FUSED_ADAM_DEFAULTS = {"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def _groups(ft: FullTensors) -> tuple[list[list[str]], list[str]]:
    """Trainable parameter names per optimizer group and the buffer names. Within a group: the source's order
    where it records one (a DeepSpeed folder's param_shapes), else state_dict order (DeepSpeed rebuilds its
    flat groups from the order of the user's param groups, which is module order unless built otherwise)."""
    groups: dict[int, list[str]] = {}
    buffers: list[str] = []
    seen: set[str] = set()
    for key in ft.keys:
        src = ft.index.canonical(key)
        if src != key or src in seen:
            continue
        seen.add(src)
        info = ft.index.params[src]
        kind = info.get("kind", "param")
        if kind == "buffer":
            buffers.append(key)
        elif kind == "frozen":
            raise DeepSpeedUnsupportedError(f"{ft.index.path}: frozen parameter {key!r}: writing frozen parameters in "
                                            "DeepSpeed's layout is not supported yet")
        else:
            groups.setdefault(int(info.get("group") or 0), []).append(key)
    order = {k: ft.index.params[k].get("order", i) for i, k in enumerate(ft.keys) if k in ft.index.params}
    return [sorted(groups[g], key=lambda k: order.get(k, 0)) for g in sorted(groups)], buffers


def _param_groups(ft: FullTensors, num_groups: int) -> list[dict[str, Any]]:
    saved = (ft.index.data.get(OPTIMIZER) or {}).get("param_groups") or []
    out = []
    for g in range(num_groups):
        values = {k: decode(v) for k, v in (saved[g] if g < len(saved) else {}).items()}
        group = dict(FUSED_ADAM_DEFAULTS)
        group.update({k: v for k, v in values.items() if k in FUSED_ADAM_DEFAULTS or k in ("amsgrad",)})
        group["betas"] = tuple(group["betas"])
        group["step"] = 0
        out.append(group)
    return out


def _step(ft: FullTensors, names: list[str]) -> int:
    for n in names:
        step = ft.optimizer_scalars(n).get("step")
        if step is not None:
            return int(step)
    return 0


def _model_states(ft: FullTensors, dtype: torch.dtype, world_size: int, stage: int, groups: list[list[str]],
                  buffers: list[str], client_state: dict[str, Any]) -> dict[str, Any]:
    module: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key in ft.keys:
        t = ft.tensor(key, None, kind="weight" if key in buffers else None)
        module[key] = t.to(dtype) if key not in buffers and t.is_floating_point() else t
    data = ft.index.data
    engine = data.get("engine") or {}
    lr = data.get("lr_scheduler")
    shapes = [OrderedDict((n, torch.Size(ft.shape(n))) for n in names) for names in groups] if stage > 0 else None
    state: dict[str, Any] = {
        "module": module, "buffer_names": list(buffers), OPTIMIZER: None, "param_shapes": shapes,
        "frozen_param_shapes": OrderedDict() if stage == 2 else None, "shared_params": dict(ft.index.data["aliases"])
        if stage > 0 else None, "frozen_param_fragments": OrderedDict() if stage == 2 else None,
        "lr_scheduler": None if lr is None else decode(lr), "data_sampler": None, "random_ltd": None,
        "skipped_steps": int(engine.get("skipped_steps", 0)), "global_steps": int(engine.get("global_steps", 0)),
        "global_samples": int(engine.get("global_samples", 0)), "dp_world_size": world_size, "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": {"zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == torch.bfloat16}},
        "ds_version": DEEPSPEED_VERSION,
    }
    state.update(client_state)
    return state


def _flat_range(ft: FullTensors, names: list[str], lo: int, hi: int, kind: str | None) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the group's parameters flattened in order (one parameter built at a time)."""
    out = torch.zeros(max(0, hi - lo), dtype=torch.float32)
    offset = 0
    for n in names:
        numel = ft.numel(n)
        start, end = max(offset, lo), min(offset + numel, hi)
        if end > start:
            t = ft.tensor(n, torch.float32, kind=kind).reshape(-1)
            out[start - lo:end - lo].copy_(t[start - offset:end - offset])
        offset += numel
    return out


def _zero12_rank(ft: FullTensors, groups: list[list[str]], param_groups: list[dict[str, Any]], rank: int,
                 world_size: int, stage: int, state_keys: list[str]) -> dict[str, Any]:
    fp32, paddings, states, align_pads = [], [], {}, []
    for g, names in enumerate(groups):
        total = sum(ft.numel(n) for n in names)
        align = NCCL_START_ALIGNMENT_FACTOR * world_size
        part = math.ceil(total / align) * align // world_size
        lo, hi = rank * part, min((rank + 1) * part, total)
        fp32.append(_flat_range(ft, names, lo, hi, None))
        paddings.append(part - max(0, hi - lo))
        align_pads.append([0] * len(names))
        st: dict[str, Any] = {"step": _step(ft, names)}
        for k in state_keys:
            padded = torch.zeros(part, dtype=torch.float32)
            if hi > lo:
                padded[:hi - lo] = _flat_range(ft, names, lo, hi, f"optim.{k}")
            st[k] = padded
        states[g] = st
    groups_out = [dict(pg, params=[g]) for g, pg in enumerate(param_groups)]
    # no loss_scaler / dynamic_loss_scale / clip_grad entries: DeepSpeed then keeps what its config set up
    osd = {"overflow": False, "base_optimizer_state": {"state": states, "param_groups": groups_out},
           "single_partition_of_fp32_groups": fp32, "zero_stage": stage, "group_paddings": paddings,
           "param_alignment_paddings": align_pads, "partition_count": [world_size] * len(groups),
           "ds_version": DEEPSPEED_VERSION}
    return {"optimizer_state_dict": osd, "ds_config": {"zero_optimization": {"stage": stage}},
            "ds_version": DEEPSPEED_VERSION}


def _zero0_optimizer(ft: FullTensors, groups: list[list[str]], param_groups: list[dict[str, Any]],
                     state_keys: list[str]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    out_groups = []
    i = 0
    for g, names in enumerate(groups):
        step = _step(ft, names)
        ids = []
        for n in names:
            st: dict[str, Any] = {"step": step}
            for k in state_keys:
                st[k] = ft.tensor(n, torch.float32, kind=f"optim.{k}").contiguous()
            state[i] = st
            ids.append(i)
            i += 1
        out_groups.append(dict(param_groups[g], params=ids))
    return {"state": state, "param_groups": out_groups}


class StaticLossScalerRecord:
    """Pickled as DeepSpeed's ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (static scale; what ZeRO 3 needs
    in its optimizer file): only its two attributes are written, and no DeepSpeed code is imported here."""

    _deepspeed_global = ("deepspeed.runtime.fp16.loss_scaler", "LossScaler")

    def __init__(self, cur_scale: float = 1.0) -> None:
        self.cur_scale = float(cur_scale)
        self.dynamic = False


class _Pickler(pickle._Pickler):  # the pure-Python pickler: its save_global can name a class it cannot import
    def save_global(self, obj: Any, name: str | None = None) -> None:
        target = getattr(obj, "_deepspeed_global", None) if isinstance(obj, type) else None
        if target is None:
            return super().save_global(obj, name)
        self.write(pickle.GLOBAL + target[0].encode() + b"\n" + target[1].encode() + b"\n")
        self.memoize(obj)


class _PickleModule:
    """What ``torch.save(pickle_module=...)`` needs: a ``Pickler`` that writes DeepSpeed's class names."""

    Pickler = _Pickler
    Unpickler = pickle.Unpickler
    load = staticmethod(pickle.load)
    dump = staticmethod(pickle.dump)


def _save(obj: Any, path: str) -> None:
    torch.save(obj, path, pickle_module=_PickleModule)


def _zero3_rank(ft: FullTensors, groups: list[list[str]], param_groups: list[dict[str, Any]], rank: int,
                world_size: int, state_keys: list[str]) -> dict[str, Any]:
    """Rank ``rank``'s ZeRO-3 optimizer file: per group (one sub-group each), the concatenation of this rank's
    ``ceil(numel / world)`` elements of every parameter (the last rank's part zero-padded)."""
    flats, states = [], {}
    for g, names in enumerate(groups):
        parts: dict[str, list[torch.Tensor]] = {"master": [], **{k: [] for k in state_keys}}
        for n in names:
            numel = ft.numel(n)
            size = math.ceil(numel / world_size)
            lo, hi = min(rank * size, numel), min((rank + 1) * size, numel)
            for kind in parts:
                piece = torch.zeros(size, dtype=torch.float32)
                if hi > lo:
                    full = ft.tensor(n, torch.float32, kind=None if kind == "master" else f"optim.{kind}")
                    piece[:hi - lo] = full.reshape(-1)[lo:hi]
                parts[kind].append(piece)
        flats.append(torch.cat(parts["master"]))
        states[g] = {"step": _step(ft, names), **{k: torch.cat(parts[k]) for k in state_keys}}
    osd = {"zero_stage": 3, "loss_scaler": StaticLossScalerRecord(), "dynamic_loss_scale": False, "overflow": False,
           "partition_count": world_size,
           "optimizer_state_dict": {"state": states, "param_groups": [dict(pg, params=[g])
                                                                      for g, pg in enumerate(param_groups)]},
           "fp32_flat_groups": flats}
    return {"optimizer_state_dict": osd, "ds_config": {"zero_optimization": {"stage": 3}},
            "ds_version": DEEPSPEED_VERSION}


def layout_of(ft: FullTensors) -> tuple[list[list[str]], list[str], list[dict[str, Any]], list[str]]:
    """Parameter names per optimizer group, buffer names, FusedAdam param groups and the optimizer state keys
    every parameter has, as the DeepSpeed files of ``ft`` are laid out."""
    groups, buffers = _groups(ft)
    param_groups = _param_groups(ft, len(groups))
    state_keys = [k for k in ft.state_keys() if all(ft.has(n, f"optim.{k}") for g in groups for n in g)]
    return groups, buffers, param_groups, state_keys


def write_deepspeed(src: str, dst: str, world_size: int | None = None, zero_stage: int | None = None,
                    precision: str | None = None, src_tag: str | None = None, tag: str | None = None) -> str:
    """Write checkpoint ``src`` (zerospeed or DeepSpeed layout) as DeepSpeed folder ``dst/<tag>``; return its path.

    ``world_size`` / ``zero_stage`` / ``precision`` default to the source's; ``tag`` to ``global_step<N>``."""
    with FullTensors(src, src_tag) as ft:
        data = ft.index.data
        world_size = int(world_size or data.get("world_size") or 1)
        stage = int(data.get("zero_stage", 0) if zero_stage is None else zero_stage)
        if world_size < 1:
            raise ValueError(f"world_size: {world_size} is not a positive number of ranks")
        if stage not in (0, 1, 2, 3):
            raise DeepSpeedUnsupportedError(f"zero_stage: {stage} is not a ZeRO stage (0, 1, 2, 3)")
        if precision is None:
            sample = next((k for k in ft.keys if ft.index.params[ft.index.canonical(k)].get("kind") == "param"), None)
            found = ft.tensor(sample, None, kind="weight").dtype if sample is not None and ft.has(sample, "weight") \
                else torch.float32
            precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(found, "fp32")
        if precision not in PRECISIONS:
            raise DeepSpeedUnsupportedError(f"precision: {precision!r}: writing DeepSpeed's layout supports "
                                            f"{', '.join(PRECISIONS)} (fp16's dynamic loss scale is not written yet)")
        if stage == 0 and precision != "fp32":
            raise DeepSpeedUnsupportedError("zero_stage 0 with bf16: DeepSpeed's BF16 optimizer layout is not written "
                                            "yet; use zero_stage 1 or 2")
        dtype = PRECISIONS[precision]
        groups, buffers, param_groups, state_keys = layout_of(ft)
        if tag is None:
            tag = f"global_step{int((data.get('engine') or {}).get('global_steps', 0))}"
        tag = validate_tag(tag)
        client = data.get("client_state") or {}
        if ft.deepspeed is not None:
            client_state = ft.deepspeed.client_state(True, True, False)
            for k in ("buffer_names", "param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments",
                      "ds_config", "ds_version", "global_samples", "checkpoint_parallel_dimensions", "lr_scheduler",
                      OPTIMIZER):
                client_state.pop(k, None)
        else:
            client_state = decode(client.get("json", {}), {k: ft.source.get(client["file"], k).clone()
                                                           for k in client.get("keys", [])})
        os.makedirs(dst, exist_ok=True)
        tmp = os.path.join(dst, f".tmp-{tag}-{new_nonce()}")
        os.makedirs(tmp)
        try:
            model = _model_states(ft, dtype, world_size, stage, groups, buffers, client_state)
            if stage == 0:
                model[OPTIMIZER] = _zero0_optimizer(ft, groups, param_groups, state_keys) if state_keys else None
            prefix = "bf16_" if precision == "bf16" else ""
            if stage == 3:  # every rank's model file: buffers whole, parameters as empty placeholders
                for n in (n for names in groups for n in names):
                    model["module"][n] = torch.empty(0, dtype=dtype)
                model["frozen_param_shapes"], model["frozen_param_fragments"] = OrderedDict(), OrderedDict()
                for rank in range(world_size):
                    _save(model, os.path.join(tmp, ZERO3_MODEL_FILE.format(rank=rank, mp=0)))
                    _save(_zero3_rank(ft, groups, param_groups, rank, world_size, state_keys),
                          os.path.join(tmp, OPTIM_FILE.format(prefix=prefix, rank=rank, mp=0)))
            else:
                _save(model, os.path.join(tmp, MODEL_FILE.format(mp=0)))
            del model
            for rank in range(world_size if stage in (1, 2) else 0):
                _save(_zero12_rank(ft, groups, param_groups, rank, world_size, stage, state_keys),
                      os.path.join(tmp, OPTIM_FILE.format(prefix=prefix, rank=rank, mp=0)))
            final = publish_dir(tmp, dst, tag, new_nonce())
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        write_text_atomic(os.path.join(dst, "latest"), tag)
        return final
