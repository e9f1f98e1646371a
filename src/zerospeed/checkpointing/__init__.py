"""Activation checkpointing with DeepSpeed's ``deepspeed.checkpointing`` API.

``configure(mpu_, deepspeed_config=...)``, ``checkpoint(function, *args)``, ``is_configured()``,
``reset()``, the RNG tracker (``get_cuda_rng_tracker``, ``model_parallel_cuda_manual_seed``),
partitioned and host-offloaded checkpoint inputs, and selective checkpointing through torch's
policy API. See :mod:`zerospeed.checkpointing.function` for the scheme.
"""

from zerospeed.checkpointing.function import (
    CheckpointFunction,
    checkpoint,
    non_reentrant_checkpoint,
    profile_stats,
    reset_profile_stats,
)
from zerospeed.checkpointing.measure import SavedTensorBytes, peak_allocated_bytes
from zerospeed.checkpointing.rng import (
    CudaRNGStatesTracker,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from zerospeed.checkpointing.selective import resolve_policy
from zerospeed.checkpointing.settings import configure, is_configured, reset

__all__ = ["CheckpointFunction", "CudaRNGStatesTracker", "SavedTensorBytes", "checkpoint", "configure",
           "get_cuda_rng_tracker", "is_configured", "model_parallel_cuda_manual_seed", "non_reentrant_checkpoint",
           "peak_allocated_bytes", "profile_stats", "reset", "reset_profile_stats", "resolve_policy"]


from zerospeed._submodules import lazy_submodules as _lazy_submodules

__getattr__ = _lazy_submodules(__name__)  # zerospeed.<package>.<submodule> after `import zerospeed` (issue #27)
