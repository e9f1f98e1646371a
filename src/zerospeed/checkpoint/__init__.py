"""Sharded, resharding, crash-safe checkpoints (engine.save_checkpoint / load_checkpoint).

Format (see :mod:`zerospeed.checkpoint.index`): per-rank safetensors files plus a JSON index that
addresses every piece by (parameter name, global offset), so a checkpoint written at world size N
and ZeRO stage s loads at world size M and stage t with no conversion step. Nothing is pickled.
Saving (:mod:`~zerospeed.checkpoint.saver`) writes into a temporary directory and publishes it with
an atomic rename after every rank has succeeded; loading (:mod:`~zerospeed.checkpoint.loader`)
verifies sizes and CRC-32s before touching the model. :func:`consolidate` merges a checkpoint
into one safetensors state dict without starting processes.
"""

from zerospeed.checkpoint.consolidate import consolidate, consolidated_state_dict, main
from zerospeed.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSaveError,
)

__all__ = [
    "CheckpointCorruptError", "CheckpointError", "CheckpointMismatchError", "CheckpointNotFoundError",
    "CheckpointSaveError", "consolidate", "consolidated_state_dict", "main",
]


from zerospeed._submodules import lazy_submodules as _lazy_submodules

__getattr__ = _lazy_submodules(__name__)  # zerospeed.<package>.<submodule> after `import zerospeed` (issue #27)
