"""Integer quantization math shared by training (fake quantization) and the cleaned model (packed).

A weight is quantized in ``num_groups`` equal contiguous groups of its flattened ``(out, in)`` view
(DeepSpeed's ``quantize_groups``; a group that spans whole rows gives per-row-block scales).  The
integer code ``q`` and its scale reproduce the value as ``(q - zero) * scale``:

* ``bits >= 3``, symmetric: ``scale = max|w| / (2^(bits-1) - 1)``, ``q`` in ``[-(2^(bits-1)-1), 2^(bits-1)-1]``
  (the most negative code is left unused so the grid is symmetric and zero is exact);
* ``bits >= 3``, asymmetric: ``scale = (max - min) / (2^bits - 1)``, ``zero = round(-min / scale)``,
  ``q`` in ``[0, 2^bits - 1]``;
* ``bits == 2`` (ternary, XTC/TWN): ``q`` in ``{-1, 0, 1}`` with threshold ``0.7 * mean|w|`` and scale the
  mean ``|w|`` of the kept weights; ``bits == 1`` (binary): ``q = sign(w)`` (0 -> +1), scale ``mean|w|``.
  Both are symmetric whatever ``quantization_type`` says (decision: an asymmetric 1-2 bit grid wastes
  a level and no XTC result uses it).

Fake quantization passes gradients straight through (``dq(q(w)) + (w - w.detach())``, exact in the forward).  Stochastic
rounding adds uniform noise in ``[0, 1)`` before flooring.

Packing stores codes in the smallest container of 1, 2, 4, 8 or 16 bits that holds ``bits``
(offset to unsigned), little end first inside each byte.
"""

from __future__ import annotations

import torch

CONTAINERS = (1, 2, 4, 8, 16)


def container_bits(bits: int) -> int:
    """The packed width used for ``bits``-bit codes."""
    for width in CONTAINERS:
        if bits <= width:
            return width
    raise ValueError(f"{bits} bits is not supported (1..16)")


def check_groups(numel: int, num_groups: int, what: str) -> None:
    if num_groups < 1 or numel % num_groups:
        raise ValueError(f"{what}: quantize_groups {num_groups} does not divide its {numel} weights; "
                         "use a group count that divides the weight's element count")


def _round(x: torch.Tensor, stochastic: bool) -> torch.Tensor:
    if stochastic:
        return torch.floor(x + torch.rand_like(x))
    return torch.round(x)


