"""Autotuning: ``zerospeed --autotuning tune|run``, a memory-aware search over ZeRO stage, batch
sizes, bucket sizes, offload and model-parallel degrees, one subprocess experiment per candidate.

Files: the search space in ``space``, memory predictions in ``memory_model``, experiments
(subprocess, time limit, resume records) in ``experiment``, the search strategies in ``tuners``,
the loop in ``autotuner``, results and plot in ``report``, the command in ``cli``. The engine's
side (measure, write ``metrics.json``, exit) is :mod:`zerospeed.runtime.autotuning_probe`.
"""

from zerospeed.autotuning.autotuner import Autotuner, AutotuneError
from zerospeed.autotuning.experiment import ExperimentRunner, Result
from zerospeed.autotuning.space import Space, split_space
from zerospeed.autotuning.tuners import GridSearchTuner, ModelBasedTuner, RandomTuner, make_tuner

__all__ = ["AutotuneError", "Autotuner", "ExperimentRunner", "GridSearchTuner", "ModelBasedTuner", "RandomTuner",
           "Result", "Space", "make_tuner", "split_space"]


from zerospeed._submodules import lazy_submodules as _lazy_submodules

__getattr__ = _lazy_submodules(__name__)  # zerospeed.<package>.<submodule> after `import zerospeed` (issue #27)
