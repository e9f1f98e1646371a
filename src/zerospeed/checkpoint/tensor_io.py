"""Safetensors files written and read without pickle, with a CRC-32 per tensor.

Files are standard safetensors (8-byte little-endian header length, a JSON header padded with
spaces to 8 bytes, then raw little-endian tensor bytes), so ``safetensors.torch.load_file`` reads
them too. We write and read them ourselves rather than through the ``safetensors`` package for
three reasons:

* writing streams each tensor's bytes straight from its storage into the file (no second copy of
  the whole shard in memory, as ``safetensors.torch.save`` makes), computing the CRC-32 on the
  way, and ``fsync``s before returning, so a published checkpoint is on disk;
* reading fetches one tensor's byte range with a single ``readinto`` into memory we own and checks
  its CRC before a tensor is built from it, so a flipped bit or a truncated file is reported with
  the file's path and the tensor's name instead of surfacing as a crash deep inside a load;
* the header is validated (offsets inside the file, sizes consistent with dtype and shape), so a
  tampered header gives a clear error too.

The CRC protects against corruption (truncation, bit rot, a partial copy), not against an
adversary who can rewrite both the file and the index; no byte of a checkpoint is ever unpickled,
so a malicious file can at worst fail to load.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from zerospeed.checkpoint.errors import CheckpointCorruptError, CheckpointNotFoundError

_TO_ST = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _st in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"), ("float8_e4m3fn", "F8_E4M3"),
                   ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _TO_ST[getattr(torch, _name)] = _st
_FROM_ST = {v: k for k, v in _TO_ST.items()}

_MAX_HEADER_BYTES = 100 * 1024 * 1024
_CHUNK_BYTES = 64 * 1024 * 1024  # write in pieces so a huge tensor never needs one huge bytes object


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name used in JSON indexes)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


@dataclass
class FileRecord:
    """What the index remembers about one written file: its size and each tensor's CRC-32."""

    name: str
    num_bytes: int
    crc32: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.num_bytes, "crc32": self.crc32}


