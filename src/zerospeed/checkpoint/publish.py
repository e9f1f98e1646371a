"""Crash-safe publication of a checkpoint directory and of the ``latest`` file.

Protocol (rank 0 runs the filesystem steps; the orchestration makes every rank agree first):

1. every rank writes its files into ``SAVE_DIR/.tmp-<tag>-<nonce>/`` and ``fsync``s them;
2. the ranks agree that all writes succeeded (a failure anywhere: the temporary directory is
   removed and every rank raises; nothing visible changes);
3. rank 0 writes ``index.json`` last inside the temporary directory, ``fsync``s the directory and
   renames it to ``SAVE_DIR/<tag>`` (one atomic ``rename``). Re-saving an existing tag first
   renames the old directory aside to ``.old-<tag>-<nonce>``, then renames the new one in, then
   deletes the old one; a crash between the two renames leaves the old copy, which both the next
   save (it renames it back) and the loader (it reads it) recover;
4. only then ``latest`` is rewritten: a temporary file, ``fsync``, ``os.replace``, ``fsync`` of the
   directory.

So at every instant ``latest`` names a complete checkpoint, and a SIGKILL at any point of a save
leaves the previous checkpoint loadable. Dot-prefixed names are reserved for these temporaries
(tags may not start with a dot) and are ignored by the loader.

Test hooks (environment variables read at each use, so a test can set them around one save):
``ZEROSPEED_CKPT_TEST_PAUSE=<point>`` prints ``ZEROSPEED_CKPT_PAUSE <point>`` to stdout and sleeps
``ZEROSPEED_CKPT_TEST_PAUSE_S`` seconds (default 60) at that point of a save (points: ``write``,
``shards``, ``index``, ``swap``, ``latest``), after writing the point's name to the file
``ZEROSPEED_CKPT_TEST_PAUSE_MARKER`` if set, so a test can SIGKILL the process there;
``ZEROSPEED_CKPT_TEST_FAIL=<rank>`` makes that rank's shard write fail with ENOSPC.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import sys
import time

from zerospeed.checkpoint.errors import CheckpointError, CheckpointNotFoundError

logger = logging.getLogger("zerospeed")

LATEST_FILE = "latest"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
_NONCE_CHARS = 16


def new_nonce() -> str:
    return secrets.token_hex(_NONCE_CHARS // 2)


def validate_tag(tag: object) -> str:
    """A tag names a directory inside the checkpoint directory: no separators, no leading dot."""
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"checkpoint tag must be a non-empty string, got {tag!r}")
    bad = [c for c in ("/", "\\", "\0") if c in tag]
    if bad or tag in (".", "..") or tag.startswith(".") or tag == LATEST_FILE:
        raise ValueError(f"checkpoint tag {tag!r} is not allowed: it names a directory, so it may not contain "
                         f"'/', '\\' or NUL, start with '.', or be {LATEST_FILE!r}")
    return tag


def tmp_dir(save_dir: str, tag: str, nonce: str) -> str:
    return os.path.join(save_dir, f"{TMP_PREFIX}{tag}-{nonce}")


def fsync_dir(path: str) -> None:
    """Make a rename or file creation inside ``path`` durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def pause(point: str) -> None:
    """Test hook: stop at ``point`` of a save when ``ZEROSPEED_CKPT_TEST_PAUSE`` names it."""
    wanted = os.environ.get("ZEROSPEED_CKPT_TEST_PAUSE")
    if wanted and wanted in (point, "*"):
        print(f"ZEROSPEED_CKPT_PAUSE {point}", flush=True)
        sys.stdout.flush()
        marker = os.environ.get("ZEROSPEED_CKPT_TEST_PAUSE_MARKER")
        if marker:
            with open(marker, "w") as f:
                f.write(point)
        time.sleep(float(os.environ.get("ZEROSPEED_CKPT_TEST_PAUSE_S", "60")))


def injected_failure(rank: int, path: str) -> None:
    """Test hook: fail this rank's write like a full disk when ``ZEROSPEED_CKPT_TEST_FAIL`` names it."""
    if os.environ.get("ZEROSPEED_CKPT_TEST_FAIL") == str(rank):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (injected by ZEROSPEED_CKPT_TEST_FAIL)", path)


