"""Compression under tensor parallelism: statistics over the full weight from its tp shards.

A :class:`~zerospeed.compression.layers.CompressedLayer` that wraps one of AutoTP's linear layers
(:class:`~zerospeed.module_inject.LinearLayer`, column-parallel, or
:class:`~zerospeed.module_inject.LinearAllreduce`, row-parallel) holds a :class:`TPShard`: which rows
and columns of the full ``(out, in)`` weight this rank's piece is (from the layer's
:class:`~zerospeed.module_inject.TPSplit`, fused sub-projections included), the tp group, and the
collectives (through :mod:`zerospeed.comm`, its traceable ops under ``torch.compile``) that turn
per-shard statistics into full-weight ones.  Semantics equal the unsharded model's:

* weight quantization: groups are DeepSpeed's ``quantize_groups`` contiguous groups of the FULL
  flattened ``(out, in)`` weight.  When this rank's piece consists of whole groups in order (a
  column split whose group count is a multiple of tp, say) the piece is quantized locally, no
  communication; otherwise each local element's group is computed from its global position and the
  group statistics (max|w|; min and max; sums of |w| for ternary / binary) are reduced over the tp
  group (:func:`fake_quantize_sharded`), so a group may straddle shards (``quantize_groups: 1`` on a
  row-parallel layer is one all-reduce of one number per forward);
* activation quantization: a row-parallel layer's input is sharded on its last dimension, so the
  dynamic (and the static calibration) range is the max over the tp group; a column-parallel
  layer's input is replicated, its local range is already the global one;
* sparse pruning (l1, topk, snip_momentum): the scores are all-gathered into the full weight's
  shape and ranked as in one process; the mask covers the full layer, replicated (a weight-sized
  buffer on every rank, so checkpoints and consolidated state dicts hold it as any buffer), and each
  rank applies its piece.  topk's learnable scores are sharded like the weight (straight-through
  gradient, no communication); snip_momentum's scores are full and replicated, each rank updating its
  piece in the backward and the pieces all-gathered at each optimizer step;
* row and head pruning: the full per-row / per-head L1 norms are the all-reduced sums of the shards'
  partial norms; the masks (and topk's learnable scores) are full vectors, replicated, and each rank
  reads the entries of its rows / heads.  A replicated topk score's gradient is all-reduced over the
  tp group (each rank contributes its shard's part; the row-parallel bias, replicated, only from tp
  rank 0) so every rank applies the same update, as the optimizer of the unsharded model would.

The sharded topk scores are kept in the canonical ``(out, in)`` layout as in one process, described
by :attr:`TPShard.canon_split` (the weight's split, transposed for HF Conv1D), so checkpoints and
consolidated state dicts assemble them into the unsharded model's tensor.  Stochastic rounding draws its noise per rank (not equal to
one process's; nearest rounding is).

``mpu``: :func:`tp_group_of` accepts a DeepSpeed / Megatron-style object with
``get_model_parallel_group`` / ``get_model_parallel_world_size`` / ``get_model_parallel_rank`` (or the
``tensor_model_parallel`` spellings), or zerospeed's :class:`~zerospeed.comm.mesh.Mesh`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerospeed import comm
from zerospeed.comm import traceable
from zerospeed.module_inject.functional import all_reduce_grad
from zerospeed.module_inject.layers import LinearAllreduce, LinearLayer, LmHeadLayer, VocabParallelEmbedding
from zerospeed.module_inject.tp_shard import TPSplit, assemble, local_piece

__all__ = ["TPShard", "fake_quantize_sharded", "is_tp_linear", "is_unsupported_tp", "tp_group_of"]

_MPU_METHODS = (("get_tensor_model_parallel_group", "get_model_parallel_group"),
                ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"),
                ("get_tensor_model_parallel_rank", "get_model_parallel_rank"))


def is_tp_linear(module: nn.Module) -> bool:
    return isinstance(module, (LinearLayer, LinearAllreduce))


def is_unsupported_tp(module: nn.Module) -> bool:
    """Vocabulary-parallel layers (LM head, tied input embedding) are not compressed under tp."""
    return isinstance(module, (LmHeadLayer, VocabParallelEmbedding))


def tp_group_of(mpu: Any, where: str) -> tuple[Any, int, int]:
    """``(tp_group, tp_size, tp_rank)`` of an ``mpu`` (see the module docstring); a clear error when it
    lacks the methods or contradicts its group."""
    from zerospeed.comm.mesh import Mesh

    if isinstance(mpu, Mesh):
        return mpu.tp_group, mpu.tp_size, mpu.tp_rank
    values = []
    for names in _MPU_METHODS:
        fn = next((getattr(mpu, n) for n in names if callable(getattr(mpu, n, None))), None)
        if fn is None:
            raise TypeError(f"{where}: mpu ({type(mpu).__name__}) has no {names[1]}() (nor {names[0]}()); an mpu needs "
                            "get_model_parallel_group, get_model_parallel_world_size and get_model_parallel_rank, or "
                            "pass zerospeed's mesh (zerospeed.comm.get_mesh())")
        values.append(fn())
    group, size, rank = values[0], int(values[1]), int(values[2])
    if comm.is_initialized() and group is not None and comm.get_world_size(group) != size:
        raise ValueError(f"{where}: mpu's model-parallel world size is {size} but its group has "
                         f"{comm.get_world_size(group)} ranks")
    if not 0 <= rank < size:
        raise ValueError(f"{where}: mpu's model-parallel rank {rank} is outside [0, {size})")
    return group, size, rank


def _transposed_split(split: TPSplit) -> TPSplit | None:
    """The split of the canonical ``(out, in)`` tensor of a ``(in, out)``-stored weight, when it is plain."""
    if split.view_shape is not None or len(split.full_shape) != 2:
        return None
    return TPSplit(tuple(reversed(split.full_shape)), 1 - split.dim, split.sub_sizes, split.tp_size,
                   padded_size=split.padded_size)


@dataclass
class TPShard:
    """This rank's piece of one tensor-parallel linear layer (canonical ``(out, in)`` coordinates).

    ``rows`` / ``cols``: the global row / column index of each local canonical row / column.
    """

    name: str
    kind: str  # "column" | "row"
    group: Any
    size: int
    rank: int
    split: TPSplit  # of the weight as stored
    canon_split: TPSplit | None  # of a canonical (out, in) tensor (None: a reshaped Conv1D split)
    bias_split: TPSplit | None
    transposed: bool
    full_out: int
    full_in: int
    rows: torch.Tensor
    cols: torch.Tensor

    @classmethod
    def of(cls, module: nn.Module, name: str) -> TPShard:
        split = module.tp_splits["weight"]
        transposed = bool(module.transposed)
        full = split.full_shape
        if len(full) != 2:
            raise ValueError(f"compression: {name}: a tensor-parallel weight of shape {list(full)} is not 2-D")
        full_out, full_in = (full[1], full[0]) if transposed else (full[0], full[1])
        if split.view_shape is None and split.padded_size is None:  # cut along one dim: index that dim only
            along = TPSplit((full[split.dim],), 0, split.sub_sizes, split.tp_size)
            cut = local_piece(torch.arange(full[split.dim]), along, module.tp_rank)
            on_rows = (split.dim == 0) != transposed
            rows = cut if on_rows else torch.arange(full_out)
            cols = torch.arange(full_in) if on_rows else cut
        else:  # a reshaped split: find each local element's global position (a full-size index, once)
            index = torch.arange(full_out * full_in, dtype=torch.int64).view(full_out, full_in)
            local = local_piece(index.t().contiguous() if transposed else index, split, module.tp_rank)
            local = local.t() if transposed else local
            rows, cols = local[:, 0] // full_in, local[0, :] % full_in
            if not torch.equal(local, rows[:, None] * full_in + cols[None, :]):
                raise ValueError(f"compression: {name}: its tensor-parallel split (view {list(split.view)}, dim "
                                 f"{split.dim}) does not cut whole rows or columns of the weight; compression "
                                 "supports row- and column-wise splits")
        kind = "row" if isinstance(module, LinearAllreduce) else "column"
        canon = _transposed_split(split) if transposed else split
        return cls(name, kind, module.tp_group, module.tp_size, module.tp_rank, split, canon,
                   module.tp_splits.get("bias"), transposed, full_out, full_in, rows.contiguous(), cols.contiguous())

    # -- index arithmetic -----------------------------------------------------------------------------
    def flat_index(self) -> torch.Tensor:
        """Global flat (canonical, row-major) index of every local element, shape of the local weight."""
        return self.rows[:, None] * self.full_in + self.cols[None, :]

    def local_groups(self, num_groups: int) -> int | None:
        """How many whole groups this rank's piece is, when it is whole groups in order; else None."""
        group_size = self.full_out * self.full_in // num_groups
        numel = self.rows.numel() * self.cols.numel()
        if numel % group_size:
            return None
        gid = (self.flat_index() // group_size).reshape(-1, group_size)
        if not torch.equal(gid, gid[:, :1].expand_as(gid)):
            return None
        return numel // group_size

    # -- collectives (statistics: no autograd) ---------------------------------------------------------
    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return traceable.all_reduce_sum(x, traceable.group_id(self.group))
        out = x.detach().contiguous().clone()
        comm.all_reduce(out, group=self.group)
        return out

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        if torch.compiler.is_compiling():
            return list(traceable.all_gather_stack(x, traceable.group_id(self.group), self.size).unbind(0))
        x = x.detach().contiguous()
        out = x.new_empty((self.size, *x.shape))
        comm.all_gather(out, x, group=self.group)
        return list(out.unbind(0))

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._gather(x)).amax(dim=0)

    def weight_shaped_split(self, what: str) -> TPSplit:
        """:attr:`canon_split`, or an error naming the layer when the split cannot describe it."""
        if self.canon_split is None:
            raise ValueError(f"compression: {self.name}: {what} needs a row- or column-wise tensor-parallel split of "
                             f"the weight, not a reshaped one (view {list(self.split.view)})")
        return self.canon_split

    def gather_full(self, local: torch.Tensor) -> torch.Tensor:
        """The full canonical ``(out, in)`` tensor from every rank's canonical piece."""
        return assemble(self._gather(local), self.weight_shaped_split("sparse pruning"))

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's canonical piece of a full canonical tensor."""
        return local_piece(full.contiguous(), self.weight_shaped_split("sparse pruning"), self.rank)


