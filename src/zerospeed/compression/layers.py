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

from . import masks as M
from .quantizer import check_groups, fake_quantize, fake_quantize_activation

KINDS = ("linear", "conv1d", "conv2d", "embedding")
STATIC_MOMENTUM = 0.9


def kind_of(module: nn.Module) -> str | None:
    """Which supported layer kind ``module`` is (exact types; HF's ``Conv1D`` by class name)."""
    if isinstance(module, CompressedLayer):
        return module.kind
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

    # -- configuration (init_compression) -----------------------------------------------------------
    def add_weight_quant(self, spec: WeightQuantSpec) -> None:
        check_groups(self.weight.numel(), spec.groups, self.name)
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
        shape = {"sparse": self.canonical(self.weight).shape, "row": (self.out_features,),
                 "channel": (self.out_features,), "head": (spec.num_heads,)}[what]
        if what == "head" and self.in_features % spec.num_heads:
            raise ValueError(f"{self.name}: {self.in_features} input features do not split into "
                             f"num_heads {spec.num_heads} heads")
        if what == "sparse" and spec.method == "snip_momentum":
            M.block_scores(torch.zeros(shape), spec.block)  # raises if the block pattern does not tile
            self.register_buffer("sparse_snip_score", torch.zeros(shape))
        self.prune[what] = spec
        self.register_buffer(f"{what}_mask", torch.ones(shape))
        self.register_buffer(f"{what}_ready", torch.zeros((), dtype=torch.bool))
        if spec.method == "topk":
            init = {"sparse": lambda w: w.abs(), "row": M.row_scores, "channel": M.row_scores,
                    "head": lambda w: M.head_scores(w, spec.num_heads)}[what]
            scores = init(self.canonical(self.weight.detach()).float())
            self.register_parameter(f"{what}_mask_scores", nn.Parameter(scores / scores.max().clamp_min(1e-12)))

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
    def _scores(self, what: str, w: torch.Tensor) -> torch.Tensor:
        spec = self.prune[what]
        if what == "sparse":
            if spec.method == "snip_momentum":
                return M.block_scores(self.sparse_snip_score, spec.block)
            return w.abs()
        if what == "head":
            return M.head_scores(w, spec.num_heads)
        return M.row_scores(w)

    @torch.no_grad()
    def _recompute(self, what: str, w: torch.Tensor) -> None:
        spec = self.prune[what]
        mask = M.top_mask(self._scores(what, w), self.ratio[what])
        if what == "sparse" and spec.method == "snip_momentum":
            mask = M.expand_blocks(mask, spec.block, w.shape)
        getattr(self, f"{what}_mask").copy_(mask)
        getattr(self, f"{what}_ready").fill_(True)
        self.refresh[what] = False

    def mask(self, what: str) -> torch.Tensor:
        """The current {0,1} mask (for topk: with the straight-through gradient to the scores)."""
        if self.prune[what].method == "topk":
            scores = getattr(self, f"{what}_mask_scores")
            return M.straight_through(M.top_mask(scores, self.ratio[what]), scores)
        return getattr(self, f"{what}_mask")

    def _structured(self, w: torch.Tensor) -> torch.Tensor | None:
        """The product of the row / channel / head masks broadcast to ``w`` (canonical), or None."""
        total = None
        for what in ("row", "channel"):
            if what in self.prune and self.on.get(what, False):
                m = self.mask(what).to(w.dtype).view(-1, *([1] * (w.dim() - 1)))
                total = m if total is None else total * m
        if "head" in self.prune and self.on.get("head", False):
            heads = self.prune["head"].num_heads
            m = self.mask("head").to(w.dtype).repeat_interleave(w.shape[1] // heads).view(1, -1)
            total = m if total is None else total * m
        return total

    def effective_weight(self) -> torch.Tensor:
        """The weight the forward uses, canonical layout."""
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
            q = fake_quantize(w, self.wq_bits, self.wq.groups, self.wq.symmetric, self.wq.stochastic and self.training)
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
                b = b * self.mask(what).to(b.dtype)
        return b

    def _snip_hook(self, w: torch.Tensor) -> Any:
        def hook(grad: torch.Tensor) -> None:
            with torch.no_grad():
                self.sparse_snip_score.mul_(0.9).add_((w * grad).abs().float())
        return hook

    # -- forward ------------------------------------------------------------------------------------
    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.aq is None or not self.aq_on:
            return x
        if not self.aq.static:
            return fake_quantize_activation(x, self.aq.bits, self.aq.symmetric)
        if self.training:
            with torch.no_grad():
                xf = x.detach().float()
                torch.minimum(self.act_batch_low, xf.amin(), out=self.act_batch_low)
                torch.maximum(self.act_batch_high, xf.amax(), out=self.act_batch_high)
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
        if self.kind == "embedding":
            return F.embedding(x, w, **{k: v for k, v in self.ctor.items()})
        x = self.quantize_input(x)
        if self.kind == "conv2d":
            return F.conv2d(x, w, b, **self.ctor)
        return F.linear(x, w, b)

    def extra_repr(self) -> str:
        parts = [f"{self.kind} {self.name}", f"weight={tuple(self.weight.shape)}"]
        if self.wq is not None:
            parts.append(f"wbits={self.wq.start_bits}->{self.wq.target_bits}")
        if self.aq is not None:
            parts.append(f"abits={self.aq.bits}")
        parts += [f"{k}_pruning({v.method}, {v.dense_ratio})" for k, v in self.prune.items()]
        return ", ".join(parts)
