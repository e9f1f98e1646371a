"""DeepSpeed's checkpoint folders as one more source (and target) of zerospeed checkpoints (issue #26).

``engine.load_checkpoint(dir)`` detects a folder written by ``DeepSpeedEngine.save_checkpoint``
(:func:`is_deepspeed_folder`) and reads it through :mod:`~zerospeed.checkpoint.deepspeed.layout`,
which presents DeepSpeed's flat fp32 partitions and optimizer moments as pieces addressed by
parameter name and offset: the loader then reshards them onto any world size, ZeRO stage and
offload setting. Files are unpickled only by :mod:`~zerospeed.checkpoint.deepspeed.safe_load`
(``weights_only`` with an allowlist of DeepSpeed's few plain types; nothing else is built or run).
"""

from zerospeed.checkpoint.deepspeed.errors import (DeepSpeedFileMissingError, DeepSpeedLayoutError,
                                                   DeepSpeedUnsupportedError, UnsafePickleError)
from zerospeed.checkpoint.deepspeed.layout import DeepSpeedFolder, is_deepspeed_folder, open_folder
from zerospeed.checkpoint.deepspeed.safe_load import load_pickle

__all__ = ["DeepSpeedFileMissingError", "DeepSpeedFolder", "DeepSpeedLayoutError", "DeepSpeedUnsupportedError",
           "UnsafePickleError", "is_deepspeed_folder", "load_pickle", "open_folder"]