def grad_all_reduce(x: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """Identity forward; the gradient summed over the tp group (a replicated tensor whose gradient
    each rank only has a part of)."""
    return all_reduce_grad(x, shard.group, shard.size)


def fake_quantize_sharded(w: torch.Tensor, bits: int, num_groups: int, symmetric: bool, stochastic: bool,
                          shard: TPShard) -> torch.Tensor:
    """:func:`~.quantizer.fake_quantize` of this rank's piece of a weight whose ``num_groups`` groups
    are defined on the full weight: group statistics reduced over the tp group.  ``w`` canonical,
    local; straight-through gradient."""
    dq = sharded_grid(w, bits, num_groups, symmetric, stochastic, shard)[0]
    return dq + (w - w.detach())


def sharded_grid(w: torch.Tensor, bits: int, num_groups: int, symmetric: bool, stochastic: bool,
                 shard: TPShard) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The quantized values of this rank's piece (no gradient) and each element's scale and zero
    point (``None`` when symmetric), with group statistics over the full weight."""
    group_size = shard.full_out * shard.full_in // num_groups
    gid = (shard.flat_index() // group_size).reshape(-1)
    flat = w.detach().float().reshape(-1)
    absw = flat.abs()
    if bits <= 2:
        sums = shard.all_sum(torch.zeros(num_groups).index_add_(0, gid, absw))
        if bits == 1:
            scale = (sums / group_size).clamp_min(1e-12)[gid]
            dq = torch.where(flat >= 0, 1.0, -1.0) * scale
        else:
            keep = absw > (0.7 * (sums / group_size))[gid]
            kept = torch.zeros(2 * num_groups).index_add_(0, gid, absw * keep).index_add_(
                0, gid + num_groups, keep.float())
            kept = shard.all_sum(kept)
            scale = (kept[:num_groups] / kept[num_groups:].clamp_min(1.0)).clamp_min(1e-12)[gid]
            dq = torch.sign(flat) * keep * scale
    elif symmetric:
        qmax = 2 ** (bits - 1) - 1
        high = shard.all_max(torch.zeros(num_groups).scatter_reduce(0, gid, absw, "amax"))
        scale = (high / qmax).clamp_min(1e-12)[gid]
        q = flat / scale
        q = (torch.floor(q + torch.rand_like(q)) if stochastic else torch.round(q)).clamp(-qmax, qmax)
        dq = q * scale
    else:
        qmax = 2**bits - 1
        ends = torch.zeros(2 * num_groups).scatter_reduce(0, gid, flat, "amax").scatter_reduce(
            0, gid + num_groups, -flat, "amax")
        ends = shard.all_max(ends)
        high, low = ends[:num_groups], -ends[num_groups:]  # clamped to include 0 by the zero start
        scale = ((high - low) / qmax).clamp_min(1e-12)
        zero = torch.round(-low / scale)[gid]
        scale = scale[gid]
        q = flat / scale
        q = ((torch.floor(q + torch.rand_like(q)) if stochastic else torch.round(q)) + zero).clamp(0, qmax)
        dq = (q - zero) * scale
        return dq.view_as(w).to(w.dtype), scale.view_as(w), zero.view_as(w)
    return dq.view_as(w).to(w.dtype), scale.view_as(w), None


class TPCleanedLinear(nn.Module):
    """A tensor-parallel layer after ``redundancy_clean``: ``inner`` (a :class:`~.quantized.QuantizedLinear`
    or a plain ``nn.Linear``) holds this rank's remaining rows (column-parallel) or input columns
    (row-parallel); this module adds the tp layer's communication, a row-parallel layer's bias (after
    the all-reduce, replicated) and an input quantization whose range is the tp group's (a row-parallel
    input is sharded).  Shards may differ in size between ranks (each kept its own unpruned units)."""

    def __init__(self, inner: nn.Module, shard: TPShard, bias: torch.Tensor | None = None, act_bits: int = 0,
                 act_symmetric: bool = True, act_range: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.inner, self.kind = inner, shard.kind
        self.__dict__["shard"] = shard  # the group and collectives (its row / column indices are stale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.act_bits, self.act_symmetric, self.act_static = act_bits, act_symmetric, act_range is not None
        if act_range is not None:
            self.register_buffer("act_low", act_range[0].detach().clone())
            self.register_buffer("act_high", act_range[1].detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from zerospeed.module_inject.functional import copy_to_tp, reduce_from_tp

        from .quantized import QuantizedLinear
        from .quantizer import fake_quantize_activation

        shard = self.shard
        if self.kind == "column":
            x = copy_to_tp(x, shard.group, shard.size)
        if not self.act_bits:
            y = self.inner(x)
        else:
            if self.act_static:
                low, high = self.act_low, self.act_high
            elif self.kind == "row":
                xf = x.detach().float()
                ends = shard.all_max(torch.stack([xf.amax(), -xf.amin()]))
                low, high = -ends[1], ends[0]
            else:
                low = high = None
            if isinstance(self.inner, QuantizedLinear) and self.inner.act_bits:
                y = self.inner(x, act_range=None if low is None else (low, high))
            else:
                y = self.inner(fake_quantize_activation(x, self.act_bits, self.act_symmetric, low, high))
        if self.kind == "row":
            y = reduce_from_tp(y, shard.group, shard.size)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        act = f", act_bits={self.act_bits}" if self.act_bits else ""
        return f"{self.kind}-parallel, tp rank {self.shard.rank}/{self.shard.size}{act}"
