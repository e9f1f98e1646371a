"""A full weight sync read straight from the ZeRO-3 shards, with no all-gather (issue #32).

A ZeRO-3 bucket's full buffer is the concatenation of its ranks' shards, and each parameter is one contiguous
range of it (:class:`zerospeed.zero.layout.BucketLayout`). So the bytes of a parameter are pieces of at most a
few shards, and the sync can send them without ever gathering a bucket:

* every tensor of the payload is split into *segments*: at shard boundaries (each segment lives in one rank's
  shard) and at the sync's message boundaries (each segment lands in one message);
* data-parallel rank 0 copies its own segments from its shard into the message being filled, and receives every
  other rank's segments straight into that message (``irecv`` into the send buffer: no staging copy);
* the other ranks post one ``isend`` per segment of their shard (views of the shard, no copy) and wait for them.

The message buffers are the sender's two half-bucket buffers (:class:`zerospeed.rl.sync._Sender`): while one is
on the wire to the generator, the next is filled over the trainer's own links, which are far faster than the
generator's. Memory the sync adds on the trainer: those two buffers (one bucket) on rank 0, nothing on the
others, no gathered bucket anywhere.

Parameters outside ZeRO-3 buckets (stages 0-2, persistent buckets) are read whole on rank 0. The plain path
(:func:`zerospeed.rl.weights.run_pass`, a gather per bucket) remains for what this one does not cover: PEFT
models (the merged weight is computed from base and adapters), offloaded parameters (``offload_param``: a
shard may be on NVMe), and buckets sharded over a group other than the data-parallel one (hpZ / MiCS).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zerospeed import comm
from zerospeed.rl.weights import WeightSource, bucket_of

_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class Segment:
    """``nbytes`` bytes of the payload at ``payload_offset``: from ``owner``'s shard of ``bucket`` at byte
    ``shard_start`` (``bucket`` None: from the whole tensor ``local``, read on rank 0)."""

    payload_offset: int
    nbytes: int
    owner: int  # group rank holding the bytes
    bucket: Any = None
    shard_start: int = 0
    local: Any = None  # (name, byte offset within the tensor) for a parameter outside ZeRO-3 buckets


def usable(source: WeightSource, dp_group: Any) -> bool:
    """Whether every parameter the sync sends can be read from the shards as they are."""
    if source.has_lora:
        return False
    world = comm.get_world_size(dp_group)
    for p in source._plain.values():
        b = bucket_of(p)
        if b is None or b.persistent:
            continue
        if b.swapper is not None or b.layout.world_size != world or b.dtype not in _NAMES:
            return False
        if b.group is not dp_group and comm.get_world_size(b.group) != world:
            return False
    return True


def entries(source: WeightSource) -> tuple[list[dict[str, Any]], list[tuple[str, Any, int, int, int]]]:
    """The manifest (one entry per HF tensor) and, per entry, ``(name, bucket or None, first element in the full
    bucket, numel, bytes per element)``, in payload order: whole tensors first, then by bucket and offset."""
    from zerospeed.zero.stage3 import registry

    rows = []
    for name, p in source._plain.items():
        found = registry.lookup(p)
        if found is None or found[0].persistent:
            t = source.read(name) if found is None else found[0].slot_view(found[1])
            rows.append(((-1, len(rows)), {"name": name, "shape": list(t.shape), "dtype": _NAMES[t.dtype]},
                         (name, None, 0, t.numel(), t.element_size())))
            continue
        b, pos = found
        slot = b.layout.slots[pos]
        rows.append(((b.index, slot.offset), {"name": name, "shape": list(slot.shape), "dtype": _NAMES[b.dtype]},
                     (name, b, slot.offset, slot.numel, b.shard.element_size())))
    rows.sort(key=lambda r: r[0])
    return [r[1] for r in rows], [r[2] for r in rows]


def segments(tasks: list[tuple[str, Any, int, int, int]], message_bytes: int) -> list[Segment]:
    """Every payload byte range, split at shard and message boundaries (the same list on every rank)."""
    out: list[Segment] = []
    pos = 0
    for name, b, start, numel, size in tasks:
        if b is None:  # whole on rank 0: split at message boundaries only
            nbytes, done = numel * size, 0
            while done < nbytes:
                n = min(nbytes - done, message_bytes - pos % message_bytes)
                out.append(Segment(pos, n, 0, local=(name, done)))
                pos += n
                done += n
            continue
        shard_bytes = b.layout.shard_numel * size
        e, end = start * size, (start + numel) * size  # bytes of the full bucket
        while e < end:
            owner, local = divmod(e, shard_bytes)
            n = min(end, (owner + 1) * shard_bytes, e + message_bytes - pos % message_bytes) - e
            out.append(Segment(pos, n, owner, b, local))
            pos += n
            e += n
    return out


def stream(source: WeightSource, tasks: list[tuple[str, Any, int, int, int]], sender: Any, dp_group: Any,
           rank0: bool) -> None:
    """Run the sync's pass: rank 0 fills ``sender``'s messages (own bytes copied, the others' received in
    place); every other rank sends its segments to rank 0. A collective over ``dp_group`` (point-to-point)."""
    segs = segments(tasks, sender.message_bytes)
    me = comm.get_rank(dp_group)
    if not rank0:
        root = dist.get_global_rank(dp_group, 0) if dp_group is not None else 0
        works = [comm.isend(_shard_bytes(s), root, dp_group) for s in segs if s.owner == me and s.bucket is not None]
        for w in works:
            w.wait()
        return
    current: tuple[str, torch.Tensor] | None = None
    for s in segs:
        view = sender.reserve(s.nbytes)
        if s.bucket is None:
            name, off = s.local
            if current is None or current[0] != name:
                current = (name, source.read(name).contiguous().reshape(-1).view(torch.uint8))
            view.copy_(current[1].narrow(0, off, s.nbytes))
        elif s.owner == 0:
            view.copy_(_shard_bytes(s))
        else:
            src = dist.get_global_rank(dp_group, s.owner) if dp_group is not None else s.owner
            sender.pending(comm.irecv(view, src, dp_group))
        sender.commit(s.nbytes)


def _shard_bytes(s: Segment) -> torch.Tensor:
    return s.bucket.shard.view(torch.uint8).narrow(0, s.shard_start, s.nbytes)
