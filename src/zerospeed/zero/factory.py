"""Choose the ZeRO strategy for a stage. The engine calls only :func:`build_strategy`.

Every strategy offers the same interface (see :class:`zerospeed.zero.strategy.DataParallelStrategy`):
``begin_backward(boundary)``, ``end_backward()``, ``step(loss_scale, max_norm) -> StepResult``,
``zero_grad()``, ``memory_bytes()``, ``num_buckets``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from zerospeed.zero import owners
from zerospeed.zero.strategy import DataParallelStrategy, StageOptions

if TYPE_CHECKING:
    from zerospeed.zero.stage3.strategy import Stage3Strategy

BUILT_STAGES = (0, 1, 2, 3)


def build_strategy(module: nn.Module, optimizer: torch.optim.Optimizer, options: StageOptions, zero_config: object,
                   dp_group: dist.ProcessGroup | None, dp_rank: int,
                   dp_world_size: int) -> DataParallelStrategy | Stage3Strategy:
    """The strategy object for ``options.stage``; ``zero_config`` is the parsed zero_optimization section."""
    strategy: DataParallelStrategy | Stage3Strategy
    if options.stage in (0, 1, 2):
        strategy = DataParallelStrategy(module, optimizer, options, dp_group, dp_rank, dp_world_size)
    elif options.stage == 3:  # reads its stage3_* knobs from zero_config
        from zerospeed.zero.stage3.strategy import Stage3Strategy

        strategy = Stage3Strategy(module, optimizer, options, zero_config, dp_group, dp_rank, dp_world_size)
    else:
        raise ValueError(f"no strategy for ZeRO stage {options.stage}")
    owners.register(strategy, strategy.managed_parameters())  # for DeepSpeed's tensor-fragment API
    return strategy
