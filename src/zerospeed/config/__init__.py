"""zerospeed's configuration: DeepSpeed JSON in, frozen typed objects out.

``load_config(dict | path | ZeroSpeedConfig, dp_world_size=...)`` is the only entry point the rest
of the library should use; every problem is a one-line :class:`ConfigError` naming the key path.
"""

from __future__ import annotations

from .errors import ConfigError
from .fast_paths import FastPathsConfig
from .loader import load_config
from .names import OPTIMIZER_NAMES, SCHEDULER_NAMES
from .schema import ZeroSpeedConfig
from .sections import (
    ActivationCheckpointingConfig,
    BF16Config,
    CheckpointConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    DataTypesConfig,
    FP16Config,
    OptimizerConfig,
    PipelineConfig,
    SchedulerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from .zero import AioConfig, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "ActivationCheckpointingConfig",
    "AioConfig",
    "BF16Config",
    "CSVMonitorConfig",
    "CheckpointConfig",
    "CommsLoggerConfig",
    "ConfigError",
    "DataTypesConfig",
    "FP16Config",
    "FastPathsConfig",
    "OPTIMIZER_NAMES",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "SCHEDULER_NAMES",
    "SchedulerConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "ZeroConfig",
    "ZeroSpeedConfig",
    "load_config",
]
