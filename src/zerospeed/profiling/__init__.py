"""The flops profiler (DeepSpeed's ``deepspeed.profiling.flops_profiler`` API).

``get_model_profile(model, args=...)`` -> (flops, macs, params); ``FlopsProfiler(model)`` for a
window of your own (a training step); the ``flops_profiler`` config section makes the engine
profile step ``profile_step``. See :mod:`zerospeed.profiling.flops_profiler`.
"""

from zerospeed.profiling.flops_profiler import (
    FlopsProfiler,
    duration_to_string,
    flops_to_string,
    get_model_profile,
    macs_to_string,
    params_to_string,
)
from zerospeed.profiling.peak import measure_peak_flops

__all__ = ["FlopsProfiler", "duration_to_string", "flops_to_string", "get_model_profile", "macs_to_string",
           "measure_peak_flops", "params_to_string"]


from zerospeed._submodules import lazy_submodules as _lazy_submodules

__getattr__ = _lazy_submodules(__name__)  # zerospeed.<package>.<submodule> after `import zerospeed` (issue #27)
