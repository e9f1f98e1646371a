"""Packed low-bit layers: ``QuantizedLinear`` and ``QuantizedEmbedding``.

Storage (all buffers, so ``state_dict``/safetensors hold exactly these bytes):
``qweight`` — the ``(out, in)`` weight's codes packed by :func:`~.quantizer.pack` (int8 for 5-8 bits,
two 4-bit codes per byte for 3-4 bits, four ternary / eight binary codes per byte, int16 above 8);
``scale`` (and ``zero`` when asymmetric) — one fp32 value per group of ``group_size`` consecutive weights
of the flattened weight; ``bias`` stays floating point.

Kernels, chosen per call from what the layout allows (the fastest first).  Measured on this machine's
CPU (Xeon with AVX-512 VNNI and AMX), torch 2.13, one thread, a 1024-token batch, the demo GPT's shapes;
fp32 ``F.linear`` 1024x192 @ 192x576 1.46 ms, 1024x768 @ 768x192 2.0 ms:

* ``onednn`` -- int8 activations (``act_bits == 8``, symmetric) with a symmetric weight of <= 8 bits
  whose groups cover whole rows: the input is quantized per tensor (``aminmax`` for the dynamic range,
  one fused ``quantize_per_tensor`` pass whose int8 storage is read in place) and multiplied by
  oneDNN's int8 GEMM (``torch.ops.onednn.qlinear_pointwise``, AMX/VNNI; the prepacked weight is
  cached next to ``qweight``) with the per-tensor input scale, the per-row weight scales and the bias
  applied inside the kernel, fp32 out: 0.39 ms and 0.99 ms for the two shapes above (0.27x and
  0.49x fp32; the GEMM itself is 0.2 ms, the rest is quantizing the input).
* ``int_mm`` -- the same numerics through ``torch._int_mm`` (int8 x int8 -> int32) and a scaling pass,
  where oneDNN's op is missing: 0.3 ms GEMM + ~0.35 ms of scaling at the first shape; and, in the
  automatic choice, for inputs of fewer than :data:`ONEDNN_MIN_ROWS` tokens (decode steps): there
  oneDNN's op costs as much or more (~65 us from 2 to 32 tokens, and 1-4 ms for a single token at some
  shapes, where it reorders the weight per call), ``_int_mm`` ~50-70 us.  Either way a few-token int8
  layer costs more than fp32 (5-50 us at these small shapes): the fixed cost of quantizing the input
  (a dozen small ops) outweighs the GEMM; int8 pays off from ~32 tokens per call on these shapes.
* ``rowscale`` -- weight-only, groups covering whole rows: ``linear(x, codes)`` in the input's dtype,
  then the per-row scale (one conversion of the codes, no per-group multiply).
* ``dequant`` -- the reference: dequantize per group, fake-quantize the input when ``act_bits`` is set
  (exactly the training-time simulation), then ``linear``.  Everything else (groups inside a row,
  asymmetric with activations, > 8 bits) takes it; tests compare the fast kernels against it.

The int8-activation kernels read the input's scale as a Python number (the fused quantization takes
a float), so under ``torch.compile`` each such layer is a graph break; ``rowscale`` and ``dequant`` trace.

Not used, measured at the same shapes: ``aten._weight_int8pack_mm`` (fp32 73-119 ms, bf16 1.2-5 ms:
slower than dequantizing), ``aten._weight_int4pack_mm_for_cpu`` (slower still), fbgemm's dynamic
``quantized::linear_dynamic`` (0.58 ms and 0.88 ms: asymmetric uint8 input, so not the simulated
numerics, and its packed weight is an opaque object), torchao 0.18's ``Int8DynamicActivationInt8WeightConfig``
(5.3 ms: unfused per-token quantization in eager mode) and ``Int8WeightOnlyConfig`` (1.8-2.3 ms).
``torch.linalg.vector_norm(x, inf)`` for the input range took 0.5-2.3 ms (more than the GEMM);
``torch.aminmax`` takes 0.04-0.17 ms.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .quantizer import container_bits, dequantize, fake_quantize_activation, pack, quantize, unpack


def _int_mm_available() -> bool:
    try:
        # full-range codes: without VNNI, oneDNN's s8 GEMM saturates int16 pair sums (127 * 127 * 2)
        a = torch.tensor([[127, 127, -127, 127] * 4, [-127, 1, 127, -127] * 4], dtype=torch.int8)
        return torch.equal(torch._int_mm(a, a.t()), a.int() @ a.int().t())
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


INT_MM = _int_mm_available()

_ZERO = torch.zeros((), dtype=torch.long)


def _int8_view(q: torch.Tensor) -> torch.Tensor:
    """The int8 codes of a ``torch.qint8`` tensor, read in place (``int_repr`` would copy them)."""
    return torch.empty(0, dtype=torch.int8).set_(q.untyped_storage(), q.storage_offset(), q.shape, q.stride())


def _fused_quantize_available() -> bool:
    """``torch.quantize_per_tensor`` to qint8 exists and its codes, read in place, are ``round(x / s)``.

    torch 2.13 marks the quantized tensor types deprecated (a one-time warning, silenced here); when
    they go, this returns False and the input is quantized with three plain ops instead."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
            scale = x.abs().max() / 127
            q = _int8_view(torch.quantize_per_tensor(x, float(scale), 0, torch.qint8))
            return torch.equal(q, torch.div(x, scale).round().to(torch.int8))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


