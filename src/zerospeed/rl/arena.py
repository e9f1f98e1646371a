"""The rollout copy's weights as views of one gathered arena (issue #32): no per-call copy where layouts agree.

A ZeRO-3 rollout call used to all-gather each bucket into the bucket's own buffer (allocated for the call, so its
pages were faulted in again every call), copy every weight from there into the inference model's parameters, and
release the buffer. For a short call (the bench's 16 x 64-token greedy batch, 0.17 s) that fixed cost was ~17%.

:class:`GatherArena` instead keeps one flat tensor, the buckets the copy reads laid end to end in bucket order
(each in its flat layout, :meth:`Stage3Bucket.gather_into`), and gathers each bucket straight into its range. Every
inference parameter whose value *is* a contiguous range of the arena (an embedding, a linear weight, and a fused
QKV / gate-up weight when its pieces sit next to each other in the same dtype) becomes a view of that range
(:func:`plan_aliases`), so a call only re-gathers: no copy, no allocation, the parameters' storage stays put
(the KV cache and the engine object are kept across calls already). Every other parameter (a transposed GPT-2
Conv1D weight, LoRA-applied weights, weights in persistent or offloaded buckets, pieces that are not adjacent)
is still filled by its copy job, reading arena-held tensors from the arena (:attr:`WeightSource.values`) and the
rest through the usual pinned pass.

Which parameters alias is decided once, structurally: each copy job is run on probe values (float64, each
element of an arena bucket holding its arena position, NaN elsewhere) and aliases only when it produces exactly
``arena[start:start + numel]`` in order; its HF names must all be plain (not LoRA) parameters of arena buckets.
A fused QKV whose q / k / v buckets are not adjacent, or a job that permutes or transposes, fails the probe and
keeps its copy.

Under tensor parallelism each TP rank's arena holds its own training pieces (the rollout reads them as they are);
a weight assembled over the TP group (AutoTP's vocabulary-split LM head) is never probed nor aliased: it is copied.

Invariants: the arena holds non-persistent buckets with the plain all-gather (no hpZ, qwZ or parameter offload),
of the rollout dtype and device; it is the rollout copy's storage for the aliased parameters (counted once in the
memory stats: its bytes beyond what the aliased parameters use are the buckets' padding and any parameters no
alias reads, ``extra_bytes``). After each fill the aliased parameters' version counters are bumped, so values the
inference engine derives from a weight (packed GEMM layouts, the bf16 / int8 LM heads) are rebuilt for the new
weights. With ``pin_parameters: false`` its storage is freed after the call like the rest of the copy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerospeed.rl.weights import Job, PlanReader, WeightSource
from zerospeed.zero.stage3 import registry
from zerospeed.zero.stage3.bucket import BucketState


class GatherArena:
    """One flat tensor holding ``buckets`` (bucket order) in their flat layouts; see the module docstring."""

    def __init__(self, buckets: list[Any], dtype: torch.dtype, device: torch.device) -> None:
        self.buckets = sorted({id(b): b for b in buckets}.values(), key=lambda b: b.index)
        self.offsets: dict[int, int] = {}
        total = 0
        for b in self.buckets:
            self.offsets[id(b)] = total
            total += b.padded_numel
        self.flat = torch.empty(total, dtype=dtype, device=device)
        self.nbytes = self.flat.untyped_storage().nbytes()
        self.ids = set(self.offsets)
        self.aliased: list[nn.Parameter] = []
        self.aliased_numel = 0

    @property
    def resident(self) -> bool:
        return self.flat.untyped_storage().nbytes() == self.nbytes

    def alloc(self) -> None:
        if not self.resident:
            self.flat.untyped_storage().resize_(self.nbytes)

    def free(self) -> None:
        self.flat.untyped_storage().resize_(0)

    @property
    def extra_bytes(self) -> int:
        """Arena bytes no aliased parameter uses (bucket padding, parameters read by copy jobs or by no job)."""
        return self.nbytes - self.aliased_numel * self.flat.element_size()

    def position(self, p: nn.Parameter) -> tuple[int, int, tuple[int, ...]] | None:
        """(first arena element, numel, shape) of a training parameter held here, else None."""
        found = registry.lookup(p)
        if found is None or id(found[0]) not in self.ids:
            return None
        b, pos = found
        slot = b.layout.slots[pos]
        return self.offsets[id(b)] + slot.offset, slot.numel, slot.shape

    def value(self, p: nn.Parameter) -> torch.Tensor:
        """The current value of ``p`` (after :meth:`fill`): an arena view for arena parameters, else ``p``."""
        at = self.position(p)
        if at is None:
            return p.detach()
        start, numel, shape = at
        return self.flat.narrow(0, start, numel).view(shape)

    def fill(self) -> int:
        """Gather every arena bucket into its range (all started, then waited for); returns the all-gathers
        started. A bucket someone holds gathered (a user's GatheredParameters, an in-flight prefetch) is copied
        from its full buffer instead, which is then authoritative. A collective of the data-parallel group."""
        works, gathers = [], 0
        for b in self.buckets:
            out = self.flat.narrow(0, self.offsets[id(b)], b.padded_numel)
            if b.state is BucketState.RELEASED:
                works.append(b.gather_into(out, async_op=True))
                gathers += 1
            else:
                b.owner.pin([b], "hybrid_engine rollout")
                try:
                    with torch.no_grad():
                        out.copy_(b.full_buffer())
                finally:
                    b.owner.unpin([b])
        for w in works:
            if w is not None:
                w.wait()
        for p in self.aliased:  # derived layouts of these weights (packed, bf16/int8 heads) are stale now
            torch.autograd.graph.increment_version(p)
        return gathers


def arena_buckets(jobs: list[Job], source: WeightSource, dtype: torch.dtype, device: torch.device) -> list[Any]:
    """The buckets an arena may hold: read by some job, non-persistent, plain all-gather, dtype and device."""
    out: dict[int, Any] = {}
    for j in jobs:
        for n in j.names:
            for p in source.params_of(n):
                found = registry.lookup(p)
                if found is None:
                    continue
                b = found[0]
                if (not b.persistent and b.can_coalesce_gather() and b.dtype == dtype
                        and torch.device(b.device) == torch.device(device)):
                    out[id(b)] = b
    return list(out.values())


def plan_aliases(jobs: list[Job], reader: PlanReader, source: WeightSource, arena: GatherArena) -> list[Job]:
    """Point every job's target that is exactly a contiguous arena range at that range (module docstring); returns
    the jobs that still copy."""
    lora = set(source._lora)
    probes: dict[int, torch.Tensor] = {}

    def probe(p: nn.Parameter) -> torch.Tensor:
        at = arena.position(p)
        if at is None:
            found = registry.lookup(p)
            shape = found[0].layout.slots[found[1]].shape if found is not None else tuple(p.shape)
            return torch.full(shape, float("nan"), dtype=torch.float64)
        start, numel, shape = at
        t = probes.get(start)
        if t is None:
            t = probes[start] = torch.arange(start, start + numel, dtype=torch.float64).view(shape)
        return t

    copies = []
    dtype, device = reader.dtype, reader.device
    source.values, reader.dtype, reader.device = probe, torch.float64, torch.device("cpu")
    try:
        for job in jobs:
            start = _aliasable(job, source, arena, lora, reader.whole)
            probes.clear()  # probe values of one job at a time (float64: twice the fp32 weights otherwise)
            if start is None:
                copies.append(job)
                continue
            with torch.no_grad():
                job.target.data = arena.flat.narrow(0, start, job.target.numel()).view(job.target.shape)
            arena.aliased.append(job.target)
            arena.aliased_numel += job.target.numel()
    finally:
        source.values, reader.dtype, reader.device = None, dtype, device
    return copies


def _aliasable(job: Job, source: WeightSource, arena: GatherArena, lora: set[str], whole: Any) -> int | None:
    """The arena element where ``job.target``'s value starts, when the value is exactly that contiguous range.
    ``whole``: the names assembled over tensor-parallel ranks (never aliased, and never probed: a collective)."""
    t = job.target
    if t is None or not job.names or t.dtype != arena.flat.dtype or t.device != arena.flat.device:
        return None
    for n in job.names:
        ps = source.params_of(n)
        if n in lora or n in whole or not ps or any(arena.position(p) is None for p in ps):
            return None
    value = job.thunk()
    if tuple(value.shape) != tuple(t.shape) or value.numel() == 0:
        return None
    flat = value.reshape(-1)
    start = flat[0].item()
    if start != start or start < 0:  # NaN: a value from outside the arena
        return None
    start = int(start)
    if start + flat.numel() > arena.flat.numel():
        return None
    expect = torch.arange(start, start + flat.numel(), dtype=torch.float64)
    return start if torch.equal(flat, expect) else None


def build_arena(jobs: list[Job], reader: PlanReader, source: WeightSource, dtype: torch.dtype,
                device: torch.device) -> tuple[GatherArena | None, list[Job]]:
    """The arena for ``jobs`` (None when no parameter can alias) and the jobs that still copy. Planned on every
    candidate bucket first, then again on the buckets some alias reads (a bucket only copy jobs read is not kept
    beside its copies)."""
    candidates = arena_buckets(jobs, source, dtype, device)
    if not candidates:
        return None, jobs
    originals = {id(j.target): j.target.data for j in jobs if j.target is not None}
    first = GatherArena(candidates, dtype, device)
    plan_aliases(jobs, reader, source, first)
    aliased = {id(t) for t in first.aliased}
    used = {id(registry.lookup(p)[0]) for j in jobs if id(j.target) in aliased
            for n in j.names for p in source.params_of(n)}
    with torch.no_grad():
        for j in jobs:
            if j.target is not None:
                j.target.data = originals[id(j.target)]
    del first
    if not used:
        return None, jobs
    arena = GatherArena([b for b in candidates if id(b) in used], dtype, device)
    return arena, plan_aliases(jobs, reader, source, arena)
