"""AutoTP: replace a model's linear layers, in place, with tensor-parallel ones.

``auto_tp(model, tp_group, partition_config=None, injection_policy=None)`` plans the split
(:func:`zerospeed.module_inject.policy.plan_model`), checks that it is exact, and swaps modules:
column layers become :class:`LinearLayer`, row layers :class:`LinearAllreduce`, the LM head
:class:`LmHeadLayer` (and its tied input embedding :class:`VocabParallelEmbedding`).

Decisions:

* Exact or an error: every sub-projection must divide by tp; inside attention every split must
  hold whole heads (whole KV heads for GQA's k/v), else a one-line error names the layer and the
  sizes. Only the vocabulary is padded to a multiple of tp.
* Attention modules keep their own forward: head-count attributes they hold (``num_heads``,
  ``num_key_value_heads``, ``n_head``, GPT-2's ``split_size``, ...) are divided by tp so the
  model's reshapes see the local heads. Head-size attributes are left alone.
* Every tp rank must start from the same full weights (each rank cuts its piece locally, no
  broadcast of the whole model): a per-parameter checksum is compared over the tp group and a
  mismatch is an error naming the first differing parameter.
* ``tp_group=None`` means the current mesh's tp group (:func:`zerospeed.comm.get_mesh`), or the
  whole world when there is no mesh.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from zerospeed import comm
from zerospeed.config.loader import parse_tensor_parallel
from zerospeed.config.tensor_parallel import TensorParallelConfig
from zerospeed.module_inject.layers import LinearAllreduce, LinearLayer, LmHeadLayer, TPLayer, VocabParallelEmbedding
from zerospeed.module_inject.policy import LayerPlan, is_conv1d, plan_model
from zerospeed.module_inject.tp_shard import TPSplit, plain_split

__all__ = ["AutoTP", "TPError", "auto_tp", "tp_param_splits"]

HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_head", "n_heads", "num_kv_heads",
              "n_kv_heads", "split_size", "all_head_size", "inner_dim", "num_key_value_heads_per_partition")
KV_NAMES = ("k_proj", "v_proj", "key", "value", "k", "v")


class TPError(ValueError):
    """A model that cannot be split exactly at this tp degree (the message names the layer and sizes)."""


def _resolve_group(tp_group: Any) -> Any:
    if tp_group is not None:
        return tp_group
    mesh = comm.get_mesh()
    return mesh.tp_group if mesh is not None else None


def _config_heads(model: nn.Module) -> tuple[int | None, int | None, int | None]:
    """(heads, kv heads, head_dim) from a HuggingFace config, where it says."""
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    head_dim = getattr(cfg, "head_dim", None) or (hidden // heads if hidden and heads else None)
    return heads, kv, head_dim


class AutoTP:
    """Plans and applies the tensor-parallel split of one model (DeepSpeed's class name)."""

    def __init__(self, model: nn.Module, tp_group: Any = None, config: TensorParallelConfig | None = None,
                 injection_policy: dict[Any, Any] | None = None) -> None:
        self.model = model
        self.config = config or TensorParallelConfig()
        self.tp_group = _resolve_group(tp_group)
        self.tp_size = comm.get_world_size(self.tp_group)
        self.tp_rank = comm.get_rank(self.tp_group)
        self.plan: dict[str, LayerPlan] = plan_model(model, self.config, injection_policy)
        self._heads = _config_heads(model)

    # -- sizes ------------------------------------------------------------------------------------
    def _parent(self, name: str) -> tuple[nn.Module, str, str]:
        parent_name, _, attr = name.rpartition(".")
        return (self.model.get_submodule(parent_name) if parent_name else self.model), parent_name, attr

    def _head_dim(self, parent: nn.Module, parent_name: str) -> int | None:
        for attr in ("head_dim", "head_size", "attention_head_size"):
            value = getattr(parent, attr, None)
            if isinstance(value, int) and value > 0:
                return value
        if any(k in parent_name.split(".")[-1].lower() for k in ("attn", "attention")):
            return self._heads[2]
        return None

    def _sub_sizes(self, plan: LayerPlan, size: int) -> tuple[int, ...]:
        fused = plan.fused
        if fused is None:
            return (size,)
        if fused == "qkv":
            heads, kv, hd = self._heads
            if not (heads and kv and hd):
                raise TPError(f"AutoTP: {plan.name}: a fused qkv projection needs num_attention_heads / "
                              "num_key_value_heads / head_dim in model.config; give partition_config shape instead")
            sizes = (heads * hd, kv * hd, kv * hd)
        elif isinstance(fused, int):
            if size % fused:
                raise TPError(f"AutoTP: {plan.name}: {size} features do not split into {fused} fused sub-projections")
            sizes = (size // fused,) * fused
        else:
            sizes = tuple(fused)
        if sum(sizes) != size:
            raise TPError(f"AutoTP: {plan.name}: fused sub-projection sizes {list(sizes)} do not add up to {size}")
        return sizes

    def _weight_split(self, plan: LayerPlan, module: nn.Module) -> tuple[TPSplit, tuple[int, ...]]:
        """The weight's split and the sub-projection sizes along the split (Linear layout)."""
        conv = is_conv1d(module)
        full = tuple(module.weight.shape)
        if plan.view_shape is not None:  # a layer spec's `shape`, in nn.Linear's [out, in] layout
            if conv:
                raise TPError(f"AutoTP: {plan.name}: a layer spec `shape` is not supported on Conv1D layers")
            dim = plan.partition_dim if plan.partition_dim is not None else (1 if plan.kind == "row" else 0)
            shape = list(plan.view_shape)
            entry = shape[dim]
            if len(shape) == len(full):
                view, along = None, full[dim]
            else:
                shape[dim] = sum(entry) if isinstance(entry, tuple) else -1
                known = math.prod(s for s in shape if s != -1)
                if shape.count(-1) > 1 or module.weight.numel() % known:
                    raise TPError(f"AutoTP: {plan.name}: shape {list(plan.view_shape)} does not fit the weight "
                                  f"{list(full)}")
                shape = [s if s != -1 else module.weight.numel() // known for s in shape]
                view, along = tuple(shape), shape[dim]
            if isinstance(entry, tuple):
                subs = entry
            elif len(shape) == len(full) and entry not in (-1, full[dim]):
                subs = (along // entry,) * entry if along % entry == 0 else (along,)
            else:
                subs = (along,)
            split = TPSplit(full, dim, tuple(subs), self.tp_size, view_shape=view)
            return split, tuple(subs)
        linear_dim = 0 if plan.kind == "column" else 1
        dim = (1 - linear_dim) if conv else linear_dim
        size = full[dim]
        subs = self._sub_sizes(plan, size) if plan.kind == "column" else (size,)
        return TPSplit(full, dim, subs, self.tp_size), subs

    def _check_exact(self, plan: LayerPlan, module: nn.Module, split: TPSplit, subs: tuple[int, ...]) -> None:
        parent, parent_name, attr = self._parent(plan.name)
        head_dim = self._head_dim(parent, parent_name) if split.view_shape is None else None
        if head_dim:
            unit = 3 * head_dim if attr == "query_key_value" and plan.fused is None else head_dim
            for i, sub in enumerate(subs):
                if sub % unit or (sub // unit) % self.tp_size:
                    kv = attr in KV_NAMES or (len(subs) == 3 and i > 0 and subs[1] != subs[0])
                    what = "KV heads" if kv else "heads"
                    raise TPError(f"AutoTP: {plan.name}: {sub // unit if sub % unit == 0 else sub / unit} {what} "
                                  f"({sub} features, head_dim {head_dim}) are not divisible by tp={self.tp_size}")
        problem = split.problem()
        if problem:
            side = "output" if plan.kind == "column" else "input"
            raise TPError(f"AutoTP: {plan.name}: {side} {problem} (weight {list(split.full_shape)})")

    # -- apply ------------------------------------------------------------------------------------
    def check_same_weights(self) -> None:
        """Every tp rank holds the same full weights (a checksum per parameter, compared over the group)."""
        if self.tp_size == 1:
            return
        split = tp_param_splits(self.model)  # pieces split already (e.g. tensor-parallel experts) differ by design
        sums = [(n, float(p.detach().double().sum()) if p.numel() and n not in split else 0.0)
                for n, p in self.model.named_parameters()]
        everyone = comm.all_gather_object(sums, group=self.tp_group)
        for i, (name, value) in enumerate(sums):
            for rank, other in enumerate(everyone):
                if other[i][0] != name or not math.isclose(other[i][1], value, rel_tol=0, abs_tol=1e-6 * (1 + abs(value))):
                    raise TPError(f"AutoTP: parameter {name} differs between tensor-parallel ranks {self.tp_rank} and "
                                  f"{rank}; build the model with the same seed or load the same weights on every rank")

    def apply(self) -> nn.Module:
        """Replace the planned modules in place and return the model."""
        splits: dict[str, tuple[TPSplit, tuple[int, ...]]] = {}
        for name, plan in self.plan.items():
            module = self.model.get_submodule(name)
            if plan.kind == "lm_head":
                continue
            split, subs = self._weight_split(plan, module)
            self._check_exact(plan, module, split, subs)
            splits[name] = (split, subs)
        for name, plan in self.plan.items():
            if plan.kind == "lm_head":
                self._check_head(name)
        self.check_same_weights()
        if self.tp_size == 1:
            return self.model
        touched_parents: dict[str, nn.Module] = {}
        for name, plan in self.plan.items():
            module = self.model.get_submodule(name)
            parent, parent_name, attr = self._parent(name)
            if plan.kind == "lm_head":
                self._replace_head(name, module, parent, attr)
                continue
            split, subs = splits[name]
            setattr(parent, attr, self._replace_linear(plan, module, split, subs))
            if plan.kind == "column" and split.view_shape is None:
                touched_parents[parent_name] = parent
        for parent_name, parent in touched_parents.items():
            self._divide_head_attrs(parent_name, parent)
        return self.model

    def _replace_linear(self, plan: LayerPlan, module: nn.Module, split: TPSplit, subs: tuple[int, ...]) -> TPLayer:
        conv = is_conv1d(module)
        args = (self.tp_group, self.tp_size, self.tp_rank)
        bias = module.bias
        if plan.kind == "row":
            return LinearAllreduce(module.weight, bias, split, *args, transposed=conv)
        bias_split = None
        if bias is not None:
            if split.view_shape is not None or split.dim != (1 if conv else 0):
                raise TPError(f"AutoTP: {plan.name}: a bias cannot follow a split along dimension {split.dim} of "
                              f"shape {list(split.view)}")
            bias_split = TPSplit((bias.shape[0],), 0, subs, self.tp_size)
        return LinearLayer(module.weight, bias, split, bias_split, *args, transposed=conv)

    def _tied_embedding(self, head: nn.Module) -> tuple[str, nn.Embedding] | None:
        for name, m in self.model.named_modules():
            if isinstance(m, nn.Embedding) and m.weight is head.weight:
                return name, m
        return None

    def _check_head(self, name: str) -> None:
        head = self.model.get_submodule(name)
        if not isinstance(head, nn.Linear):
            raise TPError(f"AutoTP: LM head {name} is a {type(head).__name__}, not nn.Linear")

    def _replace_head(self, name: str, head: nn.Linear, parent: nn.Module, attr: str) -> None:
        vocab = head.weight.shape[0]
        split = plain_split(tuple(head.weight.shape), 0, self.tp_size, pad=True)
        args = (self.tp_group, self.tp_size, self.tp_rank)
        tied = self._tied_embedding(head)
        if tied is None:
            setattr(parent, attr, LmHeadLayer(head.weight, head.bias, vocab, split, *args))
            return
        emb_name, emb = tied
        emb_parent = self.model.get_submodule(emb_name.rpartition(".")[0]) if "." in emb_name else self.model
        vpe = VocabParallelEmbedding(emb, split, *args)
        setattr(emb_parent, emb_name.rpartition(".")[2], vpe)
        setattr(parent, attr, LmHeadLayer(vpe.weight, head.bias, vocab, split, *args, shared=True))

    def _divide_head_attrs(self, parent_name: str, parent: nn.Module) -> None:
        for attr in HEAD_ATTRS:
            value = getattr(parent, attr, None)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                continue
            if value % self.tp_size:
                raise TPError(f"AutoTP: {parent_name}.{attr} = {value} is not divisible by tp={self.tp_size}")
            setattr(parent, attr, value // self.tp_size)


def auto_tp(model: nn.Module, tp_group: Any = None, partition_config: Any = None,
            injection_policy: dict[Any, Any] | None = None) -> nn.Module:
    """Split ``model`` over ``tp_group`` in place (see :class:`AutoTP`); returns the model.

    ``partition_config``: a ``tensor_parallel`` section (dict or parsed), or just its
    ``partition_config`` dict (``layer_specs``, ``use_default_specs``, ...).
    ``injection_policy``: ``{BlockClass: ("o_proj", "down_proj")}`` names the row-parallel layers.
    Works under ``torch.no_grad()``; the layers then call their collectives without autograd.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"auto_tp: model must be a torch.nn.Module, got {type(model).__name__}")
    config = parse_tensor_parallel(partition_config)
    with torch.no_grad():
        return AutoTP(model, tp_group, config, injection_policy).apply()


def tp_param_splits(model: nn.Module) -> dict[str, TPSplit]:
    """``{qualified parameter name: TPSplit}`` of every tensor-parallel parameter (tied names included).

    A module may also declare splits of parameters that live on *other* ranks under its name through
    an ``absent_tp_splits()`` method (``{relative name: TPSplit}``): the experts of other
    expert-parallel ranks, so a consolidated state dict holding them is merged over tp as well."""
    out: dict[str, TPSplit] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        # TPLayers, and modules that wrap one and expose its splits the same way (compression's layers)
        splits = module.tp_splits if isinstance(module, TPLayer) else getattr(module, "tp_splits", None)
        if isinstance(splits, dict):
            for pname, split in splits.items():
                out[f"{name}.{pname}" if name else pname] = split
        absent = getattr(module, "absent_tp_splits", None)
        if callable(absent):
            for pname, split in absent().items():
                out.setdefault(f"{name}.{pname}" if name else pname, split)
    return out