FUSED_QUANT = _fused_quantize_available()


def _quantize_input(flat: torch.Tensor, x_scale: torch.Tensor, static: bool) -> torch.Tensor:
    """``round(x / s)`` clamped to the symmetric int8 grid, as int8 (what ``fake_quantize_activation``
    computes).  Dynamic ranges put every value inside +-127 by construction, so one fused
    ``quantize_per_tensor`` pass does it (0.14 ms against 0.46 ms for divide, round, cast on a
    1024x768 input); a static range may be exceeded and is clamped to +-127 explicitly."""
    if static or not FUSED_QUANT:
        return torch.div(flat, x_scale).round_().clamp_(-127, 127).to(torch.int8)
    return _int8_view(torch.quantize_per_tensor(flat, float(x_scale), 0, torch.qint8))


def _onednn_available() -> bool:
    """oneDNN's int8 linear exists and agrees with ``torch._int_mm`` on a small case."""
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(4, 16, generator=gen)
        w = torch.randint(-127, 128, (8, 16), generator=gen, dtype=torch.int8)
        w_scale, bias = torch.rand(8, generator=gen) + 0.5, torch.randn(8, generator=gen)
        x_scale = torch.aminmax(x)[1].clamp_min(x.abs().max()) / 127
        xq = _quantize_input(x, x_scale, False)
        if not torch.equal(xq, torch.div(x, x_scale).round().to(torch.int8)):
            return False
        y = torch.ops.onednn.qlinear_pointwise.tensor(
            xq, x_scale, _ZERO, torch.ops.onednn.qlinear_prepack(w, None), w_scale, torch.zeros(8, dtype=torch.long),
            bias, 1.0, 0, torch.float32, "none", [], "")
        ref = (xq.float() @ w.float().t()) * x_scale * w_scale + bias
        return bool(torch.allclose(y, ref, rtol=1e-5, atol=1e-5))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


