"""``redundancy_clean``: turn simulated compression into a physically smaller model, in place.

Steps, on a model prepared by :func:`~zerospeed.compression.init_compression` (parameters must be
whole: call it on a single-process model, or on one loaded from ``engine.consolidated_state_dict()``):

1. Each compressed layer's final state is read: current bit width, activation quantization, and the
   kept rows / channels / heads from its masks (for ``topk``: the top scores).  Sparse masks are
   multiplied into the weight (unstructured zeros cannot shrink a dense matmul; they stay zeros).
2. Structured pruning removes units: ``row_pruning`` drops output rows (and bias entries) and the
   matching input columns of its ``related_modules``; ``channel_pruning`` drops Conv2d output channels,
   the related convs' input channels and the related BatchNorm features; ``head_pruning`` drops whole
   heads' input columns of the output projection and the matching output rows of the related q/k/v
   projections (a fused qkv of ``m * in_features`` rows loses the head's rows in each of its ``m``
   parts).  Head-count attributes (``num_attention_heads``, ``num_heads``, ``n_head``, ``n_heads``) and
   ``all_head_size`` / ``split_size`` of the parents are updated.
   A related pattern is paired with the module whose dotted name shares the longest prefix with the
   pruned layer (so ``layer.\\w+.output.dense`` pairs layer 3's intermediate with layer 3's output).
3. Quantized Linear / HF Conv1D layers become :class:`~.quantized.QuantizedLinear` (packed codes,
   per-group scales, int8 activations when configured), Embeddings :class:`~.quantized.QuantizedEmbedding`.
   The group size is the training one (weights per group); if pruning left a weight that it does not
   tile, groups fall back to one per row.  Conv2d weights keep the quantized values in floating point
   (there is no packed conv kernel on CPU).  Layers with only activation quantization become
   :class:`InputQuantized` around the plain layer.

Tensor parallelism (decision: each rank keeps its shard).  On a model trained with tp (AutoTP's
layers wrapped by ``init_compression``), every rank cleans its own shard, without gathering the
model: the masks are full vectors (identical on every rank), so each rank removes the pruned rows /
heads it holds and the matching columns of its related layers, addressed by their global indices
(a column-parallel ``c_fc`` row and the row-parallel ``c_proj`` input column it feeds sit on the same
rank).  A quantized layer keeps exactly the simulated values, on the grid whose statistics were
reduced over the tp group, each element's scale stored per the largest run of elements that share
one (whole groups when groups are aligned with the shard, per row or finer when a group straddles
shards).  The layer becomes :class:`~.tp.TPCleanedLinear` (the local ``QuantizedLinear`` or
``Linear`` plus the tp communication, a row-parallel bias, and input ranges taken over the tp group),
and head-count attributes become this rank's kept heads.  Shards may then differ in size between
ranks; the cleaned model runs as it is, on the same tp group (it is not meant to be gathered or
re-split).  A head-pruned layer that would keep no head on some rank is an error.

Tolerance: cleaned outputs equal the simulated (fake-quantized, masked) outputs to float rounding
(tests: 1e-5 relative) when quantization groups do not straddle removed units; stochastic rounding
is replaced by nearest at cleaning.  Binary/ternary scales are means over the kept weights, so with
structured pruning they are recomputed on what remains.  Channel pruning with BatchNorm is the
exception (as in DeepSpeed): the simulated model masks a pruned channel's conv output, but its
BatchNorm (and ReLU) still turn that zero into ``relu(beta - mean * gamma / std)``, which the next conv
reads; the cleaned model removes the channel, so the two differ where that value is nonzero (a
channel whose BatchNorm was trained before it was pruned).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .init import compression_section, matches
from .layers import CompressedLayer, kind_of
from .quantized import QuantizedEmbedding, QuantizedLinear
from .quantizer import dequantize, fake_quantize_activation, quantize
from .scheduler import _SCHEDULERS
from .tp import TPCleanedLinear, TPShard, is_tp_linear, is_unsupported_tp, tp_group_of

HEAD_ATTRS = ("num_attention_heads", "num_heads", "n_head", "n_heads")
WIDTH_ATTRS = ("all_head_size", "split_size")


class InputQuantized(nn.Module):
    """Fake-quantizes the input of ``module`` (activation quantization without weight quantization)."""

    def __init__(self, module: nn.Module, bits: int, symmetric: bool = True, static: bool = False) -> None:
        super().__init__()
        self.module, self.bits, self.symmetric, self.static = module, bits, symmetric, static
        if static:
            self.register_buffer("act_low", torch.zeros(()))
            self.register_buffer("act_high", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low, high = (self.act_low, self.act_high) if self.static else (None, None)
        return self.module(fake_quantize_activation(x, self.bits, self.symmetric, low, high))


@dataclass
class _Final:
    bits: int
    group_size: int
    symmetric: bool
    act_bits: int
    act_symmetric: bool
    act_range: tuple[torch.Tensor, torch.Tensor] | None
    row_grid: bool = False  # the weight holds fake-quantized values on per-row grids (clean_row_scale)
    elem_grid: bool = False  # tp: the weight holds the simulated values, each element's grid in clean_scale_elem


# -- canonical (out, in, ...) access to the weights of supported modules ------------------------------
def _is_conv1d(module: nn.Module) -> bool:
    return kind_of(module) == "conv1d" and not isinstance(module, CompressedLayer)


def _transposed(module: nn.Module) -> bool:
    if isinstance(module, CompressedLayer):
        return module.kind == "conv1d"
    if is_tp_linear(module):
        return bool(module.transposed)
    return _is_conv1d(module)


def _canon(module: nn.Module) -> torch.Tensor:
    w = module.weight.detach()
    return w.t() if _transposed(module) else w


# global (row, column) indices of each module's current weight while a clean runs: tp shards hold a
# subset of the full layer's rows or columns, and pruning addresses units by their global index
_INDEX: "weakref.WeakKeyDictionary[nn.Module, tuple[torch.Tensor, torch.Tensor]]" = weakref.WeakKeyDictionary()


def _shard(module: nn.Module) -> TPShard | None:
    if isinstance(module, CompressedLayer):
        return module.tp
    return TPShard.of(module, "") if is_tp_linear(module) else None


def _index(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    got = _INDEX.get(module)
    if got is None:
        shard = _shard(module)
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            got = (torch.arange(module.num_features), torch.arange(0))
        elif shard is not None:
            got = (shard.rows.clone(), shard.cols.clone())
        else:
            w = _canon(module)
            got = (torch.arange(w.shape[0]), torch.arange(w.shape[1]))
        _INDEX[module] = got
    return got


def _full_out(module: nn.Module) -> int:
    shard = _shard(module)
    return shard.full_out if shard is not None else _canon(module).shape[0]


def _set(module: nn.Module, canonical: torch.Tensor, bias: torch.Tensor | None) -> None:
    transposed = _transposed(module)
    stored = canonical.t() if transposed else canonical
    module.weight = nn.Parameter(stored.contiguous(), requires_grad=module.weight.requires_grad)
    if bias is not None:
        module.bias = nn.Parameter(bias.contiguous(), requires_grad=module.bias.requires_grad)
    target = module.original if isinstance(module, CompressedLayer) else module
    out_features, in_features = canonical.shape[0], canonical.shape[1]
    if isinstance(target, nn.Linear):
        target.in_features, target.out_features = in_features, out_features
    elif isinstance(target, nn.Conv2d):
        target.in_channels, target.out_channels = in_features * target.groups, out_features
    elif _is_conv1d(target):
        target.nf = out_features


def _select_out(module: nn.Module, keep_global: torch.Tensor) -> None:
    """Keep the output units (rows) whose global index is in ``keep_global``."""
    rows, cols = _index(module)
    keep = torch.nonzero(torch.isin(rows, keep_global)).reshape(-1)
    _INDEX[module] = (rows[keep], cols)
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        module.num_features = int(keep.numel())
        for name in ("weight", "bias"):
            p = getattr(module, name)
            if p is not None:
                setattr(module, name, nn.Parameter(p.detach()[keep].clone(), requires_grad=p.requires_grad))
        for name in ("running_mean", "running_var"):
            if getattr(module, name, None) is not None:
                setattr(module, name, getattr(module, name)[keep].clone())
        return
    bias = module.bias.detach()[keep] if getattr(module, "bias", None) is not None else None
    _set(module, _canon(module)[keep], bias)
    for name in ("clean_row_scale", "clean_row_zero", "clean_scale_elem", "clean_zero_elem"):
        grid = module.__dict__.get(name)
        if grid is not None:
            module.__dict__[name] = grid[keep]


def _select_in(module: nn.Module, keep_global: torch.Tensor) -> None:
    """Keep the input units (columns) whose global index is in ``keep_global``."""
    rows, cols = _index(module)
    keep = torch.nonzero(torch.isin(cols, keep_global)).reshape(-1)
    _INDEX[module] = (rows, cols[keep])
    bias = module.bias.detach() if getattr(module, "bias", None) is not None else None
    _set(module, _canon(module)[:, keep], bias)
    for name in ("clean_scale_elem", "clean_zero_elem"):
        grid = module.__dict__.get(name)
        if grid is not None:
            module.__dict__[name] = grid[:, keep]


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        n += 1
    return n


def _related(model: nn.Module, layer_name: str, patterns: list[str], key: str) -> list[tuple[str, nn.Module]]:
    """One module per pattern: the match nearest to ``layer_name`` (longest common dotted prefix)."""
    found = []
    candidates = [(n, m) for n, m in model.named_modules()
                  if n and n != layer_name and (kind_of(m) is not None or isinstance(m, nn.modules.batchnorm._BatchNorm))]
    for pattern in patterns:
        hits = [(n, m) for n, m in candidates if matches(n, [pattern])]
        if not hits:
            raise ValueError(f"{key}: related module pattern {pattern!r} matches no Linear/Conv1D/Conv2d/BatchNorm "
                             f"module for {layer_name}")
        found.append(max(hits, key=lambda nm: _common_prefix(nm[0], layer_name)))
    return found


def _kept(layer: CompressedLayer, what: str) -> torch.Tensor | None:
    if what not in layer.prune or not layer.on.get(what, False):
        return None
    return torch.nonzero(layer.full_mask(what).detach() > 0.5).reshape(-1)


def _parents(model: nn.Module, names: list[str]) -> list[nn.Module]:
    seen: dict[int, nn.Module] = {}
    for name in names:
        parent = name.rpartition(".")[0]
        module = model.get_submodule(parent) if parent else model
        seen[id(module)] = module
    return list(seen.values())


@torch.no_grad()
def _prune_heads(model: nn.Module, name: str, layer: CompressedLayer, key: str) -> None:
    keep_heads = _kept(layer, "head")
    if keep_heads is None:
        return
    spec = layer.prune["head"]
    width = layer.full_in
    head_dim = width // spec.num_heads
    cols = (keep_heads[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)
    related = [r for group in spec.related for r in _related(model, name, group, key)]
    local_cols = _index(layer)[1]  # this rank's (tp) or all input columns, before pruning
    local_width, local_kept = local_cols.numel(), int(torch.isin(local_cols, cols).sum())
    if layer.tp is not None:
        kept = [int(k) for k in layer.tp._gather(torch.tensor([local_kept]))]
        if min(kept) == 0:
            raise ValueError(f"{key}: {name} keeps no attention head on tensor-parallel rank {kept.index(0)} (kept "
                             f"head columns per rank: {kept}); its attention would be empty there: keep more heads "
                             "(dense_ratio) or clean without tensor parallelism")
    _select_in(layer, cols)
    for _, module in related:
        rows = _full_out(module)
        if rows % width:
            raise ValueError(f"{key}: related module has {rows} output rows, not a multiple of {name}'s {width} "
                             "input features")
        parts = rows // width
        _select_out(module, torch.cat([cols + p * width for p in range(parts)]))
    for parent in _parents(model, [name] + [n for n, _ in related]):
        for attr in HEAD_ATTRS:  # (tp: AutoTP set them to this rank's heads)
            if getattr(parent, attr, None) == local_width // head_dim:
                setattr(parent, attr, local_kept // head_dim)
        for attr in WIDTH_ATTRS:
            if getattr(parent, attr, None) == local_width:
                setattr(parent, attr, local_kept)


@torch.no_grad()
def _prune_rows(model: nn.Module, name: str, layer: CompressedLayer, what: str, key: str) -> None:
    keep = _kept(layer, what)
    if keep is None:
        return
    related = [r for group in layer.prune[what].related for r in _related(model, name, group, key)]
    _select_out(layer, keep)
    for _, module in related:
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            _select_out(module, keep)
        else:
            _select_in(module, keep)


def _final_state(layer: CompressedLayer) -> _Final:
    bits, gsize, sym = 0, 0, True
    if layer.wq is not None and layer.wq_bits:
        bits, sym = layer.wq_bits, layer.wq.symmetric
        gsize = layer.weight.numel() // layer.wq.groups
    act_bits, act_sym, act_range = 0, True, None
    if layer.aq is not None and layer.aq_on and layer.act_calibrated:
        act_bits, act_sym = layer.aq.bits, layer.aq.symmetric
        if layer.aq.static:
            act_range = (layer.act_low.detach().clone(), layer.act_high.detach().clone())
    return _Final(bits, gsize, sym, act_bits, act_sym, act_range)


def _to_row_grid(layer: CompressedLayer, final: _Final) -> None:
    """Replace the weight by its simulated (masked, fake-quantized) values and remember each row's
    grid, so removing rows/columns later re-encodes exactly what training simulated.  Only for groups
    that cover whole rows (a row's grid is then its group's)."""
    w = _canon(layer).float()
    cols = w[0].numel()
    if not final.bits or layer.kind not in ("linear", "conv1d") or final.group_size % cols:
        return
    groups = w.numel() // final.group_size
    for what in ("row", "channel", "head", "sparse"):
        if layer.on.get(what, False):
            m = layer.mask(what).detach().float()
            w = w * (m.repeat_interleave(cols // m.numel()).view(1, -1) if what == "head"
                     else m.view(-1, *([1] * (w.dim() - 1))) if what in ("row", "channel") else m)
    q, scale, zero = quantize(w, final.bits, groups, final.symmetric)
    values = dequantize(q, scale, zero, groups)
    struct = layer._structured(values)
    if struct is not None:
        values = values * struct
    rows_per_group = final.group_size // cols
    layer.__dict__["clean_row_scale"] = scale.repeat_interleave(rows_per_group)
    layer.__dict__["clean_row_zero"] = None if zero is None else zero.repeat_interleave(rows_per_group)
    _set(layer, values.to(layer.weight.dtype), None)
    final.row_grid = True


def _to_element_grid(layer: CompressedLayer, final: _Final) -> None:
    """tp: replace the weight by its simulated (masked, fake-quantized) values and remember each
    element's grid (scale, zero point), whose statistics came from the whole tp group."""
    if not final.bits or layer.kind not in ("linear", "conv1d"):
        return
    was_training = layer.training
    layer.eval()  # nearest rounding
    grid: list[Any] = []
    values = layer.effective_weight(grid).detach()
    layer.train(was_training)
    layer.__dict__["clean_scale_elem"], layer.__dict__["clean_zero_elem"] = grid[0]
    _set(layer, values.to(layer.weight.dtype), None)
    final.elem_grid = True


