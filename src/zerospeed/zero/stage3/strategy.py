"""ZeRO stage 3: parameters, gradients and optimizer states all partitioned over the data-parallel group.

Mixture-of-experts expert parameters are partitioned over their expert-data-parallel group instead
(``options.group_of_param``): their buckets all-gather and reduce-scatter over that group, and
``options.unit_name`` gives modules labels that agree across expert-parallel ranks (see the planner).

Composed from small parts (each module says more):

* :mod:`~zerospeed.zero.stage3.planner` - module units and their buckets (adopting a ``zero.Init`` model);
* :mod:`~zerospeed.zero.stage3.bucket` - one bucket's shard, full buffer and the ``param.data`` swap;
* :mod:`~zerospeed.zero.stage3.hooks` - gather before a module's forward / backward, release after;
* :mod:`~zerospeed.zero.stage3.prefetch` - trace of the first step, prefetch, reuse and live bounds;
* :mod:`~zerospeed.zero.stage3.grads` - per-bucket reduce-scatter into the gradient shards;
* :mod:`~zerospeed.zero.stage3.optim` - the sharded optimizer step (no all-gather afterwards);
* :mod:`~zerospeed.zero.stage3.watchdog` - time-outs that name the diverging module and ranks;
* :mod:`~zerospeed.zero.stage3.param_offload` - ``offload_param``: shards on NVMe / in host memory
  between uses.

Parameter offload: a bucket's shard is resident while its all-gather reads it (the bucket sees to
that), while the optimizer step updates it (the optimizer state swaps shards in group by group,
see :mod:`~zerospeed.zero.stage3.param_offload`), and inside :meth:`Stage3Strategy.resident_params` (checkpoints). Since
the checkpoint code reads the shards through :meth:`~Stage3Strategy.shard_views`, a call to
``shard_views()`` / ``frozen_shard_views()`` outside ``resident_params()`` also makes every shard
resident and keeps it so until the next forward, step, backward, checkpoint-load refresh or
``close()`` (so the views it returned stay valid while a save or load uses them).

Per rank, with Ψ parameters and N ranks: 16-bit shards 2Ψ/N, gradient shards 2Ψ/N, fp32 master and
Adam moments 12Ψ/N (fp32 training: 4 + 4 + 8 bytes per element / N), plus padding (at most N-1
elements per bucket), persistent parameters in full, the live gathered buffers (bounded by
``stage3_max_live_parameters`` beyond what one module needs) and the transient gradient buffers
of at most three buckets. Per step (accumulation 1, no persistence or reuse): all-gather Ψ in
forward, Ψ in backward, reduce-scatter Ψ: 3Ψ elements.

Gradient accumulation: gradients are reduce-scattered every micro-step (there is no full-size
gradient to keep) and summed into the shards; ``boundary`` only matters to the step.
"""

from __future__ import annotations

import contextlib
import re
from collections import OrderedDict
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from zerospeed.comm import hierarchical
from zerospeed.zero import zeropp
from zerospeed.zero.partitioned_optimizer import ShardView, StepResult, optimizer_group_of
from zerospeed.zero.stage3 import offload_view, registry
from zerospeed.zero.stage3.bucket import BucketState, Stage3Bucket
from zerospeed.zero.stage3.grads import Stage3GradReducer
from zerospeed.zero.stage3.hooks import BucketGatherer, Stage3Knobs, Stage3Runtime
from zerospeed.zero.stage3.implicit_params import explain_forward_error
from zerospeed.zero.stage3.optim import Stage3OptimizerState
from zerospeed.zero.stage3.param_offload import ParamSwapper, build_param_swapper
from zerospeed.zero.stage3 import state_dict_guard
from zerospeed.zero.stage3.planner import PlannerOptions, build_buckets
from zerospeed.zero.stage3.watchdog import Watchdog


#: what torch says when autograd meets a released (zero-sized) parameter: a saved tensor or a gradient of size 0
_ZERO_SIZED = re.compile(r"storage of size 0|tensor [ab] \(0\)|\(0\) must match")