ONEDNN = _onednn_available()
#: below this many input rows the automatic choice takes ``int_mm`` over ``onednn`` (see the docstring)
ONEDNN_MIN_ROWS = 128
#: every kernel name, fastest first; ``dequant`` is the reference every layout can take
KERNELS = ("onednn", "int_mm", "rowscale", "dequant")


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
        cached = self.__dict__.get("_cache_row_scale")
        if cached is None or cached[0] != key:
            cached = (key, self.scale.repeat_interleave(self.rows_per_group))
            self.__dict__["_cache_row_scale"] = cached
        return cached[1]

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module's signature
        """Dtype casts (``model.to(torch.bfloat16)``, ``.half()``) leave the floating-point buffers (scales,
        zero points, static ranges) in fp32, where their precision is part of the format; device moves apply."""
        kept = {n: b for n, b in self._buffers.items() if b is not None and b.is_floating_point()}
        out = super()._apply(fn, recurse)
        for name, old in kept.items():
            new = self._buffers[name]
            if new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        return out

    def __getstate__(self) -> dict:
        # caches (the oneDNN prepacked weight is an opaque tensor) are rebuilt on demand, never copied
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_cache_")}

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
        """Which path :meth:`forward` takes (see the module docstring): the one set by
        :meth:`use_kernel`, else the fastest this layout allows."""
        forced = self.__dict__.get("kernel_override")
        return forced if forced is not None else self.available_kernels()[0]

    def available_kernels(self) -> tuple[str, ...]:
        """The kernels this layer's layout can take, fastest first (``dequant`` always). ``onednn`` and
        ``int_mm`` were probed on the CPU at import and run the CPU's int8 ops: only for a layer on the CPU."""
        int8_act = (self.act_bits == 8 and self.act_symmetric and self.symmetric and self.bits <= 8
                    and bool(self.rows_per_group) and self.qweight.device.type == "cpu")
        found = []
        if int8_act and ONEDNN:
            found.append("onednn")
        if int8_act and INT_MM:
            found.append("int_mm")
        if not self.act_bits and self.rows_per_group and self.bits <= 8:
            found.append("rowscale")
        return (*found, "dequant")

    def use_kernel(self, name: str | None) -> QuantizedLinear:
        """Force ``name`` (one of :data:`KERNELS` this layout allows), or ``None`` for the fastest."""
        if name is not None and name not in self.available_kernels():
            raise ValueError(f"QuantizedLinear: kernel {name!r} is not available for this layer (bits={self.bits}, "
                             f"act_bits={self.act_bits}, group_size={self.group_size}); available: "
                             f"{', '.join(self.available_kernels())}")
        self.__dict__["kernel_override"] = name
        return self

    def _act_range(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (self.act_low, self.act_high) if self.act_static else (None, None)

    def _input_scale(self, flat: torch.Tensor, act_range: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The per-tensor symmetric int8 scale of the input: its own range, the given one, or the static one."""
        low, high = act_range if act_range is not None else self._act_range()
        if low is None:
            low, high = torch.aminmax(flat.detach())
        return (torch.maximum(low.abs(), high.abs()).float() / 127).clamp_min(1e-12)

    def _packed_weight(self) -> torch.Tensor:
        """oneDNN's prepacked int8 weight, cached until ``qweight`` changes."""
        key = (self.qweight.data_ptr(), self.qweight._version)
        cached = self.__dict__.get("_cache_packed")
        if cached is None or cached[0] != key:
            cached = (key, torch.ops.onednn.qlinear_prepack(self.codes().contiguous(), None),
                      torch.zeros(self.rows, dtype=torch.long))
            self.__dict__["_cache_packed"] = cached
        return cached[1], cached[2]

    def forward(self, x: torch.Tensor, act_range: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``act_range``: the input's ``(low, high)`` to quantize it with, in place of its own range (a
        tensor-parallel shard of a larger input, see :class:`~.tp.TPCleanedLinear`); it must contain ``x``."""
        kernel = self.kernel
        flat = x.reshape(-1, self.in_features)
        if (kernel == "onednn" and flat.shape[0] < ONEDNN_MIN_ROWS and INT_MM
                and self.__dict__.get("kernel_override") is None):
            kernel = "int_mm"
        if kernel in ("onednn", "int_mm"):
            flat = flat.detach().to(torch.float32).contiguous()
            x_scale = self._input_scale(flat, act_range)
            xq = _quantize_input(flat, x_scale, self.act_static)
            if kernel == "onednn":
                packed, w_zero = self._packed_weight()
                bias = None if self.bias is None else self.bias.detach().float()  # fp32 even after model.half()
                y = torch.ops.onednn.qlinear_pointwise.tensor(xq, x_scale, _ZERO, packed, self.row_scale(), w_zero,
                                                               bias, 1.0, 0, torch.float32, "none", [], "")
            else:
                acc = torch._int_mm(xq, self.codes().t())
                # int32 -> fp32 scaled, written over the int32 accumulator (same size): one big tensor, not two
                y = torch.mul(acc, x_scale * self.row_scale(), out=acc.view(torch.float32))
                if self.bias is not None:
                    y.add_(self.bias)
            return y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        if self.act_bits:
            low, high = act_range if act_range is not None else self._act_range()
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
