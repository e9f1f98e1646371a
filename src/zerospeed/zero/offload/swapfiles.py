"""Swap folders and files on NVMe: created checked, reserved up front, watched, and always removed.

Both NVMe tiers (optimizer states, :mod:`zerospeed.zero.offload.swap`; stage-3 parameters,
:mod:`zerospeed.zero.stage3.param_offload`) keep their files in one folder per rank and process,
``<nvme_path>/zerospeed_swap/<kind>_rank<r>_<pid>_<random>/``:

* :class:`SwapFolder` creates it and removes it on :meth:`SwapFolder.close`, on garbage
  collection and at interpreter exit (``weakref.finalize``), and when a ``multiprocessing`` child
  exits (those leave through ``os._exit``, which skips atexit). Only SIGKILL leaves it behind;
  the pid in the name tells whose it was. The shared ``zerospeed_swap`` parent goes when empty.
* :meth:`SwapFolder.create_file` reserves the file's bytes with ``posix_fallocate`` (a sparse
  file where the file system has no fallocate), so a full disk fails at start with the path and
  the bytes needed, not with ENOSPC in the middle of a step. Reserved bytes read back as zeros.
* :class:`SwapFile` remembers the file's identity (device, inode); :meth:`SwapFile.check` fails,
  naming the path, when the file was deleted or replaced: a write with ``O_CREAT`` would otherwise
  re-create it silently and later reads would return zeros.
"""

from __future__ import annotations

import errno
import multiprocessing.util
import os
import shutil
import tempfile
import weakref
from typing import Any, Callable

from zerospeed.ops.aio import AIOError

SWAP_DIR_NAME = "zerospeed_swap"


def _remove_folder(path: str, on_close: Callable[[], Any] | None) -> None:
    if on_close is not None:
        try:
            on_close()
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
    shutil.rmtree(path, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(path))  # the shared parent, when this was its last user
    except OSError:
        pass


class SwapFile:
    """One preallocated swap file and the identity it was created with."""

    def __init__(self, path: str, nbytes: int, identity: tuple[int, int], what: str) -> None:
        self.path = path
        self.nbytes = nbytes
        self.identity = identity
        self.what = what

    def check(self, op: str = "check") -> None:
        """Raise AIOError naming the path if the file is gone, replaced or truncated."""
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise AIOError(op, self.path, exc.errno,
                           detail=f"the {self.what} swap file disappeared during training (deleted by another "
                                  "process or a clean-up job?); its contents are lost: restart from the last "
                                  "checkpoint") from exc
        if (st.st_dev, st.st_ino) != self.identity or st.st_size < self.nbytes:
            raise AIOError(op, self.path, errno.ESTALE,
                           detail=f"the {self.what} swap file was replaced or truncated during training; its "
                                  "contents are lost: restart from the last checkpoint")


class SwapFolder:
    """``<nvme_path>/zerospeed_swap/<kind>_rank<rank>_<pid>_<random>/``, removed whatever happens.

    ``key`` is the config key that named ``nvme_path`` (for error messages); ``on_close`` runs
    before the folder is removed (e.g. stopping an I/O handle's threads).
    """

    def __init__(self, nvme_path: str, kind: str, rank: int, key: str,
                 on_close: Callable[[], Any] | None = None) -> None:
        root = os.path.join(os.fspath(nvme_path), SWAP_DIR_NAME)
        for attempt in range(5):
            try:
                os.makedirs(root, exist_ok=True)
                self.path = tempfile.mkdtemp(prefix=f"{kind}_rank{rank}_{os.getpid()}_", dir=root)
                break
            except (FileNotFoundError, FileExistsError) as exc:
                # another process removed the empty parent in between: after makedirs' mkdir failed with EEXIST
                # its isdir check finds nothing (FileExistsError), or mkdtemp finds the parent gone. A root that is
                # a regular file fails the same way every attempt and is reported below.
                if attempt == 4:
                    raise AIOError("mkdir", root, exc.errno, detail=f"cannot create the swap folder ({key})") from exc
            except OSError as exc:
                raise AIOError("mkdir", root, exc.errno, detail=f"cannot create the swap folder ({key})") from exc
        self._finalizer = weakref.finalize(self, _remove_folder, self.path, on_close)
        multiprocessing.util.Finalize(None, self._finalizer, exitpriority=10)

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def create_file(self, name: str, nbytes: int, what: str) -> SwapFile:
        """Create ``name`` in the folder with ``nbytes`` reserved (zeros); ``what`` names its contents."""
        path = os.path.join(self.path, name)
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
        try:
            if nbytes:
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        free = shutil.disk_usage(self.path).free
                        raise AIOError("fallocate", path, exc.errno, num_bytes=nbytes,
                                       detail=f"cannot reserve {nbytes} bytes for the {what} swap file "
                                              f"({free} bytes free on its file system)") from exc
                    os.ftruncate(fd, nbytes)  # no fallocate on this file system: a sparse file
            st = os.fstat(fd)
        finally:
            os.close(fd)
        return SwapFile(path, nbytes, (st.st_dev, st.st_ino), what)

    def close(self) -> None:
        """Remove the folder and everything in it (idempotent)."""
        self._finalizer()
