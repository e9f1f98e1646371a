"""Point-to-point transfer of stage activations and gradients, with shape metadata.

An *activation* is what one stage hands the next: a tensor or a tuple of tensors.
:class:`ActivationMeta` describes it (per tensor: shape and dtype; and whether it was a tuple), so
a receiver can allocate buffers before the data arrives. Gradients travel back for exactly the
floating-point tensors of an activation, in order: both sides derive which ones from the same
metadata, so gradient messages need no header.

Protocol: every message between a pair of ranks is matched in the order it was posted (FIFO, no
tags), which the schedules guarantee (see ``schedule_comm``). A *header* is two messages: an int64
pair ``(status, length)`` and then ``length`` elements: encoded metadata (status OK) or the UTF-8
bytes of an error report (status ERROR, used by the start-up handshake to pass a failure down the
pipeline instead of leaving the next rank waiting). Headers are sent by the handshake and, for
modules declared ``dynamic_shape``, before every activation.

Sends are asynchronous (``isend``): :class:`P2P` keeps each tensor and its handle alive until
:meth:`P2P.wait_sends`, which the runtime calls before gradients are reduced. Receives block.
Every transfer goes through :mod:`zerospeed.comm` so it is counted.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zerospeed import comm

__all__ = ["ActivationMeta", "P2P", "TensorMeta", "as_tensors", "pack_activation"]

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
_OK, _ERROR = 0, 1


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def carries_grad(self) -> bool:
        """A gradient travels back for this tensor (floating point)."""
        return self.dtype.is_floating_point

    def __str__(self) -> str:
        return f"{tuple(self.shape)} {str(self.dtype).replace('torch.', '')}"


@dataclass(frozen=True)
class ActivationMeta:
    tensors: tuple[TensorMeta, ...]
    is_tuple: bool

    @classmethod
    def of(cls, activation: Any) -> ActivationMeta:
        tensors = as_tensors(activation)
        return cls(tuple(TensorMeta(tuple(t.shape), t.dtype) for t in tensors), isinstance(activation, tuple))

    @property
    def grad_metas(self) -> tuple[TensorMeta, ...]:
        return tuple(m for m in self.tensors if m.carries_grad)

    def encode(self) -> list[int]:
        out = [int(self.is_tuple), len(self.tensors)]
        for m in self.tensors:
            out += [_CODE[m.dtype], len(m.shape), *m.shape]
        return out

    @classmethod
    def decode(cls, values: Sequence[int]) -> ActivationMeta:
        is_tuple, count = bool(values[0]), values[1]
        pos, metas = 2, []
        for _ in range(count):
            dtype, ndim = _DTYPES[values[pos]], values[pos + 1]
            metas.append(TensorMeta(tuple(values[pos + 2:pos + 2 + ndim]), dtype))
            pos += 2 + ndim
        return cls(tuple(metas), is_tuple)

    def __str__(self) -> str:
        inner = ", ".join(str(m) for m in self.tensors)
        return f"({inner})" if self.is_tuple else inner


def as_tensors(activation: Any) -> tuple[torch.Tensor, ...]:
    """The tensors of an activation; raises TypeError for anything but a tensor or tuple of them."""
    items = activation if isinstance(activation, tuple) else (activation,)
    if not items or not all(torch.is_tensor(t) for t in items):
        raise TypeError("a pipeline stage must output a tensor or a tuple of tensors, got "
                        f"{type(activation).__name__}"
                        + ("" if not isinstance(activation, tuple)
                           else f" of ({', '.join(type(t).__name__ for t in activation)})"))
    return items


def pack_activation(tensors: Sequence[torch.Tensor], meta: ActivationMeta) -> Any:
    """Rebuild the activation the sender had: a bare tensor or a tuple."""
    return tuple(tensors) if meta.is_tuple else tensors[0]


class P2P:
    """Sends and receives between this rank and global ranks ``peer`` on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: list[tuple[Any, torch.Tensor]] = []

    # -- headers --------------------------------------------------------------------------------
    def send_header(self, dst: int, meta: ActivationMeta | None, error: str | None = None) -> None:
        if error is not None:
            body = torch.tensor(list(error.encode("utf-8")) or [32], dtype=torch.uint8, device=self.device)
            status = _ERROR
        else:
            assert meta is not None
            body = torch.tensor(meta.encode(), dtype=torch.int64, device=self.device)
            status = _OK
        head = torch.tensor([status, body.numel()], dtype=torch.int64, device=self.device)
        self._isend(head, dst)
        self._isend(body, dst)

    def recv_header(self, src: int) -> ActivationMeta | str:
        """The sender's metadata, or its error report (a str)."""
        head = torch.empty(2, dtype=torch.int64, device=self.device)
        comm.recv(head, src)
        status, length = int(head[0]), int(head[1])
        if status == _ERROR:
            body = torch.empty(length, dtype=torch.uint8, device=self.device)
            comm.recv(body, src)
            return bytes(body.cpu().tolist()).decode("utf-8", errors="replace")
        body = torch.empty(length, dtype=torch.int64, device=self.device)
        comm.recv(body, src)
        return ActivationMeta.decode(body.cpu().tolist())

    # -- payloads -------------------------------------------------------------------------------
    def send_tensors(self, tensors: Sequence[torch.Tensor], dst: int) -> None:
        for t in tensors:
            self._isend(t.detach().contiguous(), dst)

    def recv_tensors(self, metas: Sequence[TensorMeta], src: int) -> list[torch.Tensor]:
        out = []
        for m in metas:
            buf = torch.empty(m.shape, dtype=m.dtype, device=self.device)
            comm.recv(buf, src)
            out.append(buf)
        return out

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        self._pending.append((comm.isend(tensor, dst), tensor))
        if len(self._pending) > 64:  # drop finished sends so a long step does not pile them up
            self._pending = [(w, t) for w, t in self._pending if not _done(w)]

    def wait_sends(self) -> None:
        """Block until every posted send has completed (its buffer may then be reused)."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()


def _done(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # some backends cannot tell; keep the handle
        return False
