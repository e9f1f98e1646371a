"""Muon on flat ZeRO shards (stages 1, 2, 3): each matrix is orthogonalised once, by its owner rank.

At ZeRO-0 on several ranks each matrix likewise has one owner, and one all-reduce per bucket shares
the results (every rank already holds every update there).

Newton-Schulz needs a whole matrix while a ZeRO bucket's shard holds ``[r*L/N, (r+1)*L/N)`` of a flat
layout, so a matrix can straddle ranks. The element-wise parts of Muon (momentum, nesterov blend,
decay, the step) run on the shard as for any optimizer; for the orthogonalisation
(:class:`zerospeed.ops.muon.Muon` calls the orthogonaliser bound here for each Muon shard):

1. the bucket's momentum-updated gradient U is all-gathered (one collective per bucket, coalesced like
   the parameter all-gather), so the owner of each matrix holds it whole;
2. each rank orthogonalises only the matrices it owns, writing ``NS(U_i) * scale_i`` into a zeroed
   bucket-sized buffer;
3. one reduce-scatter of that buffer (a sum in which each element has exactly one non-zero term, so it
   is exact) hands every rank its shard of the result.

Owners: every Muon matrix of every bucket (in bucket order, the same on all ranks) is given to the
least-loaded rank of its bucket's group, largest Newton-Schulz cost first (LPT, ties to the lower
rank), so each rank does about 1/N of the FLOPs. :class:`MuonShardPlan` counts the FLOPs each rank ran
(``ns_flops_done``), which is what the tests check.

Offload (``offload_optimizer.device: cpu``): the offload tier's step is Adam's, so for a Muon optimizer the
chosen buckets are *host-held* instead (``ShardedOptimizerState.host_held``): their fp32 master and
momentum / Adam states live in host memory and this optimizer steps them there, so the Newton-Schulz
iteration of an offloaded bucket runs on the host, where its states live. The bucket's collectives run on
the device its parameters use (NCCL cannot move host tensors): the update is copied there for the
all-gather and back for the iteration. NVMe is refused (one line).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from zerospeed import comm
from zerospeed.ops.muon import muon_scale, newton_schulz, ns_flops


@dataclass
class _BucketMatrices:
    layout: Any  # BucketLayout
    group: Any  # process group its collectives run on
    rank: int
    world_size: int
    owners: list[int]  # per slot
    device: torch.device  # where the bucket's collectives run (its parameters' device)


@dataclass
class MuonShardPlan:
    """Owner rank of every Muon matrix, and the Newton-Schulz FLOPs this rank ran."""

    buckets: dict[int, _BucketMatrices] = field(default_factory=dict)  # id(master) -> bucket
    ns_flops_done: int = 0
    ns_flops_total: int = 0  # of one step, over all ranks (for the 1/N check)

    def owned(self) -> list[str]:
        """Names of the matrices this rank orthogonalises (owners are ranks of each bucket's own group)."""
        return [s.name for bm in self.buckets.values() for s, o in zip(bm.layout.slots, bm.owners) if o == bm.rank]


def _assign_owners(entries: list[tuple[int, int, int]], world_size: int) -> dict[tuple[int, int], int]:
    """``(bucket, slot, cost)`` -> owner, largest cost first to the least-loaded rank."""
    load = [0] * world_size
    owner: dict[tuple[int, int], int] = {}
    for bi, si, cost in sorted(entries, key=lambda e: (-e[2], e[0], e[1])):
        r = min(range(world_size), key=lambda k: (load[k], k))
        owner[(bi, si)] = r
        load[r] += cost
    return owner


def bind_sharded_muon(optimizer: torch.optim.Optimizer, buckets: list[Any], masters: list[torch.Tensor],
                      dp_group: Any, offloaded: set[int], opt_tensors: list[list[torch.Tensor]] | None = None,
                      sharded: bool = True, dp_world_size: int = 1) -> MuonShardPlan | None:
    """Bind an orthogonaliser to each Muon bucket of ``optimizer`` (a no-op for other optimizers).

    Sharded (stages 1-3): the unit is the bucket's flat master shard. Replicated (stage 0, ``opt_tensors``
    are the bucket's parameter-shaped tensors): every rank holds every update already, so owners
    orthogonalise their matrices and one all-reduce per bucket shares the results; a single rank binds
    nothing (the whole-matrix path is the same computation).
    """
    if not getattr(optimizer, "needs_whole_matrices", False):
        return None
    groups = optimizer.param_groups
    muon_buckets = [i for i, b in enumerate(buckets) if groups[b.layout.group_index].get("use_muon")]
    if any(i in offloaded for i in muon_buckets):  # ShardedOptimizerState keeps Muon's buckets host-held
        raise AssertionError("Muon buckets must not be given to the Adam offload tier")
    info = {}
    for i in muon_buckets:
        b = buckets[i]
        group = getattr(b, "comm_group", dp_group)
        world = b.layout.world_size if sharded else int(getattr(b, "comm_size", dp_world_size))
        info[i] = (group, comm.get_rank(group) if world > 1 else 0, world)
    if not sharded and all(world == 1 for _, _, world in info.values()):
        return None
    plan = MuonShardPlan()
    entries = []
    for i in muon_buckets:
        method = groups[buckets[i].layout.group_index]["ns_method"]
        for si, slot in enumerate(buckets[i].layout.slots):
            cost = ns_flops(slot.shape, method) if len(slot.shape) >= 2 else slot.numel
            entries.append((i, si, cost))
            plan.ns_flops_total += cost if len(slot.shape) >= 2 else 0
    # owners are balanced within each world size (buckets of one group share it)
    by_world: dict[int, list[tuple[int, int, int]]] = {}
    for e in entries:
        by_world.setdefault(info[e[0]][2], []).append(e)
    owner: dict[tuple[int, int], int] = {}
    for world, es in by_world.items():
        owner.update(_assign_owners(es, world))
    variant = getattr(optimizer, "variant", "deepspeed")
    for i in muon_buckets:
        b = buckets[i]
        group, rank, world = info[i]
        bm = _BucketMatrices(b.layout, group, rank, world,
                             [owner[(i, si)] for si in range(len(b.layout.slots))], b.param_shard().device)
        plan.buckets[id(masters[i])] = bm
        if sharded:
            optimizer.bind_orthogonalizer([masters[i]], _sharded(bm, plan, variant))
        else:
            assert opt_tensors is not None
            optimizer.bind_orthogonalizer(opt_tensors[i], _replicated(bm, plan, variant))
    optimizer.shard_plan = plan
    return plan


def _ns(piece: torch.Tensor, shape: tuple[int, ...], method: str, variant: str, plan: MuonShardPlan) -> torch.Tensor:
    """``NS(U) * scale`` of one matrix, flat (a vector the user forced onto Muon passes through)."""
    if len(shape) < 2:
        return piece.reshape(-1)
    plan.ns_flops_done += ns_flops(shape, method)
    return (newton_schulz(piece.reshape(shape[0], -1), method, variant=variant) * muon_scale(shape)).reshape(-1)


def _sharded(bm: _BucketMatrices, plan: MuonShardPlan, variant: str) -> Any:
    layout = bm.layout

    def run(updates: list[torch.Tensor], group_settings: Mapping[str, Any]) -> list[torch.Tensor]:
        (update,) = updates
        method = group_settings["ns_method"]
        home = update.device  # where the states live (host memory when offloaded)
        full = torch.empty(layout.padded_numel, dtype=update.dtype, device=bm.device)
        comm.all_gather(full, update.reshape(-1).to(bm.device), group=bm.group)
        full = full.to(home)
        out = torch.zeros_like(full)
        for slot, owner in zip(layout.slots, bm.owners):
            if owner == bm.rank:
                piece = full.narrow(0, slot.offset, slot.numel)
                out.narrow(0, slot.offset, slot.numel).copy_(_ns(piece, slot.shape, method, variant, plan))
        mine = torch.empty(update.numel(), dtype=update.dtype, device=bm.device)
        comm.reduce_scatter(mine, out.to(bm.device), group=bm.group)
        return [mine.to(home).view_as(update)]

    return run


def _replicated(bm: _BucketMatrices, plan: MuonShardPlan, variant: str) -> Any:
    layout = bm.layout

    def run(updates: list[torch.Tensor], group_settings: Mapping[str, Any]) -> list[torch.Tensor]:
        method = group_settings["ns_method"]
        home = updates[0].device
        out = torch.zeros(layout.numel, dtype=updates[0].dtype, device=home)
        for slot, owner, u in zip(layout.slots, bm.owners, updates):
            if owner == bm.rank:
                out.narrow(0, slot.offset, slot.numel).copy_(_ns(u, slot.shape, method, variant, plan))
        shared = out.to(bm.device)
        comm.all_reduce(shared, group=bm.group)  # one non-zero term per element: exact
        shared = shared.to(home)
        return [shared.narrow(0, slot.offset, slot.numel).view_as(u) for slot, u in zip(layout.slots, updates)]

    return run
