"""Shape changes of gathered ``zero.Init`` parameters (``resize_token_embeddings`` and the like).

Inside ``zero.GatheredParameters(params, modifier_rank=r)`` user code may replace a parameter's
``.data`` with a tensor of another shape (HF's ``resize_token_embeddings`` does exactly that for the
embedding and the LM head). On exit:

* a bucket still owned by ``zero.Init`` (the model has no engine yet) is rebuilt: every parameter
  of the bucket keeps its identity, the new bucket is laid out for the new shapes, rank ``r``'s
  values are broadcast and each rank keeps its shard. The engine built afterwards sees an ordinary
  ``zero.Init`` model.
* a bucket owned by an engine is refused with an error saying to resize before
  ``zerospeed.initialize``: the engine's optimizer state (fp32 masters, moments), gradient shards
  and gather plans are laid out for the old shapes, and silently re-creating the optimizer state
  mid-training would reset Adam's moments.

Every rank runs the same user code, so every rank sees the same new shapes and takes the same path.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm
from zerospeed.zero.layout import plan_buckets
from zerospeed.zero.stage3 import registry
from zerospeed.zero.stage3.bucket import Stage3Bucket


def reshaped(bucket: Stage3Bucket) -> bool:
    """True when a live parameter of the (gathered) bucket now has a shape other than its slot's."""
    return any(tuple(p.data.shape) != tuple(bucket.layout.slots[i].shape) for i, p in bucket.live_params())


def rebuild(owner: Any, bucket: Stage3Bucket, src_rank: int) -> Stage3Bucket:
    """Replace ``bucket`` by one laid out for its parameters' current shapes; ``src_rank``'s values win."""
    if not getattr(owner, "adoptable", False):
        names = [bucket.layout.slots[i].name for i, p in bucket.live_params()
                 if tuple(p.data.shape) != tuple(bucket.layout.slots[i].shape)]
        raise ValueError(f"GatheredParameters: parameter(s) {names} changed shape under a zerospeed engine; the "
                         "engine's optimizer state is laid out for the old shape. Change shapes before "
                         "zerospeed.initialize (e.g. zerospeed.integrations.transformers.resize_token_embeddings("
                         "model, n) on the zero.Init model), then build the engine")
    live = bucket.live_params()
    params = [p for _, p in live]
    with torch.no_grad():
        values = [p.data.detach().clone() for p in params]  # the new shapes (or the gathered old values)
    bucket.pins = 0
    owner.release(bucket)
    registry.remove_bucket(bucket)
    bucket.discard()
    group = bucket.group
    rank, world = comm.get_rank(group), comm.get_world_size(group)
    names = [bucket.layout.slots[i].name for i, _ in live]
    layout = plan_buckets([(n, tuple(v.shape), 0) for n, v in zip(names, values)], 1 << 62, world)[0]
    with torch.no_grad():
        flat = torch.cat([v.reshape(-1).to(device=bucket.device, dtype=bucket.dtype) for v in values])
        if world > 1:
            src = torch.distributed.get_global_rank(group, src_rank) if group is not None else src_rank
            owner.watchdog.note_collective("broadcast", f"{bucket.name} [reshape]")
            owner.watchdog.wait(comm.broadcast(flat, src=src, group=group, async_op=True), "broadcast", bucket.name)
        pieces = [v.view(s.shape) for v, s in zip(flat.split([s.numel for s in layout.slots]), layout.slots)]
    new = Stage3Bucket(layout, params, pieces, bucket.dtype, bucket.device, group, rank, bucket.name)
    new.owner = owner
    registry.add_bucket(new)
    return new


__all__ = ["rebuild", "reshaped"]
