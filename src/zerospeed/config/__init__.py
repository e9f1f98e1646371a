"""zerospeed's configuration: DeepSpeed JSON in, frozen typed objects out.

``load_config(dict | path | ZeroSpeedConfig, dp_world_size=...)`` is the entry point; the facade uses
``prepare_config`` (read once, tensor-parallel degree first, then ``resolve(dp_world_size)``) and public
entry points that need one section of a whole config ``load_section``. Every problem is a one-line
:class:`ConfigError` naming the key path. Nothing outside config/ reads a raw config dict.
"""

from __future__ import annotations

from .errors import ConfigError
from .fast_paths import FastPathsConfig
from .hybrid_engine import HybridEngineConfig
from .loader import (PreparedConfig, load_config, load_section, parse_tensor_parallel, prepare_config,
                     read_config_source, tensor_parallel_of)
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
    "HybridEngineConfig",
    "OPTIMIZER_NAMES",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "PreparedConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "SCHEDULER_NAMES",
    "SchedulerConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "ZeroConfig",
    "ZeroSpeedConfig",
    "load_config",
    "load_section",
    "parse_tensor_parallel",
    "prepare_config",
    "read_config_source",
    "tensor_parallel_of",
]
