"""Data-parallel ZeRO stages 0, 1 and 2, composed from buckets, a reducer and the optimizer state.

=====  ==========================  ===========================  ===============================
stage  gradients                   reduction                    optimizer state / master
=====  ==========================  ===========================  ===============================
0      full, persistent buffer     all-reduce per bucket at the full
                                   accumulation boundary
1      full, persistent buffer     reduce-scatter per bucket at 1/N (flat shard per bucket)
                                   the accumulation boundary
2      1/N shard; full buffer only reduce-scatter per bucket on 1/N (flat shard per bucket)
       while a bucket is in flight every micro-step
=====  ==========================  ===========================  ===============================

Stages 1-2 all-gather updated parameters per bucket after the step. The bucket size is
``reduce_bucket_size`` elements; for stages 1-2 it is capped by ``allgather_bucket_size`` too,
because a bucket is also the unit of the all-gather (so both limits hold as upper bounds).

With ``offload_optimizer`` the bucket size is also capped at ``sub_group_size`` elements per rank,
because a bucket's shard is the offload tier's unit (see :mod:`zerospeed.zero.offload.tier`).

Parameters that the optimizer does not hold (frozen, ``requires_grad=False``, or left out of
``model_parameters``) are not bucketed: they get no hooks and no reduction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from zerospeed import comm
from zerospeed.zero.flat_bucket import FlatBucket
from zerospeed.zero.layout import plan_buckets
from zerospeed.zero.partitioned_optimizer import ShardedOptimizerState, ShardView, StepResult, optimizer_group_of
from zerospeed.zero.reducer import GradientReducer


@dataclass(frozen=True)
class StageOptions:
    stage: int
    reduce_bucket_size: int
    allgather_bucket_size: int
    overlap_comm: bool
    comm_dtype: torch.dtype | None = None
    prescale: float = 1.0
    offload_optimizer: Any = None  # config.zero.OffloadOptimizerConfig, enabled, or None
    offload_param: Any = None  # config.zero.OffloadParamConfig, enabled, or None (stage 3 only)
    aio: Any = None  # config.zero.AioConfig: the NVMe I/O engine's settings
    fast_paths: Any = None  # config.FastPathsConfig: adam_kernel (offloaded step), direct_io (NVMe files)
    sub_group_size: int = 1_000_000_000
    master_dtype: torch.dtype = torch.float32  # bf16 with bf16.bf16_master_weights_and_grads
    #: dtype gradients are accumulated in over micro-batches (``data_types.grad_accum_dtype``); None: the model's
    grad_accum_dtype: torch.dtype | None = None
    #: parameter -> (process group, rank in it, its size) for parameters not reduced over the dp group
    #: (mixture-of-experts expert parameters: their expert-data-parallel group); None: all use dp
    group_of_param: Callable[[nn.Parameter], tuple[Any, int, int] | None] | None = None
    #: stage 3: module name -> the same label on every rank (MoE experts are named by global index)
    unit_name: Callable[[str], str] | None = None


def _comm_of_groups(named: list[tuple[str, nn.Parameter]], group_of: dict[int, int],
                    group_of_param: Callable[[nn.Parameter], tuple[Any, int, int] | None] | None
                    ) -> dict[int, tuple[Any, int, int]]:
    """Optimizer group index -> (process group, rank, size) for groups not reduced over the dp group.

    Buckets never mix optimizer groups, so a group is the unit that picks a process group: every
    parameter of one optimizer group must agree (expert parameters in groups of their own, as
    ``zerospeed.moe.utils.split_params_into_different_moe_groups_for_optimizer`` makes them).
    """
    if group_of_param is None:
        return {}
    chosen: dict[int, tuple[Any, int, int] | None] = {}
    first_name: dict[int, str] = {}
    for name, p in named:
        gi = group_of[id(p)]
        spec = group_of_param(p)
        if gi not in chosen:
            chosen[gi], first_name[gi] = spec, name
        elif (spec is None) != (chosen[gi] is None) or (spec is not None and spec[0] is not chosen[gi][0]):
            raise ValueError(f"optimizer parameter group {gi} mixes expert and dense parameters ({first_name[gi]!r} "
                             f"and {name!r}), which are reduced over different process groups; build the "
                             "optimizer's groups with zerospeed.moe.utils.split_params_into_different_moe_groups_"
                             "for_optimizer(...)")
    return {gi: spec for gi, spec in chosen.items() if spec is not None}


class DataParallelStrategy:
    """Owns every bucket of one module and drives its gradients and optimizer for stages 0-2."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, options: StageOptions,
                 dp_group: dist.ProcessGroup | None, dp_rank: int, dp_world_size: int) -> None:
        if options.stage not in (0, 1, 2):
            raise ValueError(f"DataParallelStrategy handles stages 0-2, got {options.stage}")
        self.options = options
        self.dp_world_size = dp_world_size
        group_of = optimizer_group_of(module, optimizer)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and id(p) in group_of]
        ordered = list(reversed(named))  # gradients become ready roughly in reverse registration order
        sharded = options.stage >= 1
        bucket_numel = options.reduce_bucket_size
        if sharded:
            bucket_numel = min(bucket_numel, options.allgather_bucket_size)
        if options.offload_optimizer is not None:  # a bucket is the offload sub-group
            bucket_numel = min(bucket_numel, options.sub_group_size * dp_world_size)
        comm_of_group = _comm_of_groups(named, group_of, options.group_of_param)
        group_world = {gi: size for gi, (_, _, size) in comm_of_group.items()} if sharded else None
        layouts = plan_buckets([(n, tuple(p.shape), group_of[id(p)]) for n, p in ordered], bucket_numel,
                               dp_world_size if sharded else 1, group_world)
        grad_mode = "transient" if options.stage == 2 else "persistent"
        self.buckets = []
        for layout in layouts:
            group, rank, size = comm_of_group.get(layout.group_index, (dp_group, dp_rank, dp_world_size))
            bucket = FlatBucket(layout, [ordered[s.index][1] for s in layout.slots], rank, sharded, grad_mode,
                                grad_dtype=options.grad_accum_dtype)
            bucket.comm_group, bucket.comm_rank, bucket.comm_size = group, rank, size  # where its collectives run
            self.buckets.append(bucket)
        self.reducer = GradientReducer(self.buckets, "reduce_scatter" if sharded else "all_reduce", dp_group,
                                       comm_dtype=options.comm_dtype, overlap=options.overlap_comm or options.stage == 0,
                                       prescale=options.prescale)
        self.state = ShardedOptimizerState(self.buckets, optimizer, options.master_dtype, sharded, dp_group, dp_world_size,
                                           options=options)
        # 1-bit Adam (ops/onebit_adam.py) exchanges compressed momenta itself after its warm-up: the engine's
        # gradient all-reduce is skipped then (DeepSpeed's enable_backward_allreduce = False)
        self._communicates = getattr(optimizer, "communicates_gradients", None)
        if self._communicates is not None:
            if sharded:
                raise ValueError(f"optimizer.type: {type(optimizer).__name__} works at ZeRO stage 0 (as in DeepSpeed), "
                                 f"got zero_optimization.stage {options.stage}")
            optimizer.bind_data_parallel_group(dp_group)
            self._dp_group = dp_group

    def _optimizer_communicates(self) -> bool:
        return self._communicates is not None and bool(self._communicates())

    def begin_backward(self, boundary: bool) -> None:
        self.reducer.begin(reduce_now=boundary and not self._optimizer_communicates())

    def end_backward(self) -> None:
        self.reducer.finish()

    def step(self, loss_scale: float, max_norm: float, force_skip: bool = False,
             norm_sq_hook: Callable[[torch.Tensor], torch.Tensor] | None = None) -> StepResult:
        if self.reducer.stray_backward:
            raise RuntimeError("gradients were produced by a backward pass that started neither in "
                               "engine.backward(loss) nor from the engine's output (was the model called directly "
                               "instead of engine(...)?); call engine.backward(loss) on the engine's output")
        if self._optimizer_communicates():  # local, unreduced gradients: unscale only; skip together on overflow
            local = self.state.grad_norm_sq_local().reshape(1)
            overflow = torch.tensor([0.0 if bool(torch.isfinite(local).all()) else 1.0])
            comm.all_reduce(overflow, op=comm.ReduceOp.MAX, group=self._dp_group)
            return self.state.step(loss_scale / self.dp_world_size, max_norm, force_skip or bool(overflow.item()),
                                   norm_sq_hook)
        # gradients were multiplied by `prescale` before the reduction; the step divides it out again
        return self.state.step(loss_scale * self.options.prescale, max_norm, force_skip, norm_sq_hook)

    def shard_views(self) -> list[ShardView]:
        """This rank's shards, addressable by parameter name and offset (see :class:`ShardView`)."""
        return self.state.shard_views()

    def after_checkpoint_load(self) -> None:
        """Masters were overwritten by a checkpoint load: refresh the 16-bit parameters from them
        and, when sharded, all-gather every bucket so each rank holds the full model again."""
        self.state._publish_params()

    def managed_parameters(self) -> list[nn.Parameter]:
        """Parameters whose storage this strategy owns (the bucketed, trainable ones)."""
        return [p for b in self.buckets for p in b.params]

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.zero_grad()

    def memory_bytes(self) -> dict[str, int]:
        return {
            "params": sum(b.param_bytes() for b in self.buckets),
            "grads": sum(b.grad_bytes() for b in self.buckets),
            "master_params": self.state.master_bytes(),
            "optimizer_states": self.state.optimizer_state_bytes(),
            "comm_buffers_peak": self.reducer.peak_comm_buffer_bytes,
            **self.state.offload_memory_bytes(),
        }

    def close(self) -> None:
        """Release what outlives a step (NVMe swap files of offloaded optimizer states)."""
        self.state.close()

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)