def _run_length(scale: torch.Tensor, zero: torch.Tensor | None) -> int:
    """The largest group size (whole rows first, then divisors of a row) whose groups of the
    flattened ``(rows, cols)`` weight each have one scale and zero point."""
    rows, cols = scale.shape
    flat = scale.reshape(-1) if zero is None else torch.stack([scale.reshape(-1), zero.reshape(-1)], dim=1)
    sizes = [k * cols for k in range(rows, 0, -1) if rows % k == 0] + [d for d in range(cols - 1, 0, -1) if cols % d == 0]
    for size in sizes:
        chunks = flat.view(-1, size, *flat.shape[1:])
        if torch.equal(chunks, chunks[:, :1].expand_as(chunks)):
            return size
    return 1


def _finish_tp(layer: CompressedLayer, final: _Final) -> nn.Module:
    w = _canon(layer).float()
    bias = layer.bias.detach() if layer.bias is not None else None
    row = layer.tp.kind == "row"
    inner_bias = None if row else bias
    if final.bits:
        scale_e, zero_e = layer.__dict__["clean_scale_elem"], layer.__dict__["clean_zero_elem"]
        size = _run_length(scale_e, zero_e)
        scale = scale_e.reshape(-1, size)[:, 0].contiguous()
        zero = None if zero_e is None else zero_e.reshape(-1, size)[:, 0].contiguous()
        inner = QuantizedLinear.from_weight(w, inner_bias, final.bits, size, final.symmetric, final.act_bits,
                                            final.act_symmetric, final.act_range, scale, zero)
    else:
        inner = nn.Linear(w.shape[1], w.shape[0], bias=inner_bias is not None, dtype=layer.weight.dtype)
        inner.weight = nn.Parameter(w.to(layer.weight.dtype), requires_grad=layer.weight.requires_grad)
        if inner_bias is not None:
            inner.bias = nn.Parameter(inner_bias.clone(), requires_grad=layer.bias.requires_grad)
    return TPCleanedLinear(inner, layer.tp, bias if row else None, final.act_bits, final.act_symmetric,
                           final.act_range)


