"""Muon on flat ZeRO shards (stages 1, 2, 3): each matrix is orthogonalised once, by its owner rank.

At ZeRO-0 on several ranks each matrix likewise has one owner, and the owners' results are shared
(every rank already holds every update there).

Newton-Schulz needs a whole matrix while a ZeRO bucket's shard holds ``[r*L/N, (r+1)*L/N)`` of a flat
layout, so a matrix can straddle ranks. The element-wise parts of Muon (momentum, nesterov blend,
decay, the step) run on the shard as for any optimizer; the orthogonalisation runs here. The unit bound
to :meth:`zerospeed.ops.muon.Muon.bind_orthogonalizer` is *every* Muon bucket of one optimizer group that
shares one communication group (usually all of them), so a step costs two collectives, not two per bucket:

1. one all-to-all sends each owner the pieces of its matrices that the other ranks' shards hold (a rank
   receives only what it orthogonalises: about 1/N of the Muon elements, where an all-gather would bring it
   all of them);
2. each rank orthogonalises the matrices it owns;
3. one all-to-all sends every piece of the results back to the rank whose shard holds it.

Every element is moved, never summed, so the exchange is exact. The buckets of a zerospeed model are often
one matrix each (a new bucket starts where the optimizer group changes, and biases sit between the weights),
which is why the exchange is per unit and not per bucket: the earlier per-bucket all-gather and
reduce-scatter cost two collectives (each an all-reduce on gloo) per matrix.

At ZeRO-0 (replicated buckets, ``sharded=False``) every rank holds every update already: owners
orthogonalise their matrices and one all-to-all hands each rank the other owners' results.

Owners: every Muon matrix of every bucket (in bucket order, the same on all ranks) is given to the
least-loaded rank of its bucket's group, largest Newton-Schulz cost first (LPT, ties to the lower
rank), so each rank does about 1/N of the FLOPs. :class:`MuonShardPlan` counts the FLOPs each rank ran
(``ns_flops_done``), which is what the tests check.

Offload (``offload_optimizer.device: cpu``): the offload tier's step is Adam's, so for a Muon optimizer the
chosen buckets are *host-held* instead (``ShardedOptimizerState.host_held``): their fp32 master and
momentum / Adam states live in host memory and this optimizer steps them there, so the Newton-Schulz
iteration of an offloaded bucket runs on the host, where its states live. The collectives run on the
device the buckets' parameters use (NCCL cannot move host tensors): the pieces are copied there for the
exchange and back for the iteration. With ``device: nvme`` the momentum is read from the swap files into
``optimizer.state`` before the step and written back after it (:mod:`zerospeed.zero.offload.host_held`), so the
owner's Newton-Schulz still reads it in host memory, where the step keeps it.
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


@dataclass(frozen=True)
class _Owned:
    """One matrix this rank orthogonalises, at ``[start, start + numel)`` of the unit's owned buffer."""

    shape: tuple[int, ...]
    start: int
    numel: int


@dataclass
class _Exchange:
    """The static plan of one unit's exchange (the same layouts on every rank give matching orders).

    ``send[o]``: ``(tensor index, start, length)`` runs of this rank's tensors whose elements go to owner
    ``o``, in bucket then slot order; ``recv[q]``: ``(start, length)`` runs of the owned buffer that rank
    ``q`` sends, in the same order; ``keep``: runs passed through unchanged (vectors the user put on Muon).
    """

    send: list[list[tuple[int, int, int]]]
    recv: list[list[tuple[int, int]]]
    keep: list[tuple[int, int, int]]
    owned: list[_Owned]
    owned_numel: int

    @property
    def send_splits(self) -> list[int]:
        return [sum(n for _, _, n in runs) for runs in self.send]

    @property
    def recv_splits(self) -> list[int]:
        return [sum(n for _, n in runs) for runs in self.recv]


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


def _overlap(a0: int, a1: int, b0: int, b1: int) -> tuple[int, int] | None:
    lo, hi = max(a0, b0), min(a1, b1)
    return (lo, hi) if hi > lo else None


