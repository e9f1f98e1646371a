"""DeepSpeed ``PipelineEngine`` folders seen by parameter name (the pipeline half of :mod:`.model_parallel`).

``PipelineEngine.save_checkpoint`` (DeepSpeed 0.19.8) writes every layer's ``state_dict`` into
``layer_XX-model_states.pt`` (keys relative to the layer; ``PipelineModule`` names the parameter
``XX.<key>``) and, per stage S (DeepSpeed's model-parallel rank), ``mp_rank_0S_model_states.pt`` with the
counters, scheduler and client state (``module`` None). Where the optimizer state of stage S lives depends
on how it trained:

* **ZeRO 1, or bf16** (``[bf16_]zero_pp_rank_R_mp_rank_0S_optim_states.pt``): a ZeRO optimizer over the
  stage's parameters, which ``param_shapes`` of the stage's model file names.
* **ZeRO 0** (fp32, or fp16's FP16_Optimizer): the stage's model file holds the optimizer's ``state_dict``
  under ``optimizer`` (state by parameter index in the stage's ``parameters()`` order) and no parameter
  names. Stages hold consecutive layers, so the layer files, in index order, are dealt to the stages by the
  number of parameters each stage's optimizer holds (each layer's parameters are its file's non-buffer
  entries, in ``state_dict`` order); the moments' shapes are checked against the parameters they land on.

**Tied layers** (``TiedLayerSpec``): DeepSpeed names their parameters ``tied_modules.<key>.<attr>``, every
stage using the key holds a copy (kept equal: their gradients are summed over those stages) with its own
optimizer state, and each use that runs the module's own ``forward`` is saved in that layer's file, keys
relative to the tied module (a use through ``forward_fn`` is not saved). A layer file whose entries are no
``XX.*`` parameter is matched to the tied key whose parameters it holds; the masters and moments are taken
from the first stage listing the key (the copies are equal). Tied layers are named only where a ZeRO
optimizer recorded ``param_shapes``: at ZeRO 0 they are refused.

**Pipeline x tensor parallel** (a topology with a ``model`` axis, Megatron-style layers): layer files
``layer_XX-model_0T-model_states.pt`` per tensor-parallel rank T, and model / optimizer files per
model-parallel rank M = stage * tp + T (DeepSpeed's model-parallel group spans the pipe and model axes, in
that order). Each rank's slices are named as above and mapped to full-tensor offsets by the client's
``universal_checkpoint_info`` patterns (:func:`~zerospeed.checkpoint.deepspeed.tp_maps.pattern_maps`).

Stages hold disjoint names otherwise, so the folder is their union: it loads into zerospeed's
``PipelineModule`` at any number of stages, or into an ordinary module with the same names, at any
data-parallel size and ZeRO stage.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.checkpoint.deepspeed.errors import DeepSpeedFileMissingError, DeepSpeedLayoutError, \
    DeepSpeedUnsupportedError
from zerospeed.checkpoint.deepspeed.tp_maps import pattern_maps

TIED_PREFIX = "tied_modules."
#: the model-states entry holding a ZeRO-0 optimizer's state_dict (DeepSpeed's OPTIMIZER constant)
OPTIMIZER = "optimizer"


def parse_pipeline(folder: Any, names: set[str], model_files: list[str], layers: dict[int, dict[int, str]],
                   tp_size: int = 1) -> None:
    """Fill ``folder`` (a :class:`~zerospeed.checkpoint.deepspeed.layout.DeepSpeedFolder`) from a pipeline
    folder whose files are ``names``: ``model_files[m]`` is model-parallel rank m's model file (m = stage *
    ``tp_size`` + tensor-parallel rank), ``layers`` the layer files by index and tensor-parallel rank."""
    metas = [folder.files.get(f) for f in model_files]
    buffers = {str(b) for meta in metas for b in (meta.get("buffer_names") or [])}
    shapes = [meta.get("param_shapes") for meta in metas]
    if all(isinstance(s, list) for s in shapes):
        stage_shapes = [{str(n): v for group in s for n, v in group.items()} for s in shapes]
        modules = []
        for t in range(tp_size):
            files = {idx: _layer_state(folder, per[t]) for idx, per in sorted(layers.items())}
            mine = list(range(t, len(metas), tp_size))  # the model-parallel ranks of tensor-parallel rank t
            modules.append(_named_layers(folder, files, {i: per[t] for i, per in layers.items()},
                                         [stage_shapes[m] for m in mine], buffers, [model_files[m] for m in mine]))
        rank_modules = [modules[m % tp_size] for m in range(len(metas))]
    elif all(s is None for s in shapes):
        if tp_size > 1:
            raise DeepSpeedUnsupportedError(f"{folder.directory}: a pipeline x tensor-parallel folder trained "
                                            "without a ZeRO optimizer (no param_shapes): not read")
        files = {idx: _layer_state(folder, per[0]) for idx, per in sorted(layers.items())}
        rank_modules = _zero0_stages(folder, files, {i: per[0] for i, per in layers.items()}, metas, model_files,
                                     buffers)
        stage_shapes = [{}] * len(metas)
    else:
        raise DeepSpeedLayoutError(f"{folder.directory}: some stages' model files record param_shapes (a ZeRO "
                                   "optimizer) and others do not: files of two saves mixed")
    found: set[str] = set()
    for m, module in enumerate(rank_modules):
        if m % tp_size == 0:
            # a tied parameter an earlier stage listed: its masters and moments are that stage's (equal copies)
            skip = {n for n in folder._b.params if n.startswith(TIED_PREFIX)}
        folder._b.skip = skip
        if tp_size > 1:
            folder._b.to_full = pattern_maps(folder.files.path(model_files[m]), metas[m], stage_shapes[m],
                                             m % tp_size, tp_size)
        try:
            folder._parse_rank(names, m, module)
        finally:
            folder._b.skip, folder._b.to_full = set(), None
        found.update(folder.buffer_names)
    folder.buffer_names = sorted(found | buffers)
    folder._extras(rank_modules[0])  # buffers: whole on every rank; tensor-parallel rank 0's


def _layer_state(folder: Any, fname: str) -> dict[str, torch.Tensor]:
    sd = folder.files.get(fname)
    for key, t in sd.items():
        if not torch.is_tensor(t):
            raise DeepSpeedLayoutError(f"{folder.files.path(fname)}: entry {key!r} is a {type(t).__name__}, not "
                                       "the tensor a layer's state_dict holds")
    return sd


def _named_layers(folder: Any, files: dict[int, dict[str, torch.Tensor]], layers: dict[int, str],
                  stage_shapes: list[dict[str, Any]], buffers: set[str],
                  model_files: list[str]) -> dict[str, torch.Tensor]:
    """Every layer file's tensors under the parameter names the stages' ``param_shapes`` list (one
    tensor-parallel rank's files and stages), shapes checked."""
    stage_names = [list(shapes) for shapes in stage_shapes]
    listed = {n for names in stage_names for n in names}
    tied: dict[str, set[str]] = {}
    for n in sorted(listed | buffers):
        if n.startswith(TIED_PREFIX) and "." in n[len(TIED_PREFIX):]:
            key, rest = n[len(TIED_PREFIX):].split(".", 1)
            tied.setdefault(key, set()).add(rest)
    module: dict[str, torch.Tensor] = {}
    for idx, sd in files.items():
        if not sd or any(f"{idx}.{k}" in listed or f"{idx}.{k}" in buffers for k in sd):
            module.update({f"{idx}.{k}": t for k, t in sd.items()})
            continue
        keys = [key for key, rests in tied.items() if rests == set(sd)]
        if len(keys) != 1:
            raise DeepSpeedLayoutError(f"{folder.files.path(layers[idx])}: entries {sorted(sd)} are no parameter "
                                       f"'{idx}.*' the stages list" + (", and match no tied layer" if not keys else
                                                                       f", and match tied layers {keys} alike"))
        for k, t in sd.items():
            module.setdefault(f"{TIED_PREFIX}{keys[0]}.{k}", t)  # the first use's file (the copies are equal)
    for s, names in enumerate(stage_names):
        for n in names:
            if n in module:
                if list(module[n].shape) != [int(d) for d in stage_shapes[s][n]]:
                    raise DeepSpeedLayoutError(f"{folder.directory}: {n!r} has shape {list(module[n].shape)} in its "
                                               f"layer file but {list(stage_shapes[s][n])} in {model_files[s]}'s "
                                               "param_shapes: files of two saves mixed")
                continue
            if n.startswith(TIED_PREFIX):
                raise DeepSpeedFileMissingError(f"{folder.directory}: no layer_*-model_states.pt file holds tied "
                                                f"parameter {n!r} (every use of its TiedLayerSpec ran through a "
                                                "forward_fn, which DeepSpeed does not save)")
            raise DeepSpeedFileMissingError(f"{folder.directory}: no layer_*-model_states.pt file holds {n!r}, a "
                                            f"parameter of pipeline stage {s} ({model_files[s]} lists it)")
    return module


def _zero0_stages(folder: Any, files: dict[int, dict[str, torch.Tensor]], layers: dict[int, str],
                  metas: list[dict[str, Any]], model_files: list[str],
                  buffers: set[str]) -> list[dict[str, torch.Tensor]]:
    """The layer files dealt to the stages in index order by the number of parameters each stage's optimizer
    holds (ZeRO 0: no parameter names recorded; DeepSpeed's FP16_Optimizer: by the elements of its flat group)."""
    counts: list[int] = []
    by_numel: list[bool] = []
    states: list[dict[int, Any]] = []
    for meta, fname in zip(metas, model_files):
        opt = meta.get(OPTIMIZER)
        where = folder.files.path(fname)
        if not isinstance(opt, dict):
            raise DeepSpeedUnsupportedError(f"{where}: a pipeline stage with neither a ZeRO optimizer's param_shapes "
                                            "nor an optimizer state_dict (saved without an optimizer): which layers "
                                            "it held is unknown")
        flats = opt.get("fp32_groups_flat")
        if flats is not None:  # DeepSpeed's FP16_Optimizer: flat groups over the stage's parameters
            if not isinstance(flats, list) or not all(torch.is_tensor(f) for f in flats):
                raise DeepSpeedLayoutError(f"{where}: optimizer.fp32_groups_flat is not a list of tensors")
            counts.append(sum(f.numel() for f in flats))
            by_numel.append(True)
            states.append({})
            continue
        groups = opt.get("param_groups")
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise DeepSpeedLayoutError(f"{where}: optimizer.param_groups is not the list a torch optimizer saves")
        order = [int(i) for g in groups for i in g.get("params", [])]
        counts.append(len(order))
        by_numel.append(False)
        st = opt.get("state") or {}
        states.append({pos: st.get(i) or {} for pos, i in enumerate(order)})
    out: list[dict[str, torch.Tensor]] = [{} for _ in metas]
    stage, held = 0, 0
    for idx, sd in files.items():
        params = [(k, t) for k, t in sd.items() if f"{idx}.{k}" not in buffers]
        while stage < len(metas) - 1 and held == counts[stage] and params:
            stage, held = stage + 1, 0
        for k, t in sd.items():
            out[stage][f"{idx}.{k}"] = t
        for k, t in params:
            st = states[stage].get(held) or {}
            bad = [m for m, v in st.items() if torch.is_tensor(v) and v.dim() > 0 and v.shape != t.shape]
            if bad:
                raise DeepSpeedLayoutError(f"{folder.files.path(layers[idx])}: {idx}.{k} has shape {list(t.shape)} "
                                           f"but the optimizer state of parameter {held} of stage {stage} "
                                           f"({folder.files.path(model_files[stage])}) has {bad[0]} of shape "
                                           f"{list(st[bad[0]].shape)}: the layer files do not match the stages")
            held += t.numel() if by_numel[stage] else 1
    got = [sum((t.numel() if by_numel[s] else 1) for n, t in m.items() if n not in buffers)
           for s, m in enumerate(out)]
    if counts != got:
        raise DeepSpeedUnsupportedError(f"{folder.directory}: the stages' optimizers hold {counts} parameters "
                                        "(elements for an fp16 optimizer) but the layer files, dealt to the stages "
                                        f"in order, give {got}: "
                                        "a layer file is missing, or the run had tied layers (TiedLayerSpec) or "
                                        "frozen parameters, which a ZeRO-0 pipeline folder does not name; not read")
    return out
