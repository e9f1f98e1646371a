"""Pipeline parallelism: stage partitioning (``PipelineModule``) and schedules as data.

Everything here works without processes: schedules are generated, validated and simulated on
paper, and a ``PipelineModule`` can be built for any stage in one process. The runtime that
executes a schedule over torch.distributed consumes these objects.
"""
from zerospeed.pipe.layer_spec import LayerSpec, TiedLayerSpec
from zerospeed.pipe.module import PipelineModule
from zerospeed.pipe.partition import partition_balanced, partition_layers, partition_uniform
from zerospeed.pipe.schedule_action import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    matching_action,
    peer_stage,
    stage_to_rank,
    stages_of_rank,
)
from zerospeed.pipe.schedule_comm import insert_communication
from zerospeed.pipe.schedule_validate import validate_schedule
from zerospeed.pipe.schedules import (
    SCHEDULE_NAMES,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble_h1,
)
from zerospeed.pipe.simulate import (
    ActionCosts,
    SimulationResult,
    TimedAction,
    execute,
    format_timeline,
    peak_activations,
    simulate,
)
from zerospeed.pipe.topology import PipeDataParallelTopology, PipeTopology, ProcessTopology

__all__ = [
    "Action", "ActionCosts", "ActionKind", "LayerSpec", "PipeDataParallelTopology", "PipeTopology",
    "PipelineModule", "ProcessTopology", "SCHEDULE_NAMES", "Schedule", "ScheduleError",
    "SimulationResult", "TiedLayerSpec", "TimedAction", "build_schedule", "execute",
    "format_timeline", "gpipe", "insert_communication", "interleaved_1f1b", "matching_action",
    "one_f_one_b", "partition_balanced", "partition_layers", "partition_uniform",
    "peak_activations", "peer_stage", "simulate", "stage_to_rank", "stages_of_rank",
    "validate_schedule", "zero_bubble_h1",
]


from zerospeed._submodules import lazy_submodules as _lazy_submodules

__getattr__ = _lazy_submodules(__name__)  # zerospeed.<package>.<submodule> after `import zerospeed` (issue #27)