class Stage3Strategy:
    """Owns every ZeRO-3 bucket of one module and drives gathers, gradients and the optimizer."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, options: Any, zero_config: Any,
                 dp_group: dist.ProcessGroup | None, dp_rank: int, dp_world_size: int) -> None:
        if options.stage != 3:
            raise ValueError(f"Stage3Strategy handles stage 3, got {options.stage}")
        self.module = module
        self.options = options
        self.dp_group = dp_group
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.gather_16bit_weights_on_model_save = bool(zero_config.stage3_gather_16bit_weights_on_model_save)
        group_of = optimizer_group_of(module, optimizer)
        self.watchdog = Watchdog.for_group(dp_group, zero_config.stage3_collective_timeout_s)
        adopter = BucketGatherer(self.watchdog)
        planner = PlannerOptions(int(zero_config.stage3_param_persistence_threshold),
                                 int(zero_config.stage3_model_persistence_threshold))
        self.buckets, plans = build_buckets(module, group_of, planner, dp_group, dp_rank, dp_world_size, adopter,
                                            getattr(options, "group_of_param", None),
                                            getattr(options, "unit_name", None))
        knobs = Stage3Knobs(prefetch_numel=int(zero_config.stage3_prefetch_bucket_size),
                            max_live_numel=int(zero_config.stage3_max_live_parameters),
                            max_reuse_distance=int(zero_config.stage3_max_reuse_distance))
        self.runtime = Stage3Runtime(module, plans, self.buckets, knobs, self.watchdog)
        offload_view.adopt(optimizer, self.runtime)  # DeepSpeed's optimizer.parameter_offload (TRL's generation)
        self.reducer = Stage3GradReducer(self.buckets, dp_group, self.watchdog, self.runtime.on_grads_done,
                                         comm_dtype=options.comm_dtype, overlap=options.overlap_comm,
                                         prescale=options.prescale)
        for b in self.buckets:  # ZeRO++ (zero/zeropp.py): which gathers and reductions are quantized
            b.quantized_gather = bool(zero_config.zero_quantized_weights
                                      or (zero_config.zero_quantized_nontrainable_weights and not b.trainable))
        self.reducer.quantized_gradients = bool(zero_config.zero_quantized_gradients)
        leaves = {id(m): m for m in registry.leaf_units(module).values()}  # DeepSpeed's z3 leaf modules
        self.reducer.deferred = {b.index for key in leaves for b in plans[key].buckets}
        if self.reducer.quantized_gradients or any(b.quantized_gather for b in self.buckets):
            zeropp.kernel_path(getattr(getattr(options, "fast_paths", None), "block_quant", "auto"))
        if zero_config.zero_hpz_partition_size > 1:  # ZeRO++ hpZ: secondary partitions (dp buckets, not experts')
            hpz_group = hierarchical.consecutive_subgroup(dp_group, int(zero_config.zero_hpz_partition_size))
            for b in self.buckets:
                if b.group is dp_group:
                    b.hpz_group = hpz_group
        self.trainable = [b for b in self.buckets if b.trainable]
        accum = getattr(options, "grad_accum_dtype", None)
        for b in self.trainable if accum is not None else ():
            b.accumulate_grads_in(accum)  # reduced shards summed in fp32 (bf16 + data_types.grad_accum_dtype)
        self.state = Stage3OptimizerState(self.trainable, optimizer, dp_group, dp_world_size, options)
        # after the optimizer state: it reads the shards to build its masters (mixed precision)
        self.swapper: ParamSwapper | None = build_param_swapper(
            self.buckets, getattr(options, "offload_param", None), getattr(options, "aio", None), dp_rank,
            getattr(getattr(options, "fast_paths", None), "direct_io", "auto"))
        self.state.residency = self.swapper  # the step swaps shards in one bucket at a time
        self._resident_depth = 0  # open resident_params() blocks
        self.graph_owned = False  # DeepCompile's graphs own gathers and reductions (hand_over_to_graph)
        self._view_hold = contextlib.ExitStack()  # shards held since shard_views() (see the module docstring)
        self._view_held = False
        self.runtime.on_begin_pass = self._begin_pass
        self.runtime.gather_persistent()
        state_dict_guard.guard_tree(module)  # module.state_dict() refuses to return placeholders

    # -- the strategy interface -------------------------------------------------------------------
    def explain_forward_error(self, error: BaseException) -> str | None:
        """Why a forward failed, when a submodule parameter it read was not gathered (else None)."""
        def is_gathered(p: nn.Parameter) -> bool | None:
            found = registry.lookup(p)
            return None if found is None else found[0].state is BucketState.GATHERED

        def plan_params(m: nn.Module) -> set[int]:
            plan = self.runtime.plans.get(id(m))
            return {id(q) for b in (plan.buckets if plan else []) for _, q in b.live_params()}

        return explain_forward_error(self.module, error, is_gathered, plan_params)

    def explain_backward_error(self, error: BaseException) -> str | None:
        """Why a backward failed, when its forward ran while ``zero.GatheredParameters`` held parameters that the
        context released before the backward (a forward reading them outside their module's forward cannot get
        their gradient into a partitioned placeholder); else None."""
        released = [p for p in self.runtime.held_in_forward
                    if (found := registry.lookup(p)) is not None and found[0].state is BucketState.RELEASED]
        if not released or not isinstance(error, RuntimeError) or not _ZERO_SIZED.search(str(error)):
            return None
        names = {id(p): n for n, p in self.module.named_parameters()}
        listed = ", ".join(repr(names.get(id(p), tuple(p.shape))) for p in released)
        return (f"ZeRO-3: backward failed after a forward that ran inside zero.GatheredParameters holding {listed}, "
                "released when that context exited, before this backward. A forward that reads a parameter without "
                "calling its module needs it gathered in backward too: gather it inside the model's forward (zerospeed "
                "then registers it as an external parameter of the model), or declare it with "
                "zerospeed.zero.register_external_parameter(module, parameter) "
                f"(original error: {type(error).__name__}: {error})")

    def hand_over_to_graph(self) -> None:
        """DeepCompile's graphs gather, release and reduce from now on (``zerospeed.compile.deepcompile``):
        remove the module and gradient hooks and release every bucket; the shards stay authoritative."""
        self.runtime.remove_hooks()
        self.reducer.remove_hooks()
        self.graph_owned = True
        self._release_gathered()

    def _release_gathered(self) -> None:
        for b in self.buckets:
            if not b.pins:
                self.runtime.release(b)

    def begin_backward(self, boundary: bool) -> None:
        del boundary  # stage 3 reduces every micro-step
        self._end_view_hold()
        if self.graph_owned:
            return
        self.runtime.begin_backward()
        self.reducer.begin()

    def end_backward(self) -> None:
        if self.graph_owned:
            return
        try:
            self.reducer.finish()
        finally:
            self.runtime.end_backward()

    def step(self, loss_scale: float, max_norm: float, force_skip: bool = False,
             norm_sq_hook: Callable[[torch.Tensor], torch.Tensor] | None = None) -> StepResult:
        if self.reducer.stray_backward or self.runtime.stray_backward:
            raise RuntimeError("gradients were produced by a backward pass that started neither in "
                               "engine.backward(loss) nor from the engine's output (was the model called directly "
                               "instead of engine(...)?); call engine.backward(loss) on the engine's output")
        if self.swapper is not None:
            self._end_view_hold()
        # with offload_param the optimizer state swaps shards in bucket by bucket (state.residency)
        result = self.state.step(loss_scale * self.options.prescale, max_norm, force_skip, norm_sq_hook)
        self._drop_secondaries()  # hpZ: the shards changed
        if self.graph_owned:
            self._release_gathered()  # a checkpoint gather may have left a (now stale) bucket gathered
        elif not result.overflow:
            self.runtime.release_all()
            self.runtime.gather_persistent()  # persistent parameters are gathered from the new shards
        return result

    def zero_grad(self) -> None:
        for b in self.trainable:
            assert b.grad_shard is not None
            b.grad_shard.zero_()
        for b in self.buckets:
            for _, p in b.live_params():
                p.grad = None

    def managed_parameters(self) -> list[nn.Parameter]:
        """Every parameter of the module: stage 3 owns the storage of all of them."""
        return [p for b in self.buckets for _, p in b.live_params()]

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def num_parameters(self) -> int:
        """Elements of the whole model (a tied weight once): ``p.numel()`` is 0 for a partitioned parameter."""
        return sum(b.layout.numel for b in self.buckets)

    def memory_bytes(self) -> dict[str, int]:
        """Model-state bytes on this rank. ``params``: 16-bit shards plus persistent parameters in
        full; ``gathered_params_peak`` / ``_live``: full buffers of gathered (non-persistent) buckets.

        With ``offload_param``, ``params`` counts only the shards resident now; ``params_swapped_in`` is
        the part of it that is offloaded shards swapped in (in use or cached: at most ``buffer_count``
        beyond those in use), ``param_swap_buffers`` the aligned host staging buffers of NVMe I/O,
        ``params_on_nvme`` the bytes of this rank's swap file and ``params_on_host`` the host copies of
        ``device: cpu`` offload from an accelerator."""
        swap = self.swapper.memory_bytes() if self.swapper is not None else \
            {"params_swapped_in": 0, "param_swap_buffers": 0, "params_on_nvme": 0, "params_on_host": 0}
        return {
            "params": sum(b.shard_bytes() for b in self.buckets) + sum(b.full_bytes for b in self.buckets
                                                                         if b.persistent),
            "grads": sum(b.grad_bytes() for b in self.buckets),
            "master_params": self.state.master_bytes(),
            "optimizer_states": self.state.optimizer_state_bytes(),
            "comm_buffers_peak": self.reducer.peak_comm_buffer_bytes,
            "gathered_params_peak": self.runtime.live_peak_bytes,
            "gathered_params_live": self.runtime.live_bytes,
            **swap,
            **self.state.offload_memory_bytes(),
        }

    # -- residency of offloaded shards (offload_param) ------------------------------------------------
    @contextlib.contextmanager
    def resident_params(self, dirty: bool = False) -> Iterator[None]:
        """Keep every bucket's shard resident for the block (checkpoint save / load).

        ``dirty``: the block writes the shards (they are written back to NVMe / host when evicted);
        a load that does not say so is covered by :meth:`after_checkpoint_load`, which marks them
        dirty. Without ``offload_param`` it does nothing. Not a collective.
        """
        if self.swapper is None:
            yield
            return
        self._resident_depth += 1
        try:
            with self.swapper.hold(self.buckets, dirty=dirty):
                yield
        finally:
            self._resident_depth -= 1

    @property
    def checkpoint_needs_copy(self) -> bool:
        """A save must copy the shards: offloaded ones are swapped out again after ``resident_params()``."""
        return self.swapper is not None

    def _hold_for_views(self) -> None:
        if self.swapper is not None and not self._resident_depth and not self._view_held:
            self._view_hold.enter_context(self.swapper.hold(self.buckets))
            self._view_held = True

    def _begin_pass(self) -> None:
        self._end_view_hold()
        self._drop_secondaries()  # hpZ: a secondary partition lives from a forward's gather to its backward

    def _drop_secondaries(self) -> None:
        for b in self.buckets:
            b.drop_secondary()

    def _end_view_hold(self, dirty: bool = False) -> None:
        if not self._view_held:
            return
        self._view_held = False
        assert self.swapper is not None
        if dirty:
            for b in self.buckets:
                self.swapper.mark_dirty(b)
        self._view_hold.close()
        self._view_hold = contextlib.ExitStack()

    def shard_views(self) -> list[ShardView]:
        """Trainable buckets' shards, addressable by parameter name and offset (for checkpoints).

        With ``offload_param`` the shards are made resident (see the module docstring)."""
        self._hold_for_views()
        return self.state.shard_views()

    def frozen_shard_views(self) -> list[ShardView]:
        """Buckets the optimizer does not update (frozen parameters): weight shard only, no optimizer state;
        ``master`` is the 16-bit shard itself."""
        self._hold_for_views()
        return [ShardView(b.layout, b.shard_start, b.shard_end, b.shard, b.shard, [])
                for b in self.buckets if not b.trainable]

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's full state dict (16-bit weights, buffers) on rank 0, ``{}`` on the others.

        A collective: every rank of the data-parallel group must call it. Buckets are gathered one
        at a time, so besides the result only one bucket is whole at once. Tied parameters appear
        under each of their names, as in ``module.state_dict()``.
        """
        names: dict[int, list[str]] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        on_rank0 = self.dp_rank == 0
        full: dict[str, torch.Tensor] = {}
        for b in self.buckets:
            self.runtime.pin([b], "consolidated_state_dict")
            try:
                if on_rank0:
                    for pos, p in b.live_params():
                        value = b.slot_view(pos).detach().clone()
                        for name in names.get(id(p), []):
                            full[name] = value
            finally:
                self.runtime.unpin([b])
        if not on_rank0:
            return {}
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        for key, value in self.module.state_dict(keep_vars=True).items():  # keep_vars: no placeholder check
            out[key] = full[key] if key in full else value.detach()
        return out

    def on_shards_loaded(self) -> None:
        """Call after writing into the shards (checkpoint load): gathered copies are stale now."""
        self.runtime.release_all()
        self._drop_secondaries()
        with self.resident_params(dirty=True):
            for b in self.buckets:
                if b.master is not None:
                    b.shard.copy_(b.master)
        self._end_view_hold(dirty=True)
        self.runtime.gather_persistent()

    def after_checkpoint_load(self) -> None:
        """The checkpoint loader's hook (same name on every strategy)."""
        self.on_shards_loaded()

    def close(self) -> None:
        """Remove every hook (the parameters stay partitioned). With ``offload_param`` the swap folder
        is removed too, and with it the offloaded parameter values: the strategy is unusable after."""
        self.runtime.remove_hooks()
        self.reducer.remove_hooks()
        self.state.close()  # NVMe swap files of offloaded optimizer states
        if self.swapper is not None:
            self._end_view_hold()
            self.swapper.close()


__all__ = ["Stage3Bucket", "Stage3Strategy"]
