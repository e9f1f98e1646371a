"""One ZeRO-3 bucket: a flat run of parameters sharded over the data-parallel group.

A :class:`Stage3Bucket` is the only code that changes what a parameter's ``.data`` is. Between
uses a parameter's ``.data`` is an empty 1-D tensor (``shape == (0,)``, as in DeepSpeed), so an
accidental use outside a gather fails loudly on the shape instead of reading stale memory, and
``module.to(dtype)`` on a partitioned model is harmless. While gathered, ``.data`` is a view of
the bucket's flat full buffer.

Memory model (the FSDP one): the full buffer is a single tensor whose *storage* is resized to 0
bytes on release and back to full size on gather. Autograd may have saved views of a weight in
forward (``F.linear`` saves ``weight.t()``); those views share this storage, so releasing really
frees the memory, and re-gathering into the same storage before the module's backward makes them
valid again. Nothing ever reads the storage while it is 0 bytes because ``param.data`` is swapped
to the empty placeholder first.

Invariants: ``shard`` holds elements ``[shard_start, shard_end)`` of the bucket's flat layout
(:class:`~zerospeed.zero.layout.BucketLayout`, padded to a multiple of N, padding zero) in the
model dtype and is the authoritative copy of the parameters; ``grad_shard`` (trainable buckets)
is this rank's reduced gradient range, summed over ranks and micro-batches, in the model dtype;
``master`` is the fp32 master shard when it is a separate tensor (mixed precision), else None.

Parameter offload (``offload_param``): when ``swapper`` is set (a
:class:`~zerospeed.zero.stage3.param_offload.ParamSwapper`), ``shard`` may be swapped out (its
storage resized to 0 bytes, the values on NVMe or in host memory) whenever the swapper has no user
for it. The bucket makes it resident for exactly as long as it reads or writes it: from
``start_gather`` / ``refresh_in_place`` until the all-gather was waited for (``finish_gather``), and
around ``write_back_shard`` (which marks it dirty). Everyone else who touches ``shard`` (the
optimizer step, checkpoints) holds it through the swapper.

The bucket holds its parameters weakly (the process-wide registry maps a live parameter to its
bucket), so a model that is dropped frees its shards. Lifecycle counters (``fwd_refs``,
``bwd_active``...) are plain fields owned by :class:`~zerospeed.zero.stage3.hooks.Stage3Runtime`
and :class:`~zerospeed.zero.init.GatheredParameters`; the bucket only says whether anyone uses it.
"""

from __future__ import annotations

import enum
import weakref
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from zerospeed import comm
from zerospeed.zero import zeropp
from zerospeed.zero.layout import BucketLayout


class BucketState(enum.Enum):
    RELEASED = "released"  # only the shard exists
    INFLIGHT = "inflight"  # all-gather started, not waited for
    GATHERED = "gathered"  # full buffer valid, parameters point into it