def _finish(layer: CompressedLayer, final: _Final) -> nn.Module:
    if layer.tp is not None:
        return _finish_tp(layer, final)
    w = _canon(layer).float()
    bias = layer.bias.detach() if layer.bias is not None else None
    gsize = final.group_size
    if final.row_grid:
        scale, zero = layer.__dict__["clean_row_scale"], layer.__dict__["clean_row_zero"]
        cols = w[0].numel()
        per = final.group_size // cols
        if w.shape[0] % per == 0 and torch.equal(scale.view(-1, per), scale.view(-1, per)[:, :1].expand(-1, per)) \
                and (zero is None or torch.equal(zero.view(-1, per), zero.view(-1, per)[:, :1].expand(-1, per))):
            # rows still come in whole training groups: store one scale per group, not per row
            scale, zero, cols = scale.view(-1, per)[:, 0], None if zero is None else zero.view(-1, per)[:, 0], \
                final.group_size
        return QuantizedLinear.from_weight(w, bias, final.bits, cols, final.symmetric, final.act_bits,
                                           final.act_symmetric, final.act_range, scale, zero)
    if final.bits and w.numel() % max(gsize, 1):
        gsize = w[0].numel()  # pruning left a shape the training groups do not tile: one group per row
    if final.bits and layer.kind in ("linear", "conv1d"):
        return QuantizedLinear.from_weight(w, bias, final.bits, gsize, final.symmetric, final.act_bits,
                                           final.act_symmetric, final.act_range)
    if final.bits and layer.kind == "embedding":
        return QuantizedEmbedding.from_weight(w, final.bits, gsize, final.symmetric, layer.ctor["padding_idx"])
    module = layer.original
    if final.bits:  # conv2d: quantized values, stored in floating point
        groups = w.numel() // gsize
        q, scale, zero = quantize(w, final.bits, groups, final.symmetric)
        w = dequantize(q, scale, zero, groups)
    _set(module, w.to(layer.weight.dtype), bias)
    if final.act_bits:
        wrapped = InputQuantized(module, final.act_bits, final.act_symmetric, final.act_range is not None)
        if final.act_range is not None:
            wrapped.act_low.copy_(final.act_range[0])
            wrapped.act_high.copy_(final.act_range[1])
        return wrapped
    return module


