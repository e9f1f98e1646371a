"""Master weights and the optimizer step over this rank's shards (ZeRO stages 0-2).

:class:`ShardedOptimizerState` takes the user's torch optimizer (built over the model's
parameters) and re-points each of its parameter groups at the tensors this rank updates:

* stage 0, fp32: the model's own parameters (nothing changes; per-parameter optimizers such as
  Lamb keep their semantics);
* stage 0, bf16/fp16: per-parameter fp32 master views of one flat fp32 master per bucket;
* stages 1-2: one flat shard per bucket (fp32 master, or a view of the fp32 parameter buffer when
  training in fp32), so the optimizer's states exist only for 1/N of the model. This needs an
  element-wise optimizer (Adam family, SGD, Adagrad, ...); see :data:`ELEMENTWISE_OPTIMIZERS`.

Lr schedulers keep working because only ``group["params"]`` is replaced; ``lr``, ``betas`` and
the rest of each group stay where the scheduler writes them.

The step: gradients arrive summed over ranks and micro-batches and multiplied by the loss scale.
One fp32 norm pass gives the global gradient norm (one scalar all-reduce when sharded), which also
detects overflow (a non-finite norm). A single multiply pass then averages over ranks, unscales
and clips (torch's ``clip_grad_norm_`` coefficient ``max_norm / (norm + 1e-6)``). After the
optimizer updates the masters, 16-bit parameters are refreshed from them and, when sharded, every
bucket is all-gathered (asynchronously, all buckets in flight, then waited).

Offload (``options.offload_optimizer``): the buckets chosen by ``ratio`` belong to an
:class:`~zerospeed.zero.offload.tier.OffloadTier` (fp32 master in host memory, Adam states in host
memory or on NVMe, CPU Adam update). They stay in the user's param groups, so lr schedulers and
checkpoints see them, but never get a ``.grad``, so the torch optimizer skips them. A failure in
the offloaded update (an NVMe error) is agreed on by all ranks with one small all-reduce before
anything else collective happens, so every rank raises instead of the others hanging. Non-Adam optimizers
are *host-held* instead (their own step on host-memory masters); with ``device: nvme`` their states are
swapped by :class:`~zerospeed.zero.offload.host_held.HostHeldNvmeStates`, I/O failures agreed on likewise.
"""

from __future__ import annotations

import math
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist

from zerospeed import comm
from zerospeed.zero.flat_bucket import FlatBucket
from zerospeed.zero.layout import BucketLayout
from zerospeed.zero.offload.host_held import HostHeldNvmeStates
from zerospeed.zero.offload.tier import OffloadTier, choose_offloaded, same_memory
from zerospeed.zero.optimizer_kinds import ELEMENTWISE_OPTIMIZERS, host_held_optimizer

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ShardView", "ShardedOptimizerState", "StepResult", "optimizer_group_of"]


