"""AutoTP's parser: decide, for every linear layer of a model, how it is split over tp ranks.

Precedence (first that speaks for a layer wins):

1. ``tensor_parallel.partition_config.layer_specs`` (regex, ``row`` | ``column`` | ``skip``,
   ``shape`` for fused sub-projections, ``partition_dim``). Each regex must match some layer,
   else a :class:`~zerospeed.config.ConfigError` names its key. With ``use_default_specs: false``
   nothing below applies.
2. ``tensor_parallel.preset_model`` (:mod:`zerospeed.module_inject.presets`).
3. ``injection_policy={BlockClass: ("o_proj", "down_proj")}`` (DeepSpeed inference's form): in
   blocks of that class the named layers are row-parallel and every other linear column-parallel.
4. A HuggingFace ``tp_plan`` (``config.base_model_tp_plan``, the class's and the instance's
   ``_tp_plan``): ``colwise*`` -> column, ``rowwise*`` -> row.
5. The heuristic: the transformer blocks are the children of ``nn.ModuleList``s holding linear
   layers. Within a block, layers are grouped by the block's direct child they sit in (attention,
   MLP). In a group, the usual row names (o_proj, out_proj, down_proj, c_proj, dense_4h_to_h,
   fc2, w2, wo, attention.dense) are row-parallel and the rest column-parallel; a group with no
   such name uses structure instead: its last linear writes into the residual stream, so it is
   row-parallel and the others column-parallel. A group with a single linear stays replicated.

``lm_head`` / ``embed_out`` (``lm_head_patterns``) outside the blocks becomes the vocabulary-parallel
LM head. Modules named only ``gate`` / ``router`` (MoE routers) stay replicated. A module whose class
sets ``tp_managed = True`` decides its own tensor parallelism (zerospeed's MoE layer: its router
replicated, its experts replicated or split by the layer itself): no layer inside it is planned, and
a model whose only candidates sit in such modules is not an error (it has nothing else to split).

The parser only decides; it does not touch the model (see :mod:`zerospeed.module_inject.auto_tp`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from torch import nn

from zerospeed.config import ConfigError
from zerospeed.config.tensor_parallel import TensorParallelConfig
from zerospeed.module_inject.presets import PRESETS

__all__ = ["LayerPlan", "is_linear", "plan_model"]

ROW_TAILS = ("o_proj", "out_proj", "down_proj", "c_proj", "dense_4h_to_h", "fc2", "w2", "wo",
             "attention.dense", "self_attention.dense", "attn.dense", "output.dense")
SKIP_NAMES = ("gate", "router")
FUSED_BY_NAME: dict[str, Any] = {"c_attn": 3, "gate_up_proj": 2, "qkv_proj": "qkv", "Wqkv": "qkv", "w13": 2}


@dataclass(frozen=True)
class LayerPlan:
    """How one linear module is split. ``fused``: None, an int (equal parts), a tuple of sizes or "qkv"."""

    name: str
    kind: str  # "column" | "row" | "lm_head" | "skip"
    source: str
    fused: Any = None
    view_shape: tuple[Any, ...] | None = None
    partition_dim: int | None = None


def is_linear(module: nn.Module) -> bool:
    """``nn.Linear`` or HuggingFace's ``Conv1D`` (weight stored ``[in, out]``)."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and isinstance(getattr(module, "weight", None),
                                                                                       nn.Parameter)


def _matches(pattern: re.Pattern[str], name: str) -> bool:
    return bool(pattern.match(name) or pattern.match(name + ".weight"))


