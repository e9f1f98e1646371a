"""The ZeRO-3 optimizer step: stage 1-2's sharded step, minus the parameter all-gather.

:class:`~zerospeed.zero.partitioned_optimizer.ShardedOptimizerState` already does what stage 3
needs on flat shards: one fp32 master shard per bucket (the 16-bit parameter shard itself when
training in fp32), the optimizer's groups re-pointed at them, the global norm with one scalar
all-reduce, overflow skip, and a single averaging / unscaling / clipping multiply. Stages 1-2 then
all-gather every bucket; stage 3 only refreshes its parameter shards from the masters, because
parameters are gathered when a module next needs them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zerospeed.zero.partitioned_optimizer import ShardedOptimizerState
from zerospeed.zero.stage3.bucket import Stage3Bucket


class Stage3OptimizerState(ShardedOptimizerState):
    def __init__(self, buckets: list[Stage3Bucket], optimizer: torch.optim.Optimizer,
                 dp_group: dist.ProcessGroup | None, dp_world_size: int, options: Any = None) -> None:
        master = getattr(options, "master_dtype", torch.float32)
        super().__init__(buckets, optimizer, master, True, dp_group, dp_world_size,  # type: ignore[arg-type]
                         options=options)
        for b, master in zip(buckets, self.masters):
            b.master = None if master is b.shard else master
        if self.offload is not None and self.offload.swap_master:  # masters on NVMe: edits go there
            for slot in self.offload.slots:
                slot.bucket.master = None
                slot.bucket.master_sink = self.offload.overwrite_master

    def _publish_params(self, skip: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        with torch.no_grad():
            for b, master in zip(self.buckets, self.masters):
                if master is not b.shard and id(b) not in skip:
                    with self._resident([b]):
                        b.shard.copy_(master)