def _sharded_exchange(bms: list[_BucketMatrices]) -> _Exchange:
    """Stages 1-3: tensor ``k`` is bucket ``k``'s flat shard ``[rank*S, (rank+1)*S)``."""
    rank, world = bms[0].rank, bms[0].world_size
    send: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    recv: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    keep: list[tuple[int, int, int]] = []
    owned: list[_Owned] = []
    pos = 0
    for k, bm in enumerate(bms):
        size = bm.layout.shard_numel
        mine = (rank * size, (rank + 1) * size)
        for slot, owner in zip(bm.layout.slots, bm.owners):
            span = (slot.offset, slot.offset + slot.numel)
            if len(slot.shape) < 2:  # a vector the user put on Muon: its update passes through
                cut = _overlap(*span, *mine)
                if cut:
                    keep.append((k, cut[0] - mine[0], cut[1] - cut[0]))
                continue
            cut = _overlap(*span, *mine)
            if cut:
                send[owner].append((k, cut[0] - mine[0], cut[1] - cut[0]))
            if owner == rank:
                for q in range(world):
                    piece = _overlap(*span, q * size, (q + 1) * size)
                    if piece:
                        recv[q].append((pos + piece[0] - slot.offset, piece[1] - piece[0]))
                owned.append(_Owned(tuple(slot.shape), pos, slot.numel))
                pos += slot.numel
    return _Exchange(send, recv, keep, owned, pos)


@dataclass
class _Shares:
    """Stage 0's plan: ``mine`` are this rank's owned matrices ``(tensor, numel)`` (its results go to every
    other rank), ``theirs[q]`` rank ``q``'s, in the order ``q`` sends them; ``keep``: vectors passed through."""

    mine: list[tuple[int, int]]
    theirs: list[list[tuple[int, int]]]
    keep: list[int]
    owned: list[_Owned]
    rank: int

    @property
    def send_splits(self) -> list[int]:
        n = sum(k for _, k in self.mine)
        return [0 if q == self.rank else n for q in range(len(self.theirs))]

    @property
    def recv_splits(self) -> list[int]:
        return [sum(k for _, k in runs) for runs in self.theirs]


def _replicated_exchange(bms: list[_BucketMatrices], tensor_index: list[list[int]]) -> _Shares:
    """Stage 0: every rank holds every update (tensor ``tensor_index[k][s]`` is bucket ``k``'s slot ``s``)."""
    rank, world = bms[0].rank, bms[0].world_size
    theirs: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    keep: list[int] = []
    owned: list[_Owned] = []
    pos = 0
    for k, bm in enumerate(bms):
        for s, (slot, owner) in enumerate(zip(bm.layout.slots, bm.owners)):
            t = tensor_index[k][s]
            if len(slot.shape) < 2:
                keep.append(t)
                continue
            theirs[owner].append((t, slot.numel))
            if owner == rank:
                owned.append(_Owned(tuple(slot.shape), pos, slot.numel))
                pos += slot.numel
    mine = theirs[rank]
    theirs[rank] = []
    return _Shares(mine, theirs, keep, owned, rank)