def quantize(w: torch.Tensor, bits: int, num_groups: int, symmetric: bool = True,
             stochastic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Integer codes (same shape as ``w``, float dtype holding integers), per-group scale
    ``(num_groups,)`` and zero point (``None`` when symmetric)."""
    g = w.detach().reshape(num_groups, -1).float()
    if bits == 1:
        scale = g.abs().mean(dim=1).clamp_min(1e-12)
        q = torch.where(g >= 0, 1.0, -1.0)
        return q.view_as(w), scale, None
    if bits == 2:
        absg = g.abs()
        threshold = 0.7 * absg.mean(dim=1, keepdim=True)
        keep = absg > threshold
        kept = keep.float().sum(dim=1).clamp_min(1.0)
        scale = ((absg * keep).sum(dim=1) / kept).clamp_min(1e-12)
        q = torch.sign(g) * keep
        return q.view_as(w), scale, None
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = (g.abs().amax(dim=1) / qmax).clamp_min(1e-12)
        q = _round(g / scale[:, None], stochastic).clamp(-qmax, qmax)
        return q.view_as(w), scale, None
    qmax = 2**bits - 1
    low, high = g.amin(dim=1).clamp(max=0), g.amax(dim=1).clamp(min=0)
    scale = ((high - low) / qmax).clamp_min(1e-12)
    zero = torch.round(-low / scale)
    q = (_round(g / scale[:, None], stochastic) + zero[:, None]).clamp(0, qmax)
    return q.view_as(w), scale, zero


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, num_groups: int) -> torch.Tensor:
    g = q.reshape(num_groups, -1).to(torch.float32, copy=True)  # one new tensor, then in place
    if zero is not None:
        g.sub_(zero[:, None])
    return g.mul_(scale[:, None]).view(q.shape)


def fake_quantize(w: torch.Tensor, bits: int, num_groups: int, symmetric: bool = True,
                  stochastic: bool = False) -> torch.Tensor:
    """``w`` rounded to the ``bits``-bit grid, with a straight-through gradient."""
    q, scale, zero = quantize(w, bits, num_groups, symmetric, stochastic)
    dq = dequantize(q, scale, zero, num_groups).to(w.dtype)
    return dq + (w - w.detach())  # exactly dq forward, identity gradient to w


def fake_quantize_activation(x: torch.Tensor, bits: int, symmetric: bool,
                             low: torch.Tensor | None = None, high: torch.Tensor | None = None) -> torch.Tensor:
    """Per-tensor activation fake quantization; range from ``x`` itself (dynamic) or from the given
    static ``low``/``high``.  Straight-through gradient."""
    xf = x.detach().float()
    if low is None or high is None:
        low, high = xf.amin(), xf.amax()
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = (torch.maximum(low.abs(), high.abs()) / qmax).clamp_min(1e-12)
        dq = torch.round(xf / scale).clamp(-qmax, qmax) * scale
    else:
        qmax = 2**bits - 1
        low, high = low.clamp(max=0), high.clamp(min=0)
        scale = ((high - low) / qmax).clamp_min(1e-12)
        zero = torch.round(-low / scale)
        dq = ((torch.round(xf / scale) + zero).clamp(0, qmax) - zero) * scale
    return dq.to(x.dtype) + (x - x.detach())


def pack(q: torch.Tensor, bits: int, zero_offset: bool) -> torch.Tensor:
    """Codes (integers in a float or int tensor) -> flat packed uint8 (or int16 for > 8 bits).

    ``zero_offset``: the codes are signed (symmetric) and are shifted to unsigned before packing.
    """
    width = container_bits(bits)
    codes = q.reshape(-1).to(torch.int32)
    if width == 16:  # unsigned 16-bit codes are stored shifted into int16's range
        return (codes if zero_offset else codes - 32768).to(torch.int16)
    if width == 8:
        return codes.to(torch.int8) if zero_offset else codes.to(torch.uint8)
    if zero_offset:
        codes = codes + (1 if bits <= 2 else 2 ** (bits - 1))
        if bits == 1:
            codes = (codes > 1).to(torch.int32)  # -1 -> 0, +1 -> 1
    per_byte = 8 // width
    if codes.numel() % per_byte:
        raise ValueError(f"cannot pack {codes.numel()} codes {per_byte} to a byte; the weight's size must be a "
                         f"multiple of {per_byte}")
    codes = codes.view(-1, per_byte)
    out = torch.zeros(codes.shape[0], dtype=torch.int32)
    for i in range(per_byte):
        out |= codes[:, i] << (i * width)
    return out.to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, numel: int, zero_offset: bool) -> torch.Tensor:
    """Inverse of :func:`pack`: int8 codes (int16/int32 above 8 bits), flat, ``numel`` long."""
    width = container_bits(bits)
    if width == 16:
        return packed if zero_offset else packed.to(torch.int32) + 32768
    if width == 8:
        return packed if zero_offset else packed.to(torch.int16)
    per_byte = 8 // width
    mask = (1 << width) - 1
    parts = [(packed >> (i * width)) & mask for i in range(per_byte)]  # uint8 all the way
    codes = torch.stack(parts, dim=1).reshape(-1)[:numel].view(torch.int8)
    if zero_offset:
        if bits == 1:
            return codes * 2 - 1
        return codes - (1 if bits <= 2 else 2 ** (bits - 1))
    return codes
