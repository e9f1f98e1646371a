"""Exceptions raised by checkpoint save, load and consolidation.

Every message names the path involved and says what to do; ``CheckpointNotFoundError`` is also a
``FileNotFoundError`` so ``except FileNotFoundError`` in user code keeps working, and
``CheckpointTagMismatchError`` (a ``CheckpointSaveError``) is also an ``AssertionError``, the type DeepSpeed 0.19.8
raises when ``checkpoint.tag_validation`` is ``Fail`` and the ranks' tags differ (an ``assert`` in its engine's
``_checkpoint_tag_validation``), so a script's ``except AssertionError`` keeps working.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class of every checkpoint error."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint directory, tag or file that should exist does not."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is truncated, altered or not in zerospeed's format."""


class CheckpointSaveError(CheckpointError):
    """A save failed on at least one rank; nothing was published."""


class CheckpointTagMismatchError(CheckpointSaveError, AssertionError):
    """The ranks saved under different tags and ``checkpoint.tag_validation`` is ``Fail``; nothing was written."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the model (missing / unexpected parameters, shape mismatch)."""