def _check_mpu(model: nn.Module, mpu: Any) -> None:
    _, size, rank = tp_group_of(mpu, "redundancy_clean")
    split = [(n, m) for n, m in model.named_modules()
             if (isinstance(m, CompressedLayer) and m.tp is not None) or is_tp_linear(m) or is_unsupported_tp(m)]
    if size > 1 and not split:
        raise ValueError(f"redundancy_clean: the mpu has {size} tensor-parallel ranks but the model is not split; "
                         "clean the model it trained (split by initialize / tp_model_init), or pass mpu=None")
    for name, m in split:
        sizes = (m.tp.size, m.tp.rank) if isinstance(m, CompressedLayer) else (m.tp_size, m.tp_rank)
        if sizes != (size, rank):
            raise ValueError(f"redundancy_clean: {name} is tp rank {sizes[1]} of {sizes[0]}, the mpu says rank {rank} "
                             f"of {size}")


def redundancy_clean(model: nn.Module, deepspeed_config: Any, mpu: Any = None) -> nn.Module:
    """Remove what compression made redundant from ``model`` (in place) and return it.

    ``mpu`` (optional): the tensor-parallel groups the model was trained with (a Megatron-style mpu
    or zerospeed's mesh), checked against the model's tp layers; each rank cleans its shard (see
    the module docstring).
    """
    if mpu is not None:
        _check_mpu(model, mpu)
    if compression_section(deepspeed_config) is None:
        raise ValueError("redundancy_clean: the config has no compression_training section")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, CompressedLayer)}
    if not layers:
        return model  # layer reduction only (already applied by init_compression), or nothing enabled
    if any(p.numel() == 0 for m in layers.values() for p in (m.weight,)):
        raise ValueError("redundancy_clean: the model's parameters are partitioned (ZeRO-3); clean a model loaded "
                         "from engine.consolidated_state_dict() instead")
    finals = {name: _final_state(layer) for name, layer in layers.items()}
    _INDEX.clear()
    with torch.no_grad():
        for name, layer in layers.items():
            if layer.tp is not None:
                _to_element_grid(layer, finals[name])
            else:
                _to_row_grid(layer, finals[name])
            if finals[name].row_grid or finals[name].elem_grid:
                continue
            if "sparse" in layer.prune and layer.on.get("sparse", False):
                mask = layer.mask("sparse").detach()
                _set(layer, _canon(layer) * mask.to(layer.weight.dtype), None)
        root = "compression_training"
        for name, layer in layers.items():
            _prune_rows(model, name, layer, "row", f"{root}.row_pruning")
            _prune_rows(model, name, layer, "channel", f"{root}.channel_pruning")
            _prune_heads(model, name, layer, f"{root}.head_pruning")
        for name, layer in layers.items():
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, _finish(layer, finals[name]))
    _INDEX.clear()
    _SCHEDULERS.pop(model, None)
    return model
