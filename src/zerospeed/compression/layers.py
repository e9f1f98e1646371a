"""``CompressedLayer``: a Linear / HF Conv1D / Conv2d / Embedding with compression applied in forward.

It takes over the wrapped module's ``weight`` and ``bias`` Parameter objects (same objects, same
names in ``state_dict``), so an optimizer or a ZeRO strategy built afterwards sees the parameters it
would have seen, and under ZeRO-3 the layer's own pre-forward hook gathers them: every compression
step below runs on the full weight.

Forward: ``w_eff = M_struct * fakequant(M_sparse * M_struct * w)`` (masks first so the quantization grid
ignores pruned weights; structured masks again after, because a binary grid has no zero) and the input
activation is fake-quantized when activation quantization is on.  Masks are buffers (saved with the
model, identical on every data-parallel rank because they are computed from the gathered weight or from
all-reduced scores and ranges); learnable ``topk`` scores are Parameters named ``*_mask_scores``.

Tensor parallelism: wrapping AutoTP's ``LinearLayer`` / ``LinearAllreduce``, the layer computes on
its shard with the statistics of the full weight and does the tp layer's communication itself
(see :mod:`.tp`); ``tp_splits`` tells checkpoints how its tensors are cut.

The schedule is pushed in by :meth:`set_step` (from :class:`~zerospeed.compression.scheduler.CompressionScheduler`)
as plain Python ints/bools, which torch.compile guards on: a schedule change recompiles once, it never
breaks the graph.  The ``snip_momentum`` score hook is a tensor hook and is the one path not meant for
torch.compile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.module_inject.functional import copy_to_tp, reduce_from_tp

from . import masks as M
from .quantizer import check_groups, fake_quantize, fake_quantize_activation, quantize
from .tp import TPShard, fake_quantize_sharded, grad_all_reduce, is_tp_linear, sharded_grid

KINDS = ("linear", "conv1d", "conv2d", "embedding")
STATIC_MOMENTUM = 0.9


def kind_of(module: nn.Module) -> str | None:
    """Which supported layer kind ``module`` is (exact types; HF's ``Conv1D`` by class name)."""
    if isinstance(module, CompressedLayer):
        return module.kind
    if is_tp_linear(module):  # AutoTP's column- / row-parallel layers (Conv1D storage: transposed)
        return "conv1d" if module.transposed else "linear"
    if type(module) is nn.Linear:
        return "linear"
    if type(module) is nn.Conv2d:
        return "conv2d"
    if type(module) is nn.Embedding:
        return "embedding"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None:
        return "conv1d"
    return None


@dataclass
class WeightQuantSpec:
    start_bits: int
    target_bits: int
    period: int
    offset: int
    groups: int
    symmetric: bool
    stochastic: bool
    mix_change_ratio: float | None = None  # fp16_mixed_quantize

    def bits_at(self, step: int) -> int:
        if step < self.offset:
            return 0
        if self.period == 0:
            return self.target_bits
        return max(self.target_bits, self.start_bits - (step - self.offset) // self.period)


@dataclass
class ActQuantSpec:
    bits: int
    symmetric: bool
    static: bool
    offset: int


@dataclass
class PruneSpec:
    method: str
    dense_ratio: float
    offset: int
    offset_end: int | None = None
    stride: int = 1
    block: tuple[int, int] = (1, 1)
    num_heads: int = 1
    related: list[list[str]] = field(default_factory=list)

    def ratio_at(self, step: int) -> float:
        """snip_momentum lowers density linearly from 1 at ``offset`` to ``dense_ratio`` at ``offset_end``."""
        end = self.offset_end if self.offset_end is not None else self.offset
        if self.method != "snip_momentum" or end <= self.offset:
            return self.dense_ratio
        frac = min(1.0, max(0.0, (step - self.offset) / (end - self.offset)))
        return 1.0 - (1.0 - self.dense_ratio) * frac


PRUNINGS = ("sparse", "row", "head", "channel")


class CompressedLayer(nn.Module):
    def __init__(self, module: nn.Module, name: str) -> None:
        super().__init__()
        kind = kind_of(module)
        if kind is None:
            raise TypeError(f"{name}: {type(module).__name__} cannot be compressed")
        self.kind = kind
        self.name = name
        self.__dict__["original"] = module  # not a submodule: redundancy_clean reuses it as the final layer
        self.weight = module.weight
        self.bias = getattr(module, "bias", None)
        self.ctor: dict[str, Any] = {}
        self.tp: TPShard | None = TPShard.of(module, name) if is_tp_linear(module) else None
        self.wq_local_groups: int | None = None  # tp: this rank's piece is that many whole groups
        if kind == "conv2d":
            if module.padding_mode != "zeros":
                raise ValueError(f"{name}: Conv2d padding_mode {module.padding_mode!r} is not supported; use 'zeros'")
            self.ctor = dict(stride=module.stride, padding=module.padding, dilation=module.dilation,
                             groups=module.groups)
        elif kind == "embedding":
            self.ctor = dict(padding_idx=module.padding_idx, max_norm=module.max_norm, norm_type=module.norm_type,
                             scale_grad_by_freq=module.scale_grad_by_freq, sparse=module.sparse)
        self.wq: WeightQuantSpec | None = None
        self.aq: ActQuantSpec | None = None
        self.prune: dict[str, PruneSpec] = {}
        self.wq_bits = 0
        self.aq_on = False
        self.act_calibrated = False
        self.on: dict[str, bool] = {}
        self.refresh: dict[str, bool] = {}
        self.ratio: dict[str, float] = {}

    # -- shapes -----------------------------------------------------------------------------------
    def canonical(self, w: torch.Tensor) -> torch.Tensor:
        """The weight in ``(out, in, ...)`` layout (HF Conv1D stores ``(in, out)``)."""
        return w.t() if self.kind == "conv1d" else w

    def stored(self, w: torch.Tensor) -> torch.Tensor:
        return w.t() if self.kind == "conv1d" else w

    @property
    def out_features(self) -> int:
        return self.canonical(self.weight).shape[0]

    @property
    def in_features(self) -> int:
        return self.canonical(self.weight).shape[1]

    @property
    def full_out(self) -> int:
        """Output features of the full (unsharded) weight."""
        return self.tp.full_out if self.tp is not None else self.out_features

    @property
    def full_in(self) -> int:
        return self.tp.full_in if self.tp is not None else self.in_features

    @property
    def tp_splits(self) -> dict[str, Any]:
        """Tensor parallelism: the split of each sharded tensor of this layer (weight, a column layer's
        bias, weight-shaped pruning state), read by ``tp_param_splits``; empty without tp."""
        if self.tp is None:
            return {}
        out = {"weight": self.tp.split}
        if self.tp.bias_split is not None and self.bias is not None:
            out["bias"] = self.tp.bias_split
        if hasattr(self, "sparse_mask_scores"):  # topk's learnable scores: sharded like the weight
            out["sparse_mask_scores"] = self.tp.canon_split
        return out

    # -- configuration (init_compression) -----------------------------------------------------------
    def add_weight_quant(self, spec: WeightQuantSpec) -> None:
        numel = self.weight.numel() if self.tp is None else self.full_out * self.full_in
        what = self.name if self.tp is None else (f"{self.name} (the full weight; tensor parallelism splits it over "
                                                  f"{self.tp.size} ranks)")
        check_groups(numel, spec.groups, what)
        if self.tp is not None:
            self.wq_local_groups = self.tp.local_groups(spec.groups)
        self.wq = spec
        if spec.mix_change_ratio is not None:
            self.register_buffer("wq_mix", torch.zeros(()))

    def add_act_quant(self, spec: ActQuantSpec) -> None:
        if self.kind == "embedding":
            return
        self.aq = spec
        if spec.static:
            self.register_buffer("act_low", torch.zeros(()))
            self.register_buffer("act_high", torch.zeros(()))
            self.register_buffer("act_seen", torch.zeros((), dtype=torch.bool))
            # this step's range, folded into act_low/high (EMA) by the scheduler after a global min/max
            self.register_buffer("act_batch_low", torch.full((), float("inf")), persistent=False)
            self.register_buffer("act_batch_high", torch.full((), float("-inf")), persistent=False)

    def add_pruning(self, what: str, spec: PruneSpec) -> None:
        # tp: masks (and snip_momentum scores) cover the full layer, replicated on every rank (so
        # checkpoints hold them like any buffer); only topk's learnable sparse scores are sharded
        sparse = (self.full_out, self.full_in) if self.tp is not None else self.canonical(self.weight).shape
        if what == "sparse" and self.tp is not None:
            self.tp.weight_shaped_split("sparse pruning")
        shape = {"sparse": sparse, "row": (self.full_out,), "channel": (self.out_features,),
                 "head": (spec.num_heads,)}[what]
        if what == "head" and self.full_in % spec.num_heads:
            raise ValueError(f"{self.name}: {self.full_in} input features do not split into "
                             f"num_heads {spec.num_heads} heads")
        if what == "sparse" and spec.method == "snip_momentum":
            M.block_scores(torch.zeros(shape), spec.block)  # raises if the block pattern does not tile the weight
            self.register_buffer("sparse_snip_score", torch.zeros(shape))
        self.prune[what] = spec
        self.register_buffer(f"{what}_mask", torch.ones(shape))
        self.register_buffer(f"{what}_ready", torch.zeros((), dtype=torch.bool))
        if spec.method == "topk":
            w = self.canonical(self.weight.detach()).float()
            if what == "sparse":
                scores = w.abs()
                top = scores.max() if self.tp is None else self.tp.all_max(scores.max())
            else:
                scores = self._unit_scores(what, w)
                top = scores.max()
            self.register_parameter(f"{what}_mask_scores", nn.Parameter(scores / top.clamp_min(1e-12)))

    # -- schedule ------------------------------------------------------------------------------------
    def set_step(self, step: int) -> None:
        """Apply the schedule for the forward passes of global step ``step`` (called outside forward)."""
        if self.wq is not None:
            self.wq_bits = self.wq.bits_at(step)
            if self.wq.mix_change_ratio is not None:
                self.wq_mix.fill_(max(0.0, 1.0 - self.wq.mix_change_ratio * max(0, step - self.wq.offset + 1)))
        if self.aq is not None:
            self.aq_on = step >= self.aq.offset
            self.act_calibrated = bool(self.act_seen) if self.aq.static else True
        for what, spec in self.prune.items():
            on = step >= spec.offset
            self.on[what] = on
            self.ratio[what] = spec.ratio_at(step)
            if not on or spec.method == "topk":
                self.refresh[what] = False
                continue
            end = spec.offset_end if (what == "sparse" and spec.offset_end is not None) else spec.offset
            in_window = spec.offset <= step <= end and (step - spec.offset) % spec.stride == 0
            self.refresh[what] = in_window or not bool(getattr(self, f"{what}_ready"))

    # -- masks ---------------------------------------------------------------------------------------
    def _unit_scores(self, what: str, w: torch.Tensor) -> torch.Tensor:
        """L1 norm of each row / channel (``(full_out,)``) or head (``(num_heads,)``) of the full weight;
        under tp the shards' partial norms summed over the tp group."""
        if self.tp is None:
            return M.head_scores(w, self.prune[what].num_heads) if what == "head" else M.row_scores(w)
        absw = w.detach().float().abs()
        if what == "head":
            cols = torch.zeros(self.full_in).index_add_(0, self.tp.cols, absw.sum(dim=0))
            return self.tp.all_sum(cols).view(self.prune[what].num_heads, -1).sum(dim=1)
        return self.tp.all_sum(torch.zeros(self.full_out).index_add_(0, self.tp.rows, absw.sum(dim=1)))

    def _sparse_top(self, scores: torch.Tensor) -> torch.Tensor:
        """The sparse keep-mask of the full layer's canonical ``scores``."""
        spec = self.prune["sparse"]
        if spec.method == "snip_momentum":
            return M.expand_blocks(M.top_mask(M.block_scores(scores, spec.block), self.ratio["sparse"]), spec.block,
                                   scores.shape)
        return M.top_mask(scores, self.ratio["sparse"])

    def _local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's canonical piece of a full ``(out, in)`` tensor (itself without tp)."""
        return full if self.tp is None else full[self.tp.rows[:, None], self.tp.cols[None, :]]

    @torch.no_grad()
    def sync_tp_state(self) -> None:
        """After an optimizer step (the scheduler calls it): every rank's snip_momentum scores, updated on
        its own piece in the backward, gathered into the full replicated tensor (collective over tp)."""
        if self.tp is not None and hasattr(self, "sparse_snip_score"):
            self.sparse_snip_score.copy_(self.tp.gather_full(self._local(self.sparse_snip_score)))

    @torch.no_grad()
    def _recompute(self, what: str, w: torch.Tensor) -> None:
        if what == "sparse":
            if self.prune[what].method == "snip_momentum":
                scores = self.sparse_snip_score
            else:
                scores = w.abs() if self.tp is None else self.tp.gather_full(w.detach().abs())
            mask = self._sparse_top(scores)
        else:
            mask = M.top_mask(self._unit_scores(what, w), self.ratio[what])
        getattr(self, f"{what}_mask").copy_(mask)
        getattr(self, f"{what}_ready").fill_(True)
        self.refresh[what] = False

    def full_mask(self, what: str) -> torch.Tensor:
        """The current {0,1} mask of the full layer (sparse: canonical ``(out, in)``), no gradient."""
        if self.prune[what].method == "topk":
            scores = getattr(self, f"{what}_mask_scores").detach()
            if what == "sparse":
                return self._sparse_top(scores if self.tp is None else self.tp.gather_full(scores))
            return M.top_mask(scores, self.ratio[what])
        return getattr(self, f"{what}_mask")

    def mask(self, what: str, for_bias: bool = False) -> torch.Tensor:
        """The current {0,1} mask as this layer's forward applies it (for topk: with the straight-through
        gradient to the scores).  Sparse: canonical, local; row / channel: ``(out,)`` local rows; head:
        ``(num_heads,)``.  ``for_bias``: the mask of a replicated (row-parallel) bias, whose gradient to a
        replicated score is taken from tp rank 0 alone."""
        spec = self.prune[what]
        if what == "sparse":
            m = self._local(self.full_mask(what))
            if spec.method == "topk":
                m = M.straight_through(m, self.sparse_mask_scores)
        elif spec.method != "topk":
            m = self.full_mask(what)
        else:
            scores = getattr(self, f"{what}_mask_scores")
            top = M.top_mask(scores, self.ratio[what])
            if self.tp is not None:
                scores = grad_all_reduce(scores, self.tp)  # every rank runs it (its backward is a collective)
                if for_bias and self.tp.kind == "row" and self.tp.rank != 0:
                    scores = scores * 0.0
            m = M.straight_through(top, scores)
        if self.tp is not None and what in ("row", "channel") and not (for_bias and self.tp.kind == "row"):
            m = m[self.tp.rows]
        return m

    def _structured(self, w: torch.Tensor) -> torch.Tensor | None:
        """The product of the row / channel / head masks broadcast to ``w`` (canonical), or None."""
        total = None
        for what in ("row", "channel"):
            if what in self.prune and self.on.get(what, False):
                m = self.mask(what).to(w.dtype).view(-1, *([1] * (w.dim() - 1)))
                total = m if total is None else total * m
        if "head" in self.prune and self.on.get("head", False):
            heads = self.prune["head"].num_heads
            m = self.mask("head").to(w.dtype).repeat_interleave(self.full_in // heads)
            if self.tp is not None:
                m = m[self.tp.cols]
            m = m.view(1, -1)
            total = m if total is None else total * m
        return total

    def element_grid(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each element's scale and zero point (None: symmetric) of the current weight grid of the masked
        canonical weight ``w`` (redundancy_clean re-encodes the simulated values on it)."""
        if self.tp is not None and self.wq_local_groups is None:
            _, scale, zero = sharded_grid(w, self.wq_bits, self.wq.groups, self.wq.symmetric, False, self.tp)
            return scale, zero
        groups = self.wq_local_groups if self.tp is not None else self.wq.groups
        _, scale, zero = quantize(w, self.wq_bits, groups, self.wq.symmetric)
        per = w.numel() // groups
        return scale.repeat_interleave(per).view_as(w), None if zero is None else zero.repeat_interleave(per).view_as(w)

    def effective_weight(self, grid: list[Any] | None = None) -> torch.Tensor:
        """The weight the forward uses, canonical layout (``grid``: a list that receives
        :meth:`element_grid` of it, when the weight is quantized)."""
        w = self.canonical(self.weight)
        for what in PRUNINGS:
            if self.refresh.get(what, False):
                self._recompute(what, w)
        struct = self._structured(w)
        if struct is not None:
            w = w * struct
        if "sparse" in self.prune and self.on.get("sparse", False):
            w = w * self.mask("sparse").to(w.dtype)
            if self.prune["sparse"].method == "snip_momentum" and self.training and torch.is_grad_enabled():
                w.register_hook(self._snip_hook(w.detach()))
        if self.wq is not None and self.wq_bits:
            if grid is not None:
                grid.append(self.element_grid(w.detach()))
            stochastic = self.wq.stochastic and self.training
            if self.tp is not None and self.wq_local_groups is None:  # groups straddle the tp shards
                q = fake_quantize_sharded(w, self.wq_bits, self.wq.groups, self.wq.symmetric, stochastic, self.tp)
            else:
                groups = self.wq_local_groups if self.tp is not None else self.wq.groups
                q = fake_quantize(w, self.wq_bits, groups, self.wq.symmetric, stochastic)
            w = q if self.wq.mix_change_ratio is None else self.wq_mix * w + (1 - self.wq_mix) * q
            if struct is not None:
                w = w * struct
        return w

    def effective_bias(self) -> torch.Tensor | None:
        if self.bias is None:
            return None
        b = self.bias
        for what in ("row", "channel"):
            if what in self.prune and self.on.get(what, False):
                b = b * self.mask(what, for_bias=True).to(b.dtype)
        return b

    def _snip_hook(self, w: torch.Tensor) -> Any:
        def hook(grad: torch.Tensor) -> None:
            with torch.no_grad():
                score = (w * grad).abs().float()
                if self.tp is None:
                    self.sparse_snip_score.mul_(0.9).add_(score)
                else:  # this rank's piece of the full scores (the others' pieces arrive at the step)
                    index = (self.tp.rows[:, None], self.tp.cols[None, :])
                    self.sparse_snip_score.index_put_(index, self.sparse_snip_score[index].mul_(0.9).add_(score))
        return hook

    # -- forward ------------------------------------------------------------------------------------
    def _input_range(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """The range of a row-parallel layer's input over the tp group (its last dim is sharded);
        ``(None, None)`` where the local tensor is the whole input."""
        if self.tp is None or self.tp.kind != "row":
            return None, None
        xf = x.detach().float()
        ends = self.tp.all_max(torch.stack([xf.amax(), -xf.amin()]))
        return -ends[1], ends[0]

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.aq is None or not self.aq_on:
            return x
        if "head" in self.prune and self.on.get("head", False):
            # pruned heads' input columns meet zero weights; zeroed here too, they leave the activation range
            # as it is once redundancy_clean has removed them (the output is unchanged: w has zeros there)
            m = self.full_mask("head").to(x.dtype).repeat_interleave(self.full_in // self.prune["head"].num_heads)
            x = x * (m[self.tp.cols] if self.tp is not None else m)
        low, high = self._input_range(x)
        if not self.aq.static:
            return fake_quantize_activation(x, self.aq.bits, self.aq.symmetric, low, high)
        if self.training:
            with torch.no_grad():
                if low is None:
                    xf = x.detach().float()
                    low, high = xf.amin(), xf.amax()
                torch.minimum(self.act_batch_low, low, out=self.act_batch_low)
                torch.maximum(self.act_batch_high, high, out=self.act_batch_high)
        if not self.act_calibrated:
            return x  # the first step only calibrates the range
        return fake_quantize_activation(x, self.aq.bits, self.aq.symmetric, self.act_low, self.act_high)

    @torch.no_grad()
    def fold_activation_range(self) -> None:
        """After a step (and the scheduler's global min/max of the batch range): update the EMA."""
        if not torch.isfinite(self.act_batch_low) or not torch.isfinite(self.act_batch_high):
            return
        m = STATIC_MOMENTUM if bool(self.act_seen) else 0.0
        self.act_low.mul_(m).add_((1 - m) * self.act_batch_low)
        self.act_high.mul_(m).add_((1 - m) * self.act_batch_high)
        self.act_seen.fill_(True)
        self.act_batch_low.fill_(float("inf"))
        self.act_batch_high.fill_(float("-inf"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.effective_weight()
        b = self.effective_bias()
        if self.tp is not None:  # AutoTP's column / row layer: its communication around the local matmul
            if self.tp.kind == "column":
                return F.linear(self.quantize_input(copy_to_tp(x, self.tp.group, self.tp.size)), w, b)
            out = reduce_from_tp(F.linear(self.quantize_input(x), w), self.tp.group, self.tp.size)
            return out + b if b is not None else out
        if self.kind == "embedding":
            return F.embedding(x, w, **{k: v for k, v in self.ctor.items()})
        x = self.quantize_input(x)
        if self.kind == "conv2d":
            return F.conv2d(x, w, b, **self.ctor)
        return F.linear(x, w, b)

    def extra_repr(self) -> str:
        parts = [f"{self.kind} {self.name}", f"weight={tuple(self.weight.shape)}"]
        if self.tp is not None:
            parts.append(f"tp {self.tp.kind}-parallel {self.tp.rank}/{self.tp.size} of ({self.full_out}, {self.full_in})")
        if self.wq is not None:
            parts.append(f"wbits={self.wq.start_bits}->{self.wq.target_bits}")
        if self.aq is not None:
            parts.append(f"abits={self.aq.bits}")
        parts += [f"{k}_pruning({v.method}, {v.dense_ratio})" for k, v in self.prune.items()]
        return ", ".join(parts)
