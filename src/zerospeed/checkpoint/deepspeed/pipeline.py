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

Stages hold disjoint names otherwise, so the folder is their union: it loads into zerospeed's
``PipelineModule`` at any number of stages, or into an ordinary module with the same names, at any
data-parallel size and ZeRO stage.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.checkpoint.deepspeed.errors import DeepSpeedFileMissingError, DeepSpeedLayoutError, \
    DeepSpeedUnsupportedError

TIED_PREFIX = "tied_modules."
#: the model-states entry holding a ZeRO-0 optimizer's state_dict (DeepSpeed's OPTIMIZER constant)
OPTIMIZER = "optimizer"


def parse_pipeline(folder: Any, names: set[str], model_files: list[str], layers: dict[int, str]) -> None:
    """Fill ``folder`` (a :class:`~zerospeed.checkpoint.deepspeed.layout.DeepSpeedFolder`) from a pipeline
    folder whose files are ``names``: ``model_files[s]`` is stage s's model file, ``layers`` the layer files
    by index."""
    files = {idx: _layer_state(folder, fname) for idx, fname in sorted(layers.items())}
    metas = [folder.files.get(f) for f in model_files]
    buffers = {str(b) for meta in metas for b in (meta.get("buffer_names") or [])}
    shapes = [meta.get("param_shapes") for meta in metas]
    if all(isinstance(s, list) for s in shapes):
        stage_names = [[str(n) for group in s for n in group] for s in shapes]
        module = _named_layers(folder, files, layers, stage_names, buffers, model_files)
        stage_modules = [module] * len(metas)
    elif all(s is None for s in shapes):
        stage_modules = _zero0_stages(folder, files, layers, metas, model_files, buffers)
        module = {k: v for m in stage_modules for k, v in m.items()}
    else:
        raise DeepSpeedLayoutError(f"{folder.directory}: some stages' model files record param_shapes (a ZeRO "
                                   "optimizer) and others do not: files of two saves mixed")
    found: set[str] = set()
    for s, stage_module in enumerate(stage_modules):
        # a tied parameter another stage listed first: its masters and moments are that stage's (equal copies)
        folder._b.skip = {n for n in folder._b.params if n.startswith(TIED_PREFIX)}
        try:
            folder._parse_rank(names, s, stage_module)
        finally:
            folder._b.skip = set()
        found.update(folder.buffer_names)
    folder.buffer_names = sorted(found | buffers)
    folder._extras(module)


def _layer_state(folder: Any, fname: str) -> dict[str, torch.Tensor]:
    sd = folder.files.get(fname)
    for key, t in sd.items():
        if not torch.is_tensor(t):
            raise DeepSpeedLayoutError(f"{folder.files.path(fname)}: entry {key!r} is a {type(t).__name__}, not "
                                       "the tensor a layer's state_dict holds")
    return sd


def _named_layers(folder: Any, files: dict[int, dict[str, torch.Tensor]], layers: dict[int, str],
                  stage_names: list[list[str]], buffers: set[str], model_files: list[str]) -> dict[str, torch.Tensor]:
    """Every layer file's tensors under the parameter names the stages' ``param_shapes`` list."""
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