class Stage3Bucket:
    def __init__(self, layout: BucketLayout, params: Sequence[nn.Parameter], values: Sequence[torch.Tensor],
                 dtype: torch.dtype, device: torch.device, group: dist.ProcessGroup | None, rank: int, name: str,
                 persistent: bool = False, trainable: bool = False) -> None:
        if len(params) != len(layout.slots) or len(values) != len(layout.slots):
            raise ValueError(f"bucket {name!r}: {len(layout.slots)} slots, {len(params)} parameters, "
                             f"{len(values)} values")
        self.layout = layout
        self.name = name
        self.dtype = dtype
        self.device = device
        self.group = group
        self.persistent = persistent
        self.trainable = trainable
        self._param_refs = [weakref.ref(p) for p in params]
        self.grad_slots = tuple(i for i, p in enumerate(params) if p.requires_grad)
        self.shard_start, self.shard_end = layout.shard_range(rank)
        self.shard = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
        with torch.no_grad():
            for piece in layout.pieces(rank):
                src = values[self._slot_pos(piece.slot)].reshape(-1).narrow(0, piece.param_start, piece.numel)
                self.shard.narrow(0, piece.shard_start, piece.numel).copy_(src)
        self.grad_shard = torch.zeros_like(self.shard) if trainable else None  # see accumulate_grads_in
        self.master: torch.Tensor | None = None
        #: when the fp32 master is swapped to NVMe (``master`` is None then): called with the bucket
        #: after ``write_back_shard`` changed the shard, to overwrite the master where it lives
        self.master_sink: Any = None

        self._full = torch.empty(layout.padded_numel, dtype=dtype, device=device)
        self._full_nbytes = self._full.untyped_storage().nbytes()
        # views are made while the storage is allocated; they stay valid across resizes
        self._views = [self._full.narrow(0, s.offset, s.numel).view(s.shape) for s in layout.slots]
        self._full.untyped_storage().resize_(0)
        self._placeholder = torch.empty(0, dtype=dtype, device=device)
        self.state = BucketState.RELEASED
        self.work: Any = None
        # lifecycle, owned by the runtime / GatheredParameters
        self.fwd_refs = 0
        self.pins = 0
        self.bwd_active = False
        self.bwd_calls = 0
        self.prefetched = False
        self.owner: Any = None  # the gatherer that accounts for this bucket's gathers
        self.swapper: Any = None  # ParamSwapper under offload_param, set by the strategy
        self._swap_use = False  # the in-flight all-gather holds the shard resident
        with torch.no_grad():
            for p in params:
                p.data = self._placeholder

    def accumulate_grads_in(self, dtype: torch.dtype) -> None:
        """Sum this rank's reduced gradients over micro-batches in ``dtype`` (``data_types.grad_accum_dtype``, e.g.
        fp32 beside bf16 parameters, as DeepSpeed's ZeRO-3 does); before any gradient arrived."""
        if self.grad_shard is not None and self.grad_shard.dtype != dtype:
            self.grad_shard = torch.zeros(self.grad_shard.shape, dtype=dtype, device=self.grad_shard.device)

    def _slot_pos(self, slot: Any) -> int:
        return self.layout.slots.index(slot)

    # -- parameters -------------------------------------------------------------------------------
    @property
    def params(self) -> list[nn.Parameter]:
        out = []
        for ref in self._param_refs:
            p = ref()
            if p is None:
                raise RuntimeError(f"ZeRO-3 bucket {self.name!r}: a parameter was garbage-collected while its "
                                   "bucket is still in use")
            out.append(p)
        return out

    def live_params(self) -> list[tuple[int, nn.Parameter]]:
        """(slot position, parameter) for the parameters that still exist."""
        return [(i, p) for i, ref in enumerate(self._param_refs) if (p := ref()) is not None]

    @property
    def index(self) -> int:
        return self.layout.index

    @property
    def num_grad_params(self) -> int:
        return len(self.grad_slots)

    @property
    def padded_numel(self) -> int:
        return self.layout.padded_numel

    @property
    def full_bytes(self) -> int:
        return self._full_nbytes

    def in_use(self) -> bool:
        return bool(self.fwd_refs or self.pins or self.bwd_active or self.bwd_calls)

    # -- the gather / release cycle ---------------------------------------------------------------
    #: ZeRO++ qwZ: gather as block-wise int8 (set by the strategy from zero_quantized_weights)
    quantized_gather = False

    #: ZeRO++ hpZ: the group of zero_hpz_partition_size consecutive dp ranks holding a secondary partition (the
    #: whole bucket split among them, 1/size each, kept from the last primary gather); set by the strategy
    hpz_group: Any = None
    _secondary: torch.Tensor | None = None
    _secondary_key: Any = None

    def _shard_key(self) -> tuple[int, int, int]:
        """Changes whenever the shard is replaced or written in place (torch's version counter): the secondary
        partition is then stale."""
        return (id(self.shard), self.shard.data_ptr(), self.shard._version)

    def _start_all_gather(self) -> Any:
        if self.hpz_group is not None and self._secondary is not None and self._secondary_key == self._shard_key():
            return comm.all_gather(self._full, self._secondary, group=self.hpz_group, async_op=True)
        if self.quantized_gather:
            work = zeropp.all_gather_quantized(self._full, self.shard, self.group)
        else:
            work = comm.all_gather(self._full, self.shard, group=self.group, async_op=True)
        if self.hpz_group is None:
            return work
        return zeropp.KeepSecondary(work, self, self._shard_key())

    def drop_secondary(self) -> None:
        """The strategy's call when the shards changed or a new forward begins (hpZ)."""
        self._secondary = self._secondary_key = None

    def keep_secondary(self, key: Any) -> None:
        """After a primary gather: keep this rank's 1/size of the full buffer as its secondary partition."""
        size, j = dist.get_world_size(self.hpz_group), dist.get_rank(self.hpz_group)
        part = self._full.numel() // size
        self._secondary = self._full.narrow(0, j * part, part).clone()
        self._secondary_key = key

    def start_gather(self) -> Any:
        """Allocate the full buffer and start the all-gather of every rank's shard into it."""
        if self.state is not BucketState.RELEASED:
            raise RuntimeError(f"ZeRO-3 bucket {self.name!r}: gather started while {self.state.value}")
        self._acquire_shard()
        self._full.untyped_storage().resize_(self._full_nbytes)
        self.work = self._start_all_gather()
        self.state = BucketState.INFLIGHT
        return self.work

    def _acquire_shard(self) -> None:
        """Offload: keep ``shard`` resident until the all-gather reading it was waited for."""
        if self.swapper is not None and not self._swap_use:
            self.swapper.acquire(self)
            self._swap_use = True

    def _release_shard(self) -> None:
        if self._swap_use:
            self._swap_use = False
            self.swapper.release(self)

    def finish_gather(self, attach: bool = True) -> None:
        """After the all-gather was waited for: point the parameters at the full buffer."""
        if self.state is not BucketState.INFLIGHT:
            raise RuntimeError(f"ZeRO-3 bucket {self.name!r}: finish_gather while {self.state.value}")
        self.work = None
        self.state = BucketState.GATHERED
        self._release_shard()
        if attach:
            self.attach()

    def attach(self) -> None:
        with torch.no_grad():
            for i, p in self.live_params():
                p.data = self._views[i]

    def can_coalesce_gather(self) -> bool:
        """Its all-gather is the plain one (no hpZ secondary, no quantization, shard never swapped out), so it
        may share one collective with other buckets of its group and dtype (:meth:`fill_full`)."""
        return self.hpz_group is None and not self.quantized_gather and self.swapper is None

    def gather_into(self, out: torch.Tensor, async_op: bool = False) -> Any:
        """All-gather every rank's shard into ``out`` (flat, ``padded_numel`` elements of the bucket's dtype,
        not this bucket's own buffer), leaving the bucket's state and parameters as they are: a reader's private
        full copy in the bucket's flat layout (slot ``s`` at ``out[s.offset:s.offset + s.numel]``; the rollout
        copy of :mod:`zerospeed.rl`). The plain all-gather only (:meth:`can_coalesce_gather`); a collective of
        the bucket's group."""
        if not self.can_coalesce_gather():
            raise RuntimeError(f"ZeRO-3 bucket {self.name!r}: gather_into needs the plain all-gather (no hpZ, "
                               "quantized or offloaded shard)")
        if out.dim() != 1 or out.numel() != self.layout.padded_numel or out.dtype != self.dtype:
            raise ValueError(f"ZeRO-3 bucket {self.name!r}: gather_into needs a flat {self.dtype} tensor of "
                             f"{self.layout.padded_numel} elements, got {tuple(out.shape)} {out.dtype}")
        return comm.all_gather(out, self.shard, group=self.group, async_op=async_op)

    def fill_full(self, rows: torch.Tensor) -> None:
        """Make the bucket GATHERED from ``rows``, a ``[group size, shard_numel]`` view of every rank's shard in
        rank order (a coalesced all-gather's slice for this bucket), and point the parameters at it."""
        if self.state is BucketState.INFLIGHT:
            raise RuntimeError(f"ZeRO-3 bucket {self.name!r}: fill while its all-gather is in flight")
        if self.state is BucketState.RELEASED:
            self._full.untyped_storage().resize_(self._full_nbytes)
        with torch.no_grad():
            self._full.view(rows.shape).copy_(rows)
        self.state = BucketState.GATHERED
        self.attach()

    def refresh_in_place(self) -> Any:
        """Start re-gathering a GATHERED bucket into its live buffer (persistent buckets after a step)."""
        if self.state is not BucketState.GATHERED:
            raise RuntimeError(f"ZeRO-3 bucket {self.name!r}: refresh while {self.state.value}")
        self._acquire_shard()
        self.work = self._start_all_gather()
        self.state = BucketState.INFLIGHT
        return self.work

    def release(self) -> None:
        """Point the parameters back at the empty placeholder and free the full buffer."""
        if self.state is BucketState.INFLIGHT:
            raise RuntimeError(f"ZeRO-3 bucket {self.name!r}: release while its all-gather is in flight")
        if self.state is BucketState.RELEASED:
            return
        with torch.no_grad():
            for _, p in self.live_params():
                p.data = self._placeholder
        self._full.untyped_storage().resize_(0)
        self.state = BucketState.RELEASED
        self.prefetched = False

    def discard(self) -> None:
        """Free everything and forget the parameters without touching them (they were re-bucketed)."""
        if self.swapper is not None:
            self.swapper.forget(self)
            self.swapper = None
            self._swap_use = False
        self._full.untyped_storage().resize_(0)
        self.shard = self._placeholder
        self.grad_shard = None
        self.master = None
        self._param_refs = []
        self.state = BucketState.RELEASED
        self.work = None

    # -- access to the gathered values ------------------------------------------------------------
    def full_buffer(self) -> torch.Tensor:
        if self.state is not BucketState.GATHERED:
            raise RuntimeError(f"ZeRO-3 bucket {self.name!r} is not gathered ({self.state.value})")
        return self._full

    def slot_view(self, i: int) -> torch.Tensor:
        self.full_buffer()
        return self._views[i]

    def adopt_user_writes(self) -> None:
        """Copy into the full buffer any parameter whose ``.data`` user code replaced while gathered."""
        with torch.no_grad():
            for i, p in self.live_params():
                view = self._views[i]
                if p.data.data_ptr() != view.data_ptr() or p.data.shape != view.shape:
                    if p.data.numel() != view.numel():
                        raise ValueError(f"parameter {self.layout.slots[i].name!r} was replaced by a tensor of "
                                         f"shape {tuple(p.data.shape)}; ZeRO-3 needs {tuple(view.shape)}")
                    view.copy_(p.data.reshape(view.shape))
                    p.data = view

    def write_back_shard(self) -> None:
        """Make the shard (and the fp32 master) this rank's range of the gathered full buffer."""
        full = self.full_buffer()
        if self.swapper is not None:
            self.swapper.acquire(self, overwrite=True)  # the whole shard is overwritten: nothing to read
        try:
            with torch.no_grad():
                self.shard.copy_(full.narrow(0, self.shard_start, self.shard_end - self.shard_start))
                if self.master is not None:
                    self.master.copy_(self.shard)
                elif self.master_sink is not None:
                    self.master_sink(self)
        finally:
            if self.swapper is not None:
                self.swapper.release(self, dirty=True)

    # -- the interface ShardedOptimizerState reads ------------------------------------------------
    def param_shard(self) -> torch.Tensor:
        return self.shard

    def reduced_grad(self) -> torch.Tensor:
        if self.grad_shard is None:
            raise RuntimeError(f"ZeRO-3 bucket {self.name!r} holds no trainable parameters")
        return self.grad_shard

    # -- accounting -------------------------------------------------------------------------------
    def shard_bytes(self) -> int:
        """Bytes of the shard in memory now (0 while swapped out by parameter offload)."""
        if self.shard.untyped_storage().nbytes() == 0:
            return 0
        return self.shard.numel() * self.shard.element_size()

    def grad_bytes(self) -> int:
        return 0 if self.grad_shard is None else self.grad_shard.numel() * self.grad_shard.element_size()

    def __repr__(self) -> str:
        return (f"Stage3Bucket({self.name!r}, {len(self.layout.slots)} params, {self.layout.padded_numel} elements, "
                f"{self.state.value}{', persistent' if self.persistent else ''})")


def gather_together(batch: list[Stage3Bucket]) -> None:
    """One all-gather of several buckets' shards (same group and dtype), each bucket filled from its slice."""
    group = batch[0].group
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    total = sum(b.shard.numel() for b in batch)
    send = torch.cat([b.shard.reshape(-1) for b in batch])
    received = torch.empty(world * total, dtype=send.dtype, device=send.device)
    comm.all_gather(received, send, group=group)
    rows = received.view(world, total)
    offset = 0
    for b in batch:
        n = b.shard.numel()
        b.fill_full(rows[:, offset:offset + n])
        offset += n

