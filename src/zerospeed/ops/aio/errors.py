"""Errors of the async I/O engine: every one names the file (or directory) it is about.

:class:`AIOError` subclasses :class:`OSError`, so ``errno`` / ``filename`` / ``strerror`` are set
and ``except OSError`` keeps working, and its subclass-by-errno lookup (``FileNotFoundError`` and
friends) is deliberately *not* used: the class is always ``AIOError`` so callers catch one thing.
The message adds the operation, the byte range and a plain-words reason for the errno values users
actually hit with NVMe offload (missing or read-only ``nvme_path``, full disk, a swap file deleted
or truncated while in use).
"""

from __future__ import annotations

import errno as _errno
import os

__all__ = ["AIOError", "describe_errno", "check_nvme_path"]

# Plain-words hints for the errno values that NVMe offload and checkpoint I/O run into.
_HINTS: dict[int, str] = {
    _errno.ENOENT: "no such file or directory",
    _errno.ENOTDIR: "a component of the path is not a directory",
    _errno.EISDIR: "the path is a directory, not a file",
    _errno.EACCES: "permission denied",
    _errno.EPERM: "operation not permitted",
    _errno.EROFS: "the file system is read-only",
    _errno.ENOSPC: "the disk is full (no space left on device)",
    _errno.EDQUOT: "the disk quota is exhausted",
    _errno.EFBIG: "the file would exceed the maximum file size (RLIMIT_FSIZE or file-system limit)",
    _errno.EIO: "low-level I/O error from the device",
    _errno.EINVAL: "invalid argument (O_DIRECT alignment not accepted by this file system?)",
    _errno.EBADF: "bad file descriptor (file closed while in use?)",
    _errno.ESTALE: "stale file handle (file removed on a network file system?)",
}


def describe_errno(err: int | None) -> str:
    """A short human reason for ``err`` (falls back to ``os.strerror``)."""
    if err is None:
        return "unknown error"
    return _HINTS.get(err, os.strerror(err))


class AIOError(OSError):
    """An I/O request of :class:`~zerospeed.ops.aio.AsyncIOHandle` failed.

    Attributes (beyond :class:`OSError`'s ``errno``, ``strerror``, ``filename``):
    ``op`` (``"read"``, ``"write"``, ``"open"``...), ``path``, ``file_offset`` and ``num_bytes`` of
    the failing request (``None`` when not about a byte range), ``detail`` (extra words).
    """

    def __init__(
        self,
        op: str,
        path: str | os.PathLike[str],
        err: int | None,
        *,
        detail: str = "",
        file_offset: int | None = None,
        num_bytes: int | None = None,
    ) -> None:
        path_str = os.fspath(path)
        reason = describe_errno(err) if err is not None else detail or "failed"
        super().__init__(err, reason, path_str)
        self.op = op
        self.path = path_str
        self.file_offset = file_offset
        self.num_bytes = num_bytes
        self.detail = detail

    def __str__(self) -> str:
        what = f"aio {self.op}"
        if self.num_bytes is not None:
            what += f" of {self.num_bytes} bytes"
            if self.file_offset is not None:
                what += f" at offset {self.file_offset}"
        code = f"[Errno {self.errno}] " if self.errno is not None else ""
        msg = f"{what} on '{self.path}' failed: {code}{self.strerror}"
        if self.detail and self.detail != self.strerror:
            msg += f" ({self.detail})"
        return msg

    def __reduce__(self):  # keep pickling (multiprocessing) working with the keyword-only args
        return (
            _rebuild,
            (self.op, self.path, self.errno, self.detail, self.file_offset, self.num_bytes),
        )


def _rebuild(op, path, err, detail, file_offset, num_bytes) -> AIOError:
    return AIOError(op, path, err, detail=detail, file_offset=file_offset, num_bytes=num_bytes)


def check_nvme_path(path: str | os.PathLike[str]) -> str:
    """Check that ``path`` is an existing, writable directory; return it as ``str``.

    Raises :class:`AIOError` naming the path when it is missing, not a directory, or not writable.
    Writability is tested by creating and removing a probe file, because ``os.access`` is not
    trustworthy for root (it ignores permission bits) and says nothing about a full disk.
    """
    path_str = os.fspath(path)
    if not os.path.exists(path_str):
        parent = os.path.dirname(os.path.abspath(path_str))
        detail = "nvme_path does not exist" + (
            "" if os.path.isdir(parent) else f"; nor does its parent '{parent}'"
        )
        raise AIOError("check", path_str, _errno.ENOENT, detail=detail)
    if not os.path.isdir(path_str):
        raise AIOError("check", path_str, _errno.ENOTDIR, detail="nvme_path must be a directory")
    probe = os.path.join(path_str, f".zerospeed-aio-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)
    except OSError as exc:
        raise AIOError("check", path_str, exc.errno, detail="nvme_path is not writable") from exc
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass
    return path_str