def _byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU contiguous tensor, without a copy."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def write_safetensors(path: str, tensors: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
                      metadata: Mapping[str, str] | None = None, fsync: bool = True) -> FileRecord:
    """Write ``tensors`` (CPU, contiguous, any supported dtype) to ``path``; return the record.

    A value may also be a list of 1-D tensors of one dtype, stored as their concatenation (one
    1-D tensor) without building it in memory. The caller owns atomicity (``path`` is inside a
    temporary directory that is published by a rename); this function only guarantees that, once
    it returns, the bytes are on disk.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    views: list[tuple[str, list[memoryview]]] = []
    offset = 0
    for key, value in tensors.items():
        parts = [value] if torch.is_tensor(value) else list(value)
        if not parts:
            raise ValueError(f"write_safetensors: {key!r} is an empty list")
        for t in parts:
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"write_safetensors: tensor {key!r} must be a contiguous CPU tensor")
            if t.dtype not in _TO_ST or t.dtype != parts[0].dtype:
                raise TypeError(f"write_safetensors: tensor {key!r} has dtype {t.dtype}, which safetensors cannot "
                                "store (or its parts' dtypes differ)")
        if len(parts) > 1 and any(t.dim() != 1 for t in parts):
            raise ValueError(f"write_safetensors: the parts of {key!r} must be 1-D")
        shape = list(parts[0].shape) if len(parts) == 1 else [sum(t.numel() for t in parts)]
        part_views = [_byte_view(t) for t in parts]
        size = sum(len(v) for v in part_views)
        header[key] = {"dtype": _TO_ST[parts[0].dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        views.append((key, part_views))
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    record = FileRecord(os.path.basename(path), 8 + len(head) + offset)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for key, part_views in views:
            crc = 0
            for view in part_views:
                for start in range(0, len(view), _CHUNK_BYTES):
                    chunk = view[start:start + _CHUNK_BYTES]
                    crc = zlib.crc32(chunk, crc)
                    f.write(chunk)
            record.crc32[key] = crc
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return record


class SafetensorsReader:
    """Validated random access to the tensors of one safetensors file.

    ``expected_bytes`` (from the index) is checked on open, so a truncated file is reported before
    anything is read; ``read(key, crc32=...)`` verifies the tensor's checksum.
    """

    def __init__(self, path: str, expected_bytes: int | None = None) -> None:
        self.path = path
        try:
            self._file = open(path, "rb")
            self._lock = threading.Lock()
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"checkpoint file {path} is missing (the checkpoint is incomplete; "
                                          "was it copied partially?)") from None
        try:
            size = os.fstat(self._file.fileno()).st_size
            if expected_bytes is not None and size != expected_bytes:
                raise CheckpointCorruptError(f"checkpoint file {path} is {size} bytes, the index records "
                                             f"{expected_bytes}: the file is truncated or was modified")
            raw_len = self._file.read(8)
            if len(raw_len) != 8:
                raise CheckpointCorruptError(f"checkpoint file {path} is too short to be a safetensors file")
            (head_len,) = struct.unpack("<Q", raw_len)
            if head_len > min(_MAX_HEADER_BYTES, size - 8):
                raise CheckpointCorruptError(f"checkpoint file {path}: header length {head_len} does not fit the "
                                             f"file ({size} bytes): not a safetensors file, or corrupted")
            try:
                header = json.loads(self._file.read(head_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointCorruptError(f"checkpoint file {path}: unreadable header ({e})") from None
            if not isinstance(header, dict):
                raise CheckpointCorruptError(f"checkpoint file {path}: header is not a JSON object")
            self.metadata = header.pop("__metadata__", {}) or {}
            self._data_start = 8 + head_len
            data_bytes = size - self._data_start
            self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
            for key, entry in header.items():
                self._entries[key] = self._validate(key, entry, data_bytes)
        except BaseException:
            self._file.close()
            raise

    def _validate(self, key: str, entry: Any, data_bytes: int) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        bad = f"checkpoint file {self.path}: tensor {key!r} has a malformed header entry"
        try:
            dtype = _FROM_ST[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointCorruptError(bad) from None
        numel = 1
        for d in shape:
            if d < 0:
                raise CheckpointCorruptError(bad)
            numel *= d
        if not (0 <= begin <= end <= data_bytes) or end - begin != numel * dtype.itemsize:
            raise CheckpointCorruptError(f"checkpoint file {self.path}: tensor {key!r} lies outside the file or its "
                                         "size does not match its shape: the file is truncated or was modified")
        return dtype, shape, begin, end

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def read(self, key: str, crc32: int | None = None) -> torch.Tensor:
        """The tensor ``key`` in memory owned by the returned tensor (checksummed if ``crc32``)."""
        if key not in self._entries:
            raise CheckpointCorruptError(f"checkpoint file {self.path} has no tensor {key!r} (the index names it)")
        dtype, shape, begin, end = self._entries[key]
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        buf = torch.empty(end - begin, dtype=torch.uint8)  # not zero-filled: every byte is read into it
        view = memoryview(buf.numpy()).cast("B")
        got = 0
        while got < len(view):
            n = self._read_at(view[got:], self._data_start + begin + got)
            if not n:
                raise CheckpointCorruptError(f"checkpoint file {self.path}: unexpected end of file reading {key!r}")
            got += n
        if crc32 is not None and zlib.crc32(view) != int(crc32):
            raise CheckpointCorruptError(f"checkpoint file {self.path}: tensor {key!r} fails its CRC-32 check: "
                                         "the file was modified or is corrupted")
        return buf.view(dtype).view(shape)

    def _read_at(self, view: memoryview, offset: int) -> int:
        # positional reads keep one reader usable from several threads at once
        if hasattr(os, "preadv"):
            return os.preadv(self._file.fileno(), [view], offset)
        with self._lock:
            self._file.seek(offset)
            return self._file.readinto(view) or 0

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