def describe_os_error(action: str, path: str, e: OSError) -> str:
    """``could not write /x/y: [Errno 28] No space left on device`` with a hint for common causes."""
    hint = ""
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = " (the directory is not writable by this process: check its permissions or pick another save_dir)"
    elif e.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = " (the disk is full: free space or pick another save_dir)"
    where = e.filename if isinstance(e.filename, str) and e.filename else path
    return f"could not {action} {where}: {e.strerror or e}{hint}"


def prepare_save_dir(save_dir: str) -> None:
    """Create ``save_dir`` and repair what an interrupted earlier save left (rank 0 only)."""
    os.makedirs(save_dir, exist_ok=True)
    if not os.path.isdir(save_dir):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", save_dir)
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if name.startswith(OLD_PREFIX):
            tag = name[len(OLD_PREFIX):-(_NONCE_CHARS + 1)]
            final = os.path.join(save_dir, tag)
            complete = os.path.isfile(os.path.join(path, "index.json"))
            if tag and complete and not os.path.exists(final):  # killed between the two renames of a re-save
                os.rename(path, final)
                logger.warning("zerospeed: restored checkpoint %s from an interrupted re-save", final)
            else:
                remove_checkpoint_dir(path)
        elif name.startswith(TMP_PREFIX):
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                _unlink_quiet(path)


def remove_checkpoint_dir(path: str) -> None:
    """Delete a checkpoint directory so that a crash midway never leaves something that looks
    complete: ``index.json`` (the completeness marker) goes first."""
    _unlink_quiet(os.path.join(path, "index.json"))
    shutil.rmtree(path, ignore_errors=True)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def publish_dir(tmp: str, save_dir: str, tag: str, nonce: str) -> str:
    """Atomically make the complete directory ``tmp`` visible as ``save_dir/tag``."""
    fsync_dir(tmp)
    final = os.path.join(save_dir, tag)
    if os.path.lexists(final):
        aside = os.path.join(save_dir, f"{OLD_PREFIX}{tag}-{nonce}")
        os.rename(final, aside)
        pause("swap")
        os.rename(tmp, final)
        fsync_dir(save_dir)
        remove_checkpoint_dir(aside)
    else:
        os.rename(tmp, final)
    fsync_dir(save_dir)
    return final


def write_text_atomic(path: str, text: str) -> None:
    """Replace ``path`` by a file holding ``text``: readers see the old or the new content, never a mix."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f"{TMP_PREFIX}{os.path.basename(path)}-{new_nonce()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quiet(tmp)
        raise
    fsync_dir(directory)


def read_latest(load_dir: str) -> str | None:
    """The tag named by ``load_dir/latest``, or None when there is no such file."""
    path = os.path.join(load_dir, LATEST_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    try:
        return validate_tag(text)
    except ValueError:
        raise CheckpointError(f"{path} does not hold a valid tag (content: {text[:80]!r})") from None


def resolve_tag_dir(load_dir: str, tag: str, from_latest: bool) -> str:
    """The directory of checkpoint ``tag``; a clear error when it does not exist."""
    final = os.path.join(load_dir, tag)
    if os.path.isdir(final):
        return final
    prefix = f"{OLD_PREFIX}{tag}-"
    aside = sorted(n for n in os.listdir(load_dir) if n.startswith(prefix) and len(n) == len(prefix) + _NONCE_CHARS
                   and os.path.isfile(os.path.join(load_dir, n, "index.json")))
    if aside:  # a re-save of this tag was killed between its two renames: the old copy is complete
        logger.warning("zerospeed: checkpoint %s is missing but an interrupted re-save left its previous copy; "
                       "loading %s", final, aside[0])
        return os.path.join(load_dir, aside[0])
    tags = sorted(n for n in os.listdir(load_dir)
                  if not n.startswith(".") and os.path.isfile(os.path.join(load_dir, n, "index.json")))
    known = f"; checkpoints present: {', '.join(tags)}" if tags else "; no complete checkpoint is present"
    if from_latest:
        raise CheckpointNotFoundError(f"{os.path.join(load_dir, LATEST_FILE)} names tag {tag!r}, but {final} does "
                                      f"not exist{known}")
    raise CheckpointNotFoundError(f"no checkpoint with tag {tag!r} in {load_dir} ({final} does not exist){known}")
