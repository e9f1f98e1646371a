"""Aligned CPU buffers and zero-copy byte views of tensors, for O_DIRECT I/O.

O_DIRECT needs the user buffer address, the file offset and the length to be multiples of the
device's logical block size (512 B here; 4096 B on many NVMe drives). zerospeed uses
:data:`DEFAULT_ALIGNMENT` = 4096, which satisfies both and is also the page size.

``new_aligned_tensor`` over-allocates a ``uint8`` tensor by one alignment unit and returns a view
starting at the first aligned byte, so the result is an ordinary torch tensor (its storage keeps
the allocation alive). With ``pin_memory=True`` (and CUDA available) the allocation is page-locked,
which is what DeepSpeed's ``new_cpu_locked_tensor`` gives for fast host<->device copies.
"""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_ALIGNMENT", "new_aligned_tensor", "is_aligned", "byte_view"]

DEFAULT_ALIGNMENT = 4096


def new_aligned_tensor(
    numel: int,
    dtype: torch.dtype = torch.float32,
    *,
    alignment: int = DEFAULT_ALIGNMENT,
    pin_memory: bool = False,
) -> torch.Tensor:
    """A 1-D CPU tensor of ``numel`` elements whose first byte is ``alignment``-aligned.

    Contents are uninitialised (like ``torch.empty``). ``pin_memory`` is honoured only when CUDA
    is available (pinning needs a CUDA context); elsewhere it is a no-op.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if alignment % itemsize:
        raise ValueError(f"alignment {alignment} is not a multiple of {dtype}'s size {itemsize}")
    num_bytes = numel * itemsize
    pin = bool(pin_memory) and torch.cuda.is_available()
    raw = torch.empty(num_bytes + alignment, dtype=torch.uint8, pin_memory=pin)
    shift = (-raw.data_ptr()) % alignment
    out = raw[shift : shift + num_bytes].view(dtype)
    assert out.data_ptr() % alignment == 0
    return out


def is_aligned(tensor: torch.Tensor, alignment: int = DEFAULT_ALIGNMENT) -> bool:
    """Whether ``tensor``'s first byte is ``alignment``-aligned."""
    return tensor.data_ptr() % alignment == 0


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable, zero-copy ``memoryview`` of ``tensor``'s bytes (C-contiguous CPU tensor).

    Works for every dtype, including those numpy lacks (bfloat16, float8): the tensor is
    reinterpreted as ``uint8`` before crossing to numpy. The memoryview keeps the tensor alive.
    """
    if tensor.device.type != "cpu":
        raise ValueError(f"aio needs a CPU tensor, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("aio needs a contiguous tensor (call .contiguous() first)")
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray(0))
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple`` (exact integer arithmetic)."""
    return -(-value // multiple) * multiple
