"""Engine checkpoint I/O: ``engine.save_checkpoint`` / ``engine.load_checkpoint`` (DeepSpeed's API).

Thin orchestration over :mod:`zerospeed.checkpoint`: the engine supplies its module, optimizer,
scheduler, loss scaler, counters, config and ZeRO strategy (whose ``shard_views()`` say which
elements of which parameter this rank holds); the checkpoint package does the I/O.

DeepSpeed semantics kept: default tag ``global_step<N>``; ``SAVE_DIR/latest`` names the newest tag
(written last); ``load_checkpoint`` returns ``(load_path, client_state)`` and, when the directory
exists but has no ``latest`` and no tag is given, warns and returns ``(None, None)`` so a script
can start fresh. Differences: a missing directory raises (DeepSpeed warns); ``client_state`` must
be JSON types, tensors or numpy arrays (nothing is pickled) and is the one rank 0 passed; any
world size / stage combination loads without conversion; a save publishes only once every rank's
write succeeded (else every rank raises :class:`~zerospeed.checkpoint.CheckpointSaveError`).

With ``checkpoint.async_save: true`` the save returns after a CPU snapshot and the files are
written and published in the background; :func:`wait_for_checkpoint` (also called by the next save
or load) blocks until then and re-raises a failure.
"""

from __future__ import annotations

import os

from typing import Any

from zerospeed.checkpoint import loader, saver
from zerospeed.checkpoint.saver import SaveStats


def save_checkpoint(engine: Any, save_dir: str, tag: str | None = None, client_state: dict[str, Any] | None = None,
                    save_latest: bool = True) -> bool:
    if not isinstance(save_dir, (str, os.PathLike)) or not os.fspath(save_dir):
        raise ValueError(f"save_checkpoint: save_dir must be a directory path (str or os.PathLike), got {save_dir!r}")
    async_save = bool(getattr(engine.config.checkpoint, "async_save", False))
    return saver.save(engine, save_dir, tag, client_state, save_latest, async_save)


def load_checkpoint(engine: Any, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> tuple[str | None, dict[str, Any] | None]:
    saver.wait(engine)
    return loader.load(engine, load_dir, tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
                       load_module_only)


def wait_for_checkpoint(engine: Any) -> SaveStats | None:
    """Block until the engine's pending asynchronous save is published (re-raising its error)."""
    return saver.wait(engine)


def checkpoint_pending(engine: Any) -> bool:
    """True while an asynchronous save is still being written or published in the background."""
    return saver.pending(engine)


def last_save_stats(engine: Any) -> SaveStats | None:
    """Timings and bytes of this rank's latest save (for benchmarks and logs)."""
    return saver.last_stats(engine)