def bind_sharded_muon(optimizer: torch.optim.Optimizer, buckets: list[Any], masters: list[torch.Tensor],
                      dp_group: Any, offloaded: set[int], opt_tensors: list[list[torch.Tensor]] | None = None,
                      sharded: bool = True, dp_world_size: int = 1) -> MuonShardPlan | None:
    """Bind an orthogonaliser to each unit of Muon buckets of ``optimizer`` (a no-op for other optimizers).

    A unit is every Muon bucket of one optimizer group whose collectives run on one group. Sharded (stages
    1-3): its tensors are the buckets' flat master shards. Replicated (stage 0, ``opt_tensors`` are the
    buckets' parameter-shaped tensors): owners orthogonalise their matrices and share the results; a single
    rank binds nothing (the whole-matrix path is the same computation).
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
    units: dict[tuple[int, int], list[int]] = {}  # (optimizer group, id(comm group)) -> its buckets, in order
    for i in muon_buckets:
        b = buckets[i]
        group, rank, world = info[i]
        bm = _BucketMatrices(b.layout, group, rank, world,
                             [owner[(i, si)] for si in range(len(b.layout.slots))], b.param_shard().device)
        plan.buckets[id(masters[i])] = bm
        units.setdefault((b.layout.group_index, id(group)), []).append(i)
    for members in units.values():
        bms = [plan.buckets[id(masters[i])] for i in members]
        if sharded:
            optimizer.bind_orthogonalizer([masters[i] for i in members],
                                          _sharded(bms, _sharded_exchange(bms), plan, variant))
        else:
            assert opt_tensors is not None
            tensors, index = [], []
            for i in members:
                index.append(list(range(len(tensors), len(tensors) + len(opt_tensors[i]))))
                tensors += opt_tensors[i]
            optimizer.bind_orthogonalizer(tensors, _replicated(bms, _replicated_exchange(bms, index), plan, variant))
    optimizer.shard_plan = plan
    return plan


def _orthogonalize(buf: torch.Tensor, owned: list[_Owned], method: str, variant: str,
                   plan: MuonShardPlan, dtype: str = "float32") -> torch.Tensor:
    """``NS(U) * scale`` of every owned matrix of ``buf``, in the same layout.

    One matrix at a time: stacking same-shape matrices into batched matmuls was measured slower on CPU
    (torch 2.13, one thread: 16 matrices of the example GPT 94-118 ms looped, 160-187 ms batched).
    """
    out = torch.empty_like(buf)
    for m in owned:
        plan.ns_flops_done += ns_flops(m.shape, method)
        # a fresh (aligned) copy: a reduction's rounding can depend on where a view starts, and the
        # single process orthogonalises a tensor of its own
        piece = buf.narrow(0, m.start, m.numel).view(m.shape[0], -1).clone()
        out.narrow(0, m.start, m.numel).copy_((newton_schulz(piece, method, variant=variant, dtype=dtype)
                                               * muon_scale(m.shape)).reshape(-1))
    return out


def _all_to_all(send: torch.Tensor, recv_numel: int, send_splits: list[int], recv_splits: list[int],
                device: torch.device, group: Any) -> torch.Tensor:
    home = send.device
    out = torch.empty(recv_numel, dtype=send.dtype, device=device)
    comm.all_to_all_single(out, send.to(device), output_split_sizes=recv_splits, input_split_sizes=send_splits,
                           group=group)
    return out.to(home)


def _sharded(bms: list[_BucketMatrices], ex: _Exchange, plan: MuonShardPlan, variant: str) -> Any:
    send_splits, recv_splits = ex.send_splits, ex.recv_splits
    send_runs = [run for runs in ex.send for run in runs]
    recv_runs = [run for runs in ex.recv for run in runs]
    device, group = bms[0].device, bms[0].group

    def run(updates: list[torch.Tensor], group_settings: Mapping[str, Any]) -> list[torch.Tensor]:
        flats = [u.reshape(-1) for u in updates]
        dtype, home = flats[0].dtype, flats[0].device  # where the states live (host memory when offloaded)
        send = torch.empty(sum(send_splits), dtype=dtype, device=home)
        at = 0
        for k, start, n in send_runs:
            send.narrow(0, at, n).copy_(flats[k].narrow(0, start, n))
            at += n
        got = _all_to_all(send, sum(recv_splits), send_splits, recv_splits, device, group)
        owned = torch.empty(ex.owned_numel, dtype=dtype, device=home)
        at = 0
        for start, n in recv_runs:
            owned.narrow(0, start, n).copy_(got.narrow(0, at, n))
            at += n
        result = _orthogonalize(owned, ex.owned, group_settings["ns_method"], variant, plan,
                                group_settings.get("ns_dtype", "float32"))
        at = 0
        for start, n in recv_runs:  # the way back: the same runs, read from the results
            got.narrow(0, at, n).copy_(result.narrow(0, start, n))
            at += n
        back = _all_to_all(got, sum(send_splits), recv_splits, send_splits, device, group)
        outs = [torch.zeros_like(f) for f in flats]  # padding stays zero
        for k, start, n in ex.keep:
            outs[k].narrow(0, start, n).copy_(flats[k].narrow(0, start, n))
        at = 0
        for k, start, n in send_runs:
            outs[k].narrow(0, start, n).copy_(back.narrow(0, at, n))
            at += n
        return [o.view_as(u) for o, u in zip(outs, updates)]

    return run


def _replicated(bms: list[_BucketMatrices], ex: _Shares, plan: MuonShardPlan, variant: str) -> Any:
    send_splits, recv_splits = ex.send_splits, ex.recv_splits
    owned_numel = sum(n for _, n in ex.mine)
    device, group = bms[0].device, bms[0].group

    def run(updates: list[torch.Tensor], group_settings: Mapping[str, Any]) -> list[torch.Tensor]:
        dtype, home = updates[0].dtype, updates[0].device
        owned = torch.empty(owned_numel, dtype=dtype, device=home)
        at = 0
        for t, n in ex.mine:
            owned.narrow(0, at, n).copy_(updates[t].reshape(-1))
            at += n
        result = _orthogonalize(owned, ex.owned, group_settings["ns_method"], variant, plan,
                                group_settings.get("ns_dtype", "float32"))
        got = _all_to_all(result.repeat(len(send_splits) - 1), sum(recv_splits), send_splits, recv_splits,
                          device, group)  # this rank's results to every other rank, theirs to this one
        outs: list[torch.Tensor] = list(updates)  # vectors on Muon pass through
        at = 0
        for t, n in ex.mine:
            outs[t] = result.narrow(0, at, n).view_as(updates[t])
            at += n
        at = 0
        for runs in ex.theirs:
            for t, n in runs:
                outs[t] = got.narrow(0, at, n).view_as(updates[t])
                at += n
        return outs

    return run
