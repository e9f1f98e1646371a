"""zerospeed: ZeRO-sharded, DeepSpeed-compatible training on PyTorch-native building blocks.

Switch from DeepSpeed by changing the import: ``import zerospeed as deepspeed`` keeps
``initialize``, ``init_distributed`` and the JSON config. Heavy submodules load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from zerospeed._submodules import lazy_submodules as _lazy_submodules
from zerospeed._import_noise import install as _quiet_optional_imports
from zerospeed._version import __version__
from zerospeed.cli import register as _register_commands

_LAZY = {
    "initialize": ("zerospeed.runtime.initialize", "initialize"),
    "init_distributed": ("zerospeed.comm.dist", "init_distributed"),
    "shutdown": ("zerospeed.comm.lifecycle", "shutdown"),
    "ZeroSpeedEngine": ("zerospeed.runtime.engine", "ZeroSpeedEngine"),
    "load_config": ("zerospeed.config", "load_config"),
    "ConfigError": ("zerospeed.config.errors", "ConfigError"),
    "DeepSpeedConfigError": ("zerospeed.config.errors", "DeepSpeedConfigError"),  # the same class (issue #27)
    "tp_model_init": ("zerospeed.module_inject", "tp_model_init"),
    "init_inference": ("zerospeed.inference.v1", "init_inference"),
    # DeepSpeed's top-level names (issue 20: scripts switch by changing the import)
    "add_config_arguments": ("zerospeed.arguments", "add_config_arguments"),
    "DeepSpeedEngine": ("zerospeed.runtime.engine", "ZeroSpeedEngine"),
    "PipelineModule": ("zerospeed.pipe", "PipelineModule"),
    "log_dist": ("zerospeed.utils", "log_dist"),
    "logger": ("zerospeed.utils", "logger"),
    "get_accelerator": ("zerospeed.accelerator", "get_accelerator"),
    "OnDevice": ("zerospeed.utils.init_on_device", "OnDevice"),  # issue #27
}

__all__ = ["ConfigError", "DeepSpeedConfigError", "DeepSpeedEngine", "OnDevice", "PipelineModule", "ZeroSpeedEngine", "__version__", "add_config_arguments",
           "get_accelerator", "init_distributed", "init_inference", "initialize", "load_config", "log_dist", "logger", "shutdown",
           "tp_model_init"]

_register_commands()  # `zerospeed serve`, `zerospeed --autotuning`: the launcher's table (zerospeed.cli)
_quiet_optional_imports()  # torchao's CUDA-library load failures on CPU torch (zerospeed._import_noise)


def _lazy_name(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'zerospeed' has no attribute {name!r}")


# every subpackage and module as an attribute (zerospeed.runtime.utils.set_random_seed after `import zerospeed`, as
# after `import deepspeed`), each package loading its submodules on first use (zerospeed._submodules, issue #27)
__getattr__ = _lazy_submodules(__name__, _lazy_name)
