"""Errors of DeepSpeed-layout reading and writing: subclasses of zerospeed's checkpoint errors, so that
``except CheckpointError`` catches them too, and each message names the file and what is wrong."""

from __future__ import annotations

from zerospeed.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError


class UnsafePickleError(CheckpointCorruptError):
    """A DeepSpeed file holds a type that is not on the allowlist (nothing of it was executed)."""


class DeepSpeedLayoutError(CheckpointCorruptError):
    """A DeepSpeed folder whose files disagree with each other or with what DeepSpeed writes."""


class DeepSpeedFileMissingError(CheckpointNotFoundError):
    """A file a DeepSpeed folder must hold (a rank's optimizer shard, the model states) is missing."""


class DeepSpeedUnsupportedError(CheckpointMismatchError):
    """A DeepSpeed layout zerospeed recognises but does not read (yet): the message says which."""