def optimizer_group_of(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """``id(param) -> index of its optimizer parameter group``, checking what a strategy needs:
    each tensor in one group only, every tensor a parameter of ``module``, no optimizer state yet."""
    group_of: dict[int, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) in group_of:
                raise ValueError("a parameter appears in two optimizer parameter groups")
            group_of[id(p)] = gi
    known = {id(p) for p in module.parameters()}
    unknown = [i for i in group_of if i not in known]
    if unknown:
        raise ValueError(f"the optimizer holds {len(unknown)} tensor(s) that are not parameters of the model")
    if optimizer.state:
        raise ValueError("the optimizer already has state; pass a freshly built optimizer to initialize()")
    return group_of


@dataclass(frozen=True)
class ShardView:
    """What one bucket's shard holds on this rank, for checkpointing and inspection.

    ``master`` is the fp32 master shard (elements ``[shard_start, shard_end)`` of the bucket's flat
    layout; the whole bucket when not sharded); ``param_shard`` the same range of the 16/32-bit
    parameter buffer; ``opt_tensors`` the tensors the optimizer holds for this bucket (keys of
    ``optimizer.state``): either ``[master]`` (flat), or one parameter-shaped view per slot.
    """

    layout: BucketLayout
    shard_start: int
    shard_end: int
    master: torch.Tensor
    param_shard: torch.Tensor
    opt_tensors: list[torch.Tensor]
    #: (rank, world) over which a replicated bucket is split when saving: its own reduction group
    #: (MoE experts: expert-data-parallel); None: the data-parallel group
    split: tuple[int, int] | None = None


@dataclass
class StepResult:
    grad_norm: float  # global gradient norm before clipping (unscaled)
    overflow: bool  # non-finite gradients: the step was skipped


class ShardedOptimizerState:
    def __init__(self, buckets: list[FlatBucket], optimizer: torch.optim.Optimizer, master_dtype: torch.dtype,
                 sharded: bool, dp_group: dist.ProcessGroup | None, dp_world_size: int, options: Any = None) -> None:
        self.buckets = buckets
        self.optimizer = optimizer
        self.sharded = sharded
        self.dp_group = dp_group
        self.dp_world_size = dp_world_size
        offload_cfg = getattr(options, "offload_optimizer", None)
        offloaded = set(choose_offloaded([b.param_shard().numel() for b in buckets], float(offload_cfg.ratio))) \
            if offload_cfg is not None else set()
        #: buckets whose master and optimizer state live in host memory and that the user's optimizer itself
        #: steps there: Muon's and other non-Adam element-wise optimizers' (the offload tier's step is Adam's)
        self.host_held: set[int] = set()
        if offloaded and host_held_optimizer(optimizer):
            self.host_held, offloaded = offloaded, set()
        self.masters: list[torch.Tensor] = []
        self._opt_tensors: list[list[torch.Tensor]] = []
        for bi, b in enumerate(buckets):
            shard = b.param_shard()
            if (bi in offloaded or bi in self.host_held) and (shard.device.type != "cpu" or b.dtype != master_dtype):
                pin = bool(offload_cfg.pin_memory) and torch.cuda.is_available()
                master = torch.empty(shard.numel(), dtype=master_dtype, pin_memory=pin)
                master.copy_(shard.detach())
            else:
                master = shard.detach().to(master_dtype).clone() if b.dtype != master_dtype else shard
            self.masters.append(master)
            if sharded:
                self._opt_tensors.append([master])
            elif b.dtype == master_dtype:
                self._opt_tensors.append(list(b.params))
            else:
                self._opt_tensors.append(b.param_views_of(master))
        self.separate_master = any(not same_memory(m, b.param_shard()) for b, m in zip(buckets, self.masters))
        # an optimizer whose arithmetic depends on the order of its tensors (1-bit LAMB compresses them as one
        # concatenated buffer) keeps the order the user gave; the others see the buckets' order
        keep_order = not sharded and getattr(optimizer, "order_sensitive", False)
        for gi, group in enumerate(optimizer.param_groups):
            tensors = [t for b, ts in zip(buckets, self._opt_tensors) if b.layout.group_index == gi for t in ts]
            if keep_order:  # at stage 0 a bucket's tensors are its parameters' (or their masters' views), in order
                given = {id(p): k for k, p in enumerate(group["params"])}
                order = [given.get(id(p), len(given)) for b in buckets if b.layout.group_index == gi for p in b.params]
                tensors = [t for _, t in sorted(zip(order, tensors), key=lambda kt: kt[0])]
            group["params"] = tensors
        self.offloaded = offloaded
        # Muon: each matrix orthogonalised by one owner rank (zerospeed.zero.muon_shards)
        from zerospeed.zero.muon_shards import bind_sharded_muon

        bind_sharded_muon(optimizer, buckets, self.masters, dp_group, offloaded, self._opt_tensors, sharded,
                          dp_world_size)
        #: stage 3 with ``offload_param``: keeps parameter shards resident while they are updated
        #: (``hold(buckets, dirty=)`` / ``acquire`` / ``release`` / ``prefetch``); None otherwise
        self.residency: Any = None
        self.offload: OffloadTier | None = None
        #: ``device: nvme`` with a host-held optimizer: its states swapped between steps
        self.host_nvme: HostHeldNvmeStates | None = None
        if self.host_held and offload_cfg.device == "nvme":
            self.host_nvme = HostHeldNvmeStates(optimizer, offload_cfg, getattr(options, "aio", None),
                                                comm.get_rank(dp_group) if sharded else 0,
                                                [self.masters[i] for i in sorted(self.host_held)],
                                                sub_group_size=int(getattr(options, "sub_group_size", 1_000_000_000)),
                                                fast_paths=getattr(options, "fast_paths", None))
        if offloaded:
            rank = comm.get_rank(dp_group) if sharded else 0
            self.offload = OffloadTier(optimizer, offload_cfg, getattr(options, "aio", None), rank,
                                       [buckets[i] for i in sorted(offloaded)],
                                       [self.masters[i] for i in sorted(offloaded)],
                                       sub_group_size=int(getattr(options, "sub_group_size", 1_000_000_000)),
                                       fast_paths=getattr(options, "fast_paths", None))

    # ------------------------------------------------------------------------------------------
    def grad_norm_sq_local(self) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=self.masters[0].device if self.masters else "cpu")
        for b in self.buckets:
            total += torch.linalg.vector_norm(b.reduced_grad(), dtype=torch.float32).square()
        return total

    def _mixed_groups(self) -> bool:
        return any(getattr(b, "comm_group", self.dp_group) is not self.dp_group for b in self.buckets)

    def _grad_norm_sq_mixed(self) -> torch.Tensor:
        """The global squared norm when some buckets reduce over another group (MoE experts).

        Summed over the dp group, each element must count once: a sharded bucket's shards are
        disjoint across ranks (weight 1); an unsharded bucket is replicated over the ranks of its
        own reduction group (weight 1/size: dense buckets over dp, expert buckets over expert-dp).
        """
        total = torch.zeros((), dtype=torch.float32, device=self.masters[0].device if self.masters else "cpu")
        for b in self.buckets:
            sq = torch.linalg.vector_norm(b.reduced_grad(), dtype=torch.float32).square()
            total += sq if self.sharded else sq / getattr(b, "comm_size", self.dp_world_size)
        comm.all_reduce(total, group=self.dp_group)
        return total

    def shard_views(self) -> list[ShardView]:
        return [ShardView(b.layout, b.shard_start, b.shard_end, m, b.param_shard(), ts, self._split_of(b))
                for b, m, ts in zip(self.buckets, self.masters, self._opt_tensors)]

    def _split_of(self, b: FlatBucket) -> tuple[int, int] | None:
        if getattr(b, "comm_group", self.dp_group) is self.dp_group:
            return None
        return int(getattr(b, "comm_rank", 0)), int(getattr(b, "comm_size", 1))

    def step(self, loss_scale: float, max_norm: float, force_skip: bool = False,
             norm_sq_hook: Callable[[torch.Tensor], torch.Tensor] | None = None) -> StepResult:
        """Average, unscale, clip, update, and refresh the model's parameters.

        ``norm_sq_hook`` receives the data-parallel group's squared gradient norm (still summed
        over ranks and loss-scaled) and returns the global one: model-parallel engines (pipeline)
        use it to add the other stages' contributions. Returns the unscaled pre-clip global
        norm; on overflow nothing is updated.
        """
        if self._mixed_groups():
            norm_sq = self._grad_norm_sq_mixed()
        else:
            norm_sq = self.grad_norm_sq_local()
            if self.sharded:
                comm.all_reduce(norm_sq, group=self.dp_group)
        if norm_sq_hook is not None:
            norm_sq = norm_sq_hook(norm_sq)
        divisor = self.dp_world_size * loss_scale
        norm = math.sqrt(float(norm_sq)) / divisor if math.isfinite(float(norm_sq)) else float("inf")
        if not math.isfinite(norm) or force_skip:
            return StepResult(norm, True)
        factor = 1.0 / divisor
        if max_norm > 0:
            factor *= min(1.0, max_norm / (norm + 1e-6))
        on_device = [i for i in range(len(self.buckets)) if i not in self.offloaded]
        with self._resident([self.buckets[i] for i in on_device]):
            for i in on_device:
                b, master, tensors = self.buckets[i], self.masters[i], self._opt_tensors[i]
                grad = b.reduced_grad()
                if grad.dtype == master.dtype and grad.device == master.device:
                    if factor != 1.0:
                        grad.mul_(factor)
                    master_grad = grad
                else:
                    master_grad = grad.to(device=master.device, dtype=master.dtype).mul_(factor)
                if self.sharded:
                    master.grad = master_grad
                elif tensors[0] is b.params[0]:
                    pass  # stage 0 fp32: param.grad already views the (now scaled) buffer
                else:
                    for t, g in zip(tensors, b.param_views_of(master_grad)):
                        t.grad = g
            if on_device:
                self._host_held_step()
            if self.separate_master:  # the fp32 gradients were made for this step only
                for i in on_device:
                    for t in self._opt_tensors[i]:
                        t.grad = None
        self._publish_params(skip=self._offloaded_step(factor))
        return StepResult(norm, False)

    def _host_held_step(self) -> None:
        """The user's optimizer step; host-held states on NVMe are read before it and written back after
        (every rank agrees on an I/O failure before the next collective, so none waits for another)."""
        if self.host_nvme is None:
            self.optimizer.step()
            return
        if getattr(self.optimizer, "needs_whole_matrices", False):  # Muon: collectives inside its step
            error: BaseException | None = None
            try:
                self.host_nvme.read_in()
            except Exception as exc:  # noqa: BLE001 - re-raised by _agree, on every rank
                error = exc
            self._agree(error, "reading the host-held optimizer states from NVMe")
            try:
                self.optimizer.step()
            finally:
                try:
                    self.host_nvme.write_out(write_back=True)
                except Exception as exc:  # noqa: BLE001 - re-raised by _agree, on every rank
                    error = exc
            self._agree(error, "writing the host-held optimizer states to NVMe")
            return
        error = None
        try:  # element-wise: no collective inside, swap group by swap group
            self.host_nvme.step()
        except Exception as exc:  # noqa: BLE001 - re-raised by _agree, on every rank
            error = exc
        self._agree(error, "the host-held optimizer step with states on NVMe")

    def _offloaded_step(self, factor: float) -> set[int]:
        """Run the offloaded tier's update; all ranks agree whether it failed anywhere."""
        if self.offload is None:
            return set()
        error: BaseException | None = None
        published: set[int] = set()
        try:
            published = self.offload.step(factor, self.residency)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the agreement
            error = exc
        self._agree(error, "the offloaded optimizer step")
        return published

    def _agree(self, error: BaseException | None, what: str) -> None:
        """Raise ``error`` here, or a RuntimeError when another data-parallel rank failed ``what``."""
        if self.sharded and self.dp_world_size > 1:
            failed = torch.zeros(self.dp_world_size, dtype=torch.float32)
            if error is not None:
                failed[comm.get_rank(self.dp_group)] = 1.0
            comm.all_reduce(failed, group=self.dp_group)
            ranks = [r for r, f in enumerate(failed.tolist()) if f]
            if ranks and error is None:
                raise RuntimeError(f"{what} failed on data-parallel rank(s) {ranks} (see their error); this "
                                   "rank stops too so that no rank waits for it")
        if error is not None:
            raise error

    def _resident(self, buckets: list[Any]) -> ContextManager[None]:
        """Parameter shards of ``buckets`` in memory, and marked written, for the block."""
        if self.residency is None or not buckets:
            return nullcontext()
        return self.residency.hold(buckets, dirty=True)

    def resident_for_checkpoint(self, write_back: bool) -> ContextManager[None]:
        """Make every optimizer state visible in ``optimizer.state`` for a checkpoint save
        (``write_back=False``) or load (``write_back=True``: keep what the load put there)."""
        stack = ExitStack()
        if self.offload is not None:
            stack.enter_context(self.offload.resident_state(write_back))
        if self.host_nvme is not None:
            stack.enter_context(self.host_nvme.resident(write_back))
        return stack

    @property
    def checkpoint_needs_copy(self) -> bool:
        """A save must copy the masters: swapped to NVMe, they are freed again after the save's block."""
        return self.offload is not None and self.offload.swap_master

    def offload_memory_bytes(self) -> dict[str, int]:
        out = self.offload.memory_bytes() if self.offload is not None else {}
        if self.host_nvme is not None:
            for k, v in self.host_nvme.memory_bytes().items():
                out[k] = out.get(k, 0) + v
        return out

    def close(self) -> None:
        """Release offload resources (NVMe swap files); the optimizer cannot step afterwards."""
        if self.offload is not None:
            self.offload.close()
        if self.host_nvme is not None:
            self.host_nvme.close()

    def _publish_params(self, skip: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        """Refresh the 16-bit shards from the masters (except buckets in ``skip``: ids of those the
        offload tier already refreshed) and, when sharded, all-gather every bucket."""
        works = []
        for b, master in zip(self.buckets, self.masters):
            shard = b.param_shard()
            if id(b) not in skip and not same_memory(master, shard):
                shard.copy_(master)
            if self.sharded:
                works.append(comm.all_gather(b.param_buffer, shard, group=getattr(b, "comm_group", self.dp_group),
                                             async_op=True))
        for w in works:
            w.wait()

    # -- accounting ------------------------------------------------------------------------------
    def optimizer_state_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for state in self.optimizer.state.values():
            for v in state.values():
                if torch.is_tensor(v) and v.numel() > 1 and v.data_ptr() not in seen:
                    seen.add(v.data_ptr())
                    total += v.numel() * v.element_size()
        return total

    def master_bytes(self) -> int:
        # a master swapped to NVMe keeps its shape with its storage freed: count what is resident
        return sum(m.untyped_storage().nbytes() for b, m in zip(self.buckets, self.masters)
                   if not same_memory(m, b.param_shard()))