def _tail(name: str, tails: Iterable[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in tails)


def _spec_rules(tp: TensorParallelConfig, model_type: str | None) -> list[tuple[list[tuple[re.Pattern[str], str]],
                                                                               Any, str]]:
    rules = []
    if tp.partition_config is None:
        return rules
    for i, spec in enumerate(tp.partition_config.layer_specs):
        if spec.model_types and (model_type or "").lower() not in [m.lower() for m in spec.model_types]:
            continue
        compiled = [(re.compile(p), f"tensor_parallel.partition_config.layer_specs.{i}.patterns.{j}")
                    for j, p in enumerate(spec.patterns)]
        rules.append((compiled, spec, f"partition_config.layer_specs[{i}]"))
    return rules


def _plan_patterns(model: nn.Module) -> dict[str, str]:
    """A merged HuggingFace tp_plan: ``{glob over module names: style}``."""
    config = getattr(model, "config", None)
    merged: dict[str, str] = {}
    for plan in (getattr(config, "base_model_tp_plan", None), getattr(type(model), "_tp_plan", None),
                 vars(model).get("_tp_plan")):
        if isinstance(plan, dict):
            merged.update({str(k): str(v) for k, v in plan.items()})
    return merged


def _glob_regex(glob: str) -> re.Pattern[str]:
    body = re.escape(glob).replace(r"\*", r"[^.]+")
    return re.compile(rf"^(.*\.)?{body}$")


def _plan_kind(style: str) -> str | None:
    style = style.lower()
    if "colwise" in style:
        return "column"
    if "rowwise" in style:
        return "row"
    return None


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Children of ``nn.ModuleList``s that contain linear layers (outermost lists only)."""
    found: list[tuple[str, nn.Module]] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or any(name.startswith(p + ".") for p in inside):
            continue
        children = [(f"{name}.{n}" if name else n, c) for n, c in module.named_children()]
        with_linear = [(n, c) for n, c in children if any(is_linear(m) for m in c.modules()) and not is_linear(c)]
        if with_linear:
            found.extend(with_linear)
            inside.append(name)
    return found


def _heuristic(block_name: str, block: nn.Module) -> dict[str, str]:
    groups: dict[str, list[str]] = {}
    for rel, module in block.named_modules():
        if rel and is_linear(module) and rel.split(".")[-1] not in SKIP_NAMES:
            groups.setdefault(rel.split(".")[0] if "." in rel else "", []).append(rel)
    kinds: dict[str, str] = {}
    for members in groups.values():
        named_rows = [m for m in members if _tail(m, ROW_TAILS)]
        if named_rows:
            for m in members:
                kinds[m] = "row" if m in named_rows else "column"
        elif len(members) >= 2:
            for m in members:
                kinds[m] = "row" if m == members[-1] else "column"
    return {f"{block_name}.{rel}": kind for rel, kind in kinds.items()}


def _no_blocks_message(model: nn.Module, linears: list[str]) -> str:
    shown = ", ".join(linears[:6]) + (", ..." if len(linears) > 6 else "") if linears else "none"
    first = re.escape(linears[0]) if linears else "<first layer>"
    last = re.escape(linears[-1]) if len(linears) > 1 else "<second layer>"
    example = ('{"layer_specs": [{"patterns": ["^' + first + '$"], "partition_type": "column"}, {"patterns": ["^'
               + last + '$"], "partition_type": "row"}], "use_default_specs": false}')
    return (f"AutoTP found no transformer blocks to split in {type(model).__name__} (no nn.ModuleList of blocks with "
            f"Linear layers, no tp_plan; Linear layers found: {shown}); give tensor_parallel.partition_config, e.g. "
            f"{example}")


def plan_model(model: nn.Module, tp: TensorParallelConfig, injection_policy: dict[Any, Any] | None = None
               ) -> dict[str, LayerPlan]:
    """``{module name: LayerPlan}`` for every linear layer that will be replaced (skips omitted)."""
    managed = tuple(f"{name}." for name, m in model.named_modules() if name and getattr(type(m), "tp_managed", False))
    linears = [name for name, m in model.named_modules() if name and is_linear(m) and not name.startswith(managed)]
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    lm_patterns = tp.partition_config.lm_head_patterns if tp.partition_config else ["lm_head", "embed_out"]
    decided: dict[str, LayerPlan] = {}

    # 1. explicit layer specs
    used: set[str] = set()
    for compiled, spec, source in _spec_rules(tp, model_type):
        for name in linears:
            for pattern, key in compiled:
                if _matches(pattern, name):
                    used.add(key)
                    if name not in decided:
                        decided[name] = LayerPlan(name, spec.partition_type, source, fused=None,
                                                  view_shape=spec.shape, partition_dim=spec.partition_dim)
                    break
        for pattern, key in compiled:
            if key not in used:
                raise ConfigError(key, f"{pattern.pattern!r} matches no Linear layer of {type(model).__name__}")
    only_specs = tp.partition_config is not None and not tp.partition_config.use_default_specs
    rest = [n for n in linears if n not in decided]

    if not only_specs:
        # 2. preset
        if tp.preset_model:
            for regex, kind, fused in PRESETS[tp.preset_model]:
                pattern = re.compile(regex)
                for name in rest:
                    if name not in decided and _matches(pattern, name):
                        decided[name] = LayerPlan(name, kind, f"preset {tp.preset_model}", fused=fused)
        # 3. injection policy
        for block_cls, row_names in (injection_policy or {}).items():
            rows = (row_names,) if isinstance(row_names, str) else tuple(row_names)
            for bname, block in model.named_modules():
                if not (block is not model and (isinstance(block_cls, type) and isinstance(block, block_cls)
                                                or type(block).__name__ == block_cls)):
                    continue
                for rel, m in block.named_modules():
                    full = f"{bname}.{rel}"
                    if rel and is_linear(m) and full not in decided:
                        kind = "row" if _tail(rel, rows) else "column"
                        decided[full] = LayerPlan(full, kind, "injection_policy", fused=FUSED_BY_NAME.get(
                            rel.split(".")[-1]))
        # 4. HuggingFace tp_plan
        for glob, style in _plan_patterns(model).items():
            kind = _plan_kind(style)
            pattern = _glob_regex(glob)
            for name in linears:
                if name in decided or not pattern.match(name):
                    continue
                if kind is None:
                    continue
                is_head = _tail(name, lm_patterns) and "gather" in style.lower()
                fused = 2 if "packed" in style.lower() else FUSED_BY_NAME.get(name.split(".")[-1])
                decided[name] = LayerPlan(name, "lm_head" if is_head else kind, "tp_plan", fused=fused)
        # 5. the heuristic, inside the blocks
        blocks = _blocks(model)
        for bname, block in blocks:
            for name, kind in _heuristic(bname, block).items():
                if name not in decided:
                    decided[name] = LayerPlan(name, kind, "heuristic", fused=FUSED_BY_NAME.get(name.split(".")[-1]))
        # the LM head
        in_blocks = tuple(b + "." for b, _ in blocks)
        for name in linears:
            if name not in decided and not name.startswith(in_blocks) and _tail(name, lm_patterns) \
                    and tp.vocab_parallel_lm_head is not False and not is_conv1d(model.get_submodule(name)):
                decided[name] = LayerPlan(name, "lm_head", "lm_head")
    # a column-marked LM head must still gather its logits
    out = {}
    for name, plan in decided.items():
        if plan.kind == "column" and _tail(name, lm_patterns) and not is_conv1d(model.get_submodule(name)):
            plan = LayerPlan(name, "lm_head", plan.source)
        if plan.kind != "skip" and not name.startswith(managed):
            out[name] = plan
    if not any(p.kind in ("column", "row") for p in out.values()) and not managed:
        raise ValueError(_no_blocks_message(model, linears))
    return out
