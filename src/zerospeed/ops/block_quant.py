"""Block-wise symmetric quantization for ZeRO++ communication: int8 weights (qwZ), int4 gradients (qgZ).

A flat tensor is cut into blocks of ``block_size`` elements (the last block padded with zeros); each block gets
one fp32 scale ``s = absmax / qmax`` (``qmax`` 127 for int8, 7 for int4: symmetric, zero maps to zero) and its
elements become ``q = round(x / s)`` clamped to ``[-qmax, qmax]``. Dequantization is ``q * s``.

Error bound (what the tests check, per block, for every block size): ``|x - q s| <= s/2 + 2u |x|`` with ``u``
the fp32 unit roundoff, i.e. at most ``absmax / (2 qmax)`` plus two roundings (the division ``x / s`` and the
product ``q s``). A block of zeros has scale 0 and round-trips exactly.

int4 codes are stored two per byte, ``q + 8`` in each nibble (codes 1..15), element ``2i`` in the low nibble and
``2i + 1`` in the high one: :func:`pack_int4` / :func:`unpack_int4` are exact inverses on that range.

Torch only (vectorised over blocks); it is the reference a faster kernel would be tested against. The work per
element is a handful of passes, small next to a network transfer of the same tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Quantized", "dequantize", "pack_int4", "quantize", "unpack_int4", "wire_bytes"]

_QMAX = {8: 127, 4: 7}


@dataclass
class Quantized:
    """``codes``: int8 (one code per element) or uint8 (int4, two per byte); ``scales``: fp32, one per block."""

    codes: torch.Tensor
    scales: torch.Tensor
    numel: int
    block_size: int
    bits: int


def _check(bits: int, block_size: int) -> None:
    if bits not in _QMAX:
        raise ValueError(f"bits: {bits} is not 8 or 4")
    if block_size < 2 or block_size % 2:
        raise ValueError(f"block_size: {block_size} must be an even number >= 2")


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def wire_bytes(numel: int, block_size: int, bits: int) -> int:
    """Bytes of the quantized form of ``numel`` elements: the codes and one fp32 scale per block."""
    blocks = num_blocks(numel, block_size)
    return blocks * block_size * bits // 8 + 4 * blocks


def quantize(x: torch.Tensor, bits: int = 8, block_size: int = 256) -> Quantized:
    """Quantize ``x`` (any float dtype, any shape; read as flat) block-wise to ``bits`` (8 or 4)."""
    _check(bits, block_size)
    flat = x.detach().reshape(-1).float()
    numel = flat.numel()
    blocks = num_blocks(numel, block_size)
    padded = torch.zeros(blocks * block_size, dtype=torch.float32, device=flat.device)
    padded[:numel] = flat
    view = padded.view(blocks, block_size)
    qmax = _QMAX[bits]
    scales = view.abs().amax(dim=1) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(view / safe.unsqueeze(1)).clamp_(-qmax, qmax).to(torch.int8)
    if bits == 4:
        codes = pack_int4(codes.view(-1))
    return Quantized(codes.view(-1), scales, numel, block_size, bits)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """The values ``q`` stands for, as a flat tensor of ``q.numel`` elements (written into ``out`` if given)."""
    codes = unpack_int4(q.codes) if q.bits == 4 else q.codes
    values = codes.view(-1, q.block_size).float() * q.scales.unsqueeze(1)
    values = values.view(-1)[: q.numel]
    if out is None:
        return values.to(dtype)
    out.view(-1).copy_(values)
    return out


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-8, 7] (even count) -> uint8, two per byte (``code + 8``; element 2i low nibble)."""
    if codes.numel() % 2:
        raise ValueError(f"pack_int4: {codes.numel()} codes, need an even count")
    nibbles = (codes.reshape(-1, 2).to(torch.int16) + 8).to(torch.uint8)
    return nibbles[:, 0] | (nibbles[:, 1] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 -> int8 codes, twice as many."""
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=1).view(-1)
