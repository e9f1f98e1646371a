"""Packed low-bit layers: ``QuantizedLinear`` and ``QuantizedEmbedding``.

Storage (all buffers, so ``state_dict``/safetensors hold exactly these bytes):
``qweight`` — the ``(out, in)`` weight's codes packed by :func:`~.quantizer.pack` (int8 for 5-8 bits,
two 4-bit codes per byte for 3-4 bits, four ternary / eight binary codes per byte, int16 above 8);
``scale`` (and ``zero`` when asymmetric) — one fp32 value per group of ``group_size`` consecutive weights
of the flattened weight; ``bias`` stays floating point.

Kernels, chosen per call from what the layout allows (measured on this machine's CPU with torch 2.13,
one thread, a 64x768 @ 768x3072 matmul: fp32 2.5 ms; ``torch._int_mm`` 1.1 ms;
``aten._weight_int8pack_mm`` 98 ms in fp32 and 4.2 ms in bf16; ``aten._weight_int4pack_mm_for_cpu``
278 ms fp32 / 10 ms bf16):

* int8 activations (``act_bits == 8``, symmetric) with a symmetric weight of <= 8 bits whose groups
  cover whole rows: the input is quantized per tensor and multiplied with ``torch._int_mm`` (int8 x int8
  -> int32), then scaled per output row.  Codes narrower than 8 bits are unpacked to int8 first.
* weight-only, groups covering whole rows: ``linear(x, codes)`` in the input's dtype, then the per-row
  scale (one conversion of the codes, no per-group multiply).
* otherwise (groups inside a row, asymmetric with activations, > 8 bits): dequantize per group, then
  ``linear``.
The int8/int4 ``_weight_int*pack_mm`` ops are not used: on this CPU they are slower than dequantizing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .quantizer import container_bits, dequantize, fake_quantize_activation, pack, quantize, unpack


def _int_mm_available() -> bool:
    try:
        a = torch.ones(2, 8, dtype=torch.int8)
        return bool((torch._int_mm(a, a.t()) == 8).all())
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


INT_MM = _int_mm_available()


class _Packed(nn.Module):
    """Shared storage and decoding of a packed 2-D weight."""

    def __init__(self, rows: int, cols: int, bits: int, group_size: int, symmetric: bool) -> None:
        super().__init__()
        numel = rows * cols
        if bits < 1 or bits > 16:
            raise ValueError(f"{bits} bits is not supported; use 1..16")
        if group_size < 1 or numel % group_size:
            raise ValueError(f"group_size {group_size} does not divide the weight's {numel} elements "
                             f"({rows}x{cols})")
        self.rows, self.cols, self.bits, self.group_size = rows, cols, bits, group_size
        self.symmetric = symmetric or bits <= 2
        self.num_groups = numel // group_size
        width = container_bits(bits)
        if width == 16:
            packed = torch.zeros(numel, dtype=torch.int16)
        elif width == 8:
            packed = torch.zeros(numel, dtype=torch.int8 if self.symmetric else torch.uint8)
        else:
            packed = torch.zeros(-(-numel // (8 // width)), dtype=torch.uint8)
        self.register_buffer("qweight", packed)
        self.register_buffer("scale", torch.ones(self.num_groups))
        if not self.symmetric:
            self.register_buffer("zero", torch.zeros(self.num_groups))
        else:
            self.zero = None

    @property
    def rows_per_group(self) -> int:
        """Groups span whole rows (> 0: rows per group) or not (0)."""
        return self.group_size // self.cols if self.group_size % self.cols == 0 else 0

    def load_weight(self, weight: torch.Tensor, scale: torch.Tensor | None = None,
                    zero: torch.Tensor | None = None) -> None:
        """Quantize ``weight``; with ``scale`` (and ``zero``) given per group, only round to that grid
        (used to re-encode already fake-quantized values exactly)."""
        if scale is None:
            q, scale, zero = quantize(weight.detach().float(), self.bits, self.num_groups, self.symmetric)
        else:
            g = weight.detach().float().reshape(self.num_groups, -1)
            q = torch.round(g / scale[:, None])
            if zero is not None:
                q = q + zero[:, None]
            q = q.view_as(weight)
        self.qweight.copy_(pack(q, self.bits, zero_offset=self.symmetric))
        self.scale.copy_(scale)
        if zero is not None:
            self.zero.copy_(zero)

    def codes(self) -> torch.Tensor:
        """Integer codes, ``(rows, cols)``."""
        return unpack(self.qweight, self.bits, self.rows * self.cols, self.symmetric).view(self.rows, self.cols)

    def row_scale(self) -> torch.Tensor:
        """One scale per output row (groups covering whole rows), cached until ``scale`` changes."""
        key = (self.scale.data_ptr(), self.scale._version)
        cached = self.__dict__.get("_row_scale")
        if cached is None or cached[0] != key:
            cached = (key, self.scale.repeat_interleave(self.rows_per_group))
            self.__dict__["_row_scale"] = cached
        return cached[1]

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.codes(), self.scale, self.zero, self.num_groups).to(dtype)

    def storage_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


class QuantizedLinear(_Packed):
    """``y = x @ dequant(qweight).T + bias`` computed with low-precision kernels where possible."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int | None = None,
                 symmetric: bool = True, bias: bool = True, act_bits: int = 0, act_symmetric: bool = True,
                 act_static: bool = False) -> None:
        super().__init__(out_features, in_features, bits, group_size or in_features, symmetric)
        self.in_features, self.out_features = in_features, out_features
        if act_bits and not 1 < act_bits <= 16:
            raise ValueError(f"act_bits {act_bits} is not supported; use 0 (off) or 2..16")
        self.act_bits, self.act_symmetric, self.act_static = act_bits, act_symmetric, act_static
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        if act_static:
            self.register_buffer("act_low", torch.zeros(()))
            self.register_buffer("act_high", torch.zeros(()))

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, bits: int, group_size: int | None = None,
                    symmetric: bool = True, act_bits: int = 0, act_symmetric: bool = True,
                    act_range: tuple[torch.Tensor, torch.Tensor] | None = None,
                    scale: torch.Tensor | None = None, zero: torch.Tensor | None = None) -> QuantizedLinear:
        """Quantize an ``(out, in)`` weight (and keep ``bias`` in floating point); ``scale``/``zero``
        per group re-encode values already on that grid."""
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, bits, group_size, symmetric, bias is not None, act_bits,
                    act_symmetric, act_range is not None)
        layer.load_weight(weight, scale, zero)
        if bias is not None:
            layer.bias.data.copy_(bias.detach().float())
        if act_range is not None:
            layer.act_low.copy_(act_range[0])
            layer.act_high.copy_(act_range[1])
        return layer

    @property
    def kernel(self) -> str:
        """Which path :meth:`forward` takes: ``int_mm``, ``rowscale`` or ``dequant``."""
        if (INT_MM and self.act_bits == 8 and self.act_symmetric and self.symmetric and self.bits <= 8
                and self.rows_per_group):
            return "int_mm"
        if not self.act_bits and self.rows_per_group and self.bits <= 8:
            return "rowscale"
        return "dequant"

    def _act_range(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (self.act_low, self.act_high) if self.act_static else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel
        flat = x.reshape(-1, self.in_features)
        if kernel == "int_mm":
            low, high = self._act_range()
            if low is None:  # max |x| in one op (the inf-norm is exact); few ops matter on a busy CPU
                x_scale = (torch.linalg.vector_norm(flat.detach(), float("inf")).float() / 127).clamp_min(1e-12)
            else:
                x_scale = (torch.maximum(low.abs(), high.abs()).float() / 127).clamp_min(1e-12)
            # the same rounding as fake_quantize_activation: round(x / s), clamped
            xq = torch.div(flat, x_scale).round_().clamp_(-127, 127).to(torch.int8)
            acc = torch._int_mm(xq, self.codes().t())
            # int32 -> fp32 scaled, written over the int32 accumulator (same size): one big tensor, not two
            y = torch.mul(acc, x_scale * self.row_scale(), out=acc.view(torch.float32))
            if self.bias is not None:
                y.add_(self.bias)
            return y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        if self.act_bits:
            low, high = self._act_range()
            flat = fake_quantize_activation(flat, self.act_bits, self.act_symmetric, low, high)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if kernel == "rowscale" and flat.shape[0] < self.in_features:
            # few tokens: scaling the (tokens x out) output is cheaper than the (out x in) weight
            codes = self.codes().to(x.dtype)
            if self.zero is not None:
                codes = codes - self.zero.repeat_interleave(self.rows_per_group)[:, None].to(x.dtype)
            y = F.linear(flat, codes)
            y.mul_(self.row_scale().to(x.dtype))
            if bias is not None:
                y.add_(bias)
        else:
            y = F.linear(flat, self.dequantized(x.dtype), bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        act = f", act_bits={self.act_bits}" if self.act_bits else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, symmetric={self.symmetric}{act}, kernel={self.kernel}")


class QuantizedEmbedding(_Packed):
    """An embedding table stored packed; looked-up rows are dequantized."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bits: int, group_size: int | None = None,
                 symmetric: bool = True, padding_idx: int | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, bits, group_size or embedding_dim, symmetric)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bits: int, group_size: int | None = None, symmetric: bool = True,
                    padding_idx: int | None = None) -> QuantizedEmbedding:
        layer = cls(weight.shape[0], weight.shape[1], bits, group_size, symmetric, padding_idx)
        layer.load_weight(weight)
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.rows_per_group:
            rows = self.codes()[idx].float()
            group = idx // self.rows_per_group
            if self.zero is not None:
                rows = rows - self.zero[group][..., None]
            return rows * self.scale[group][..., None]
        return F.embedding(idx, self.dequantized())

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, bits={self.bits}, group_size={self.group_size}, "
                f"symmetric={self.symmetric}")
