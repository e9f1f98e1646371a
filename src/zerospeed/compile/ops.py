"""The collectives of DeepCompile as custom ops (``torch.library``), so they can live inside graphs.

Every op forwards to an *owner* - the object that knows the buckets of one engine - looked up by an
integer key (a graph holds only plain ints, no Python objects). The owners call
:mod:`zerospeed.comm`, so every collective a graph runs is counted like the eager ones.

* ``zerospeed::gather(shard, key, bucket) -> Tensor`` - ZeRO-3: one bucket's flat gathered buffer
  (``padded_numel`` elements) from this rank's flat shard (one all-gather). The parameters are views
  of it taken *in the graph* (``split_with_sizes`` and ``view``, outside the op: a custom op may not
  return aliases of its inputs or of its other outputs, so returning per-parameter views would need a
  copy of every parameter). Differentiable: its backward is ``reduce_bucket`` of the one flat
  gradient (autograd's backward of the split is a single concatenation), so the reduce-scatter of
  each bucket is a node of the backward graph.
* ``zerospeed::gather_start(shards, key, buckets) -> Tensor`` - starts the all-gather of one or more
  buckets asynchronously (prefetch; several buckets share one collective); it returns an empty
  token that each matching ``zerospeed::gather_wait(shard, key, bucket, token)`` takes (it replaces
  the ``gather`` in the partitioned graph: same output, waits for the started all-gather), so the
  order is a data dependency that no compiler can reorder.
* ``zerospeed::release(ts)`` - frees the storage of a gathered bucket (resizes it to 0 bytes) after
  its last use; only placed where nothing later reads any view of it (see ``zero_passes``). A
  tensor that is a view of a larger buffer is left to be freed with it.
* ``zerospeed::reduce_bucket(grads, key, bucket) -> Tensor`` - ZeRO-3: one reduce-scatter of a bucket's
  gradients; returns this rank's shard of the sum (model dtype).
* ``zerospeed::reduce_start(grads, key, buckets) -> Tensor`` and ``zerospeed::reduce_wait(token, key,
  bucket) -> Tensor`` - ``reduce_bucket`` split in two (the ``async_reduce`` pass rewrites it so): the
  start launches the reduce-scatter of one or more buckets (one flat gradient each; several buckets
  share one collective) asynchronously and returns an empty token; each bucket's wait takes the
  token (a data dependency, so no compiler runs it first) and returns its reduced shard.
* ``zerospeed::offload(t, key, slot) -> Tensor`` and ``zerospeed::reload(token, key, slot, shape,
  dtype) -> Tensor`` - activation offload: the forward's offload copies a saved activation to host
  memory (pinned when the activation is on an accelerator) and returns an empty token on its
  device, which the forward saves for the backward instead of the activation; the backward's reload
  copies it back to the token's device (contiguous) right before its first use. The owner keeps a
  stack per slot (a forward run twice before its backward reloads in reverse order, as autograd
  runs the backwards).
* ``zerospeed::reduce_grads(grads, key, params)`` - ZeRO-1/2 (and 0): hands the gradients of the
  listed parameters (indices into the owner's parameter table) to the strategy's reducer, which
  accumulates them into its bucket buffers and starts each bucket's reduce(-scatter) as soon as
  the bucket is complete. Declared as mutating ``grads`` so that no dead-code elimination drops it.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

_OWNERS: dict[int, "weakref.ref[Any]"] = {}
_KEYS = itertools.count(1)


def register_owner(owner: Any) -> int:
    """A key for ``owner`` (held weakly: a dropped engine frees its buckets)."""
    key = next(_KEYS)
    _OWNERS[key] = weakref.ref(owner)
    return key


def owner_of(key: int) -> Any:
    ref = _OWNERS.get(key)
    owner = ref() if ref is not None else None
    if owner is None:
        raise RuntimeError(f"zerospeed compile op: no live engine for key {key} (was the engine destroyed?)")
    return owner


@torch.library.custom_op("zerospeed::gather", mutates_args=())
def gather(shard: torch.Tensor, key: int, bucket: int) -> torch.Tensor:
    return owner_of(key).gather(shard, bucket)


@gather.register_fake
def _gather_fake(shard: torch.Tensor, key: int, bucket: int) -> torch.Tensor:
    return shard.new_empty(owner_of(key).full_numel(bucket))


@torch.library.custom_op("zerospeed::gather_wait", mutates_args=())
def gather_wait(shard: torch.Tensor, key: int, bucket: int, token: torch.Tensor) -> torch.Tensor:
    return owner_of(key).gather(shard, bucket)


@gather_wait.register_fake
def _gather_wait_fake(shard: torch.Tensor, key: int, bucket: int, token: torch.Tensor) -> torch.Tensor:
    return shard.new_empty(owner_of(key).full_numel(bucket))


@torch.library.custom_op("zerospeed::gather_start", mutates_args=())
def gather_start(shards: list[torch.Tensor], key: int, buckets: list[int]) -> torch.Tensor:
    owner_of(key).gather_start(shards, buckets)
    return shards[0].new_empty(0)


@gather_start.register_fake
def _gather_start_fake(shards: list[torch.Tensor], key: int, buckets: list[int]) -> torch.Tensor:
    return shards[0].new_empty(0)


@torch.library.custom_op("zerospeed::release", mutates_args=("ts",))
def release(ts: list[torch.Tensor]) -> None:
    for t in ts:
        storage = t.untyped_storage()
        if storage.nbytes() == t.numel() * t.element_size():  # (not part of a larger buffer)
            storage.resize_(0)


@release.register_fake
def _release_fake(ts: list[torch.Tensor]) -> None:
    return None


@torch.library.custom_op("zerospeed::reduce_bucket", mutates_args=())
def reduce_bucket(grads: list[torch.Tensor], key: int, bucket: int) -> torch.Tensor:
    return owner_of(key).reduce_bucket(grads, bucket)


@reduce_bucket.register_fake
def _reduce_bucket_fake(grads: list[torch.Tensor], key: int, bucket: int) -> torch.Tensor:
    numel, dtype = owner_of(key).shard_numel_dtype(bucket)
    return grads[0].new_empty(numel, dtype=dtype)


@torch.library.custom_op("zerospeed::reduce_start", mutates_args=())
def reduce_start(grads: list[torch.Tensor], key: int, buckets: list[int]) -> torch.Tensor:
    owner_of(key).reduce_start(grads, buckets)
    return grads[0].new_empty(0)


@reduce_start.register_fake
def _reduce_start_fake(grads: list[torch.Tensor], key: int, buckets: list[int]) -> torch.Tensor:
    return grads[0].new_empty(0)


@torch.library.custom_op("zerospeed::reduce_wait", mutates_args=())
def reduce_wait(token: torch.Tensor, key: int, bucket: int) -> torch.Tensor:
    return owner_of(key).reduce_wait(bucket)


@reduce_wait.register_fake
def _reduce_wait_fake(token: torch.Tensor, key: int, bucket: int) -> torch.Tensor:
    numel, dtype = owner_of(key).shard_numel_dtype(bucket)
    return token.new_empty(numel, dtype=dtype)


@torch.library.custom_op("zerospeed::offload", mutates_args=())
def offload(t: torch.Tensor, key: int, slot: int) -> torch.Tensor:
    owner_of(key).offload(t, slot)
    return t.new_empty(0)


@offload.register_fake
def _offload_fake(t: torch.Tensor, key: int, slot: int) -> torch.Tensor:
    return t.new_empty(0)


@torch.library.custom_op("zerospeed::reload", mutates_args=())
def reload(token: torch.Tensor, key: int, slot: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    return owner_of(key).reload(slot, token.device)


@reload.register_fake
def _reload_fake(token: torch.Tensor, key: int, slot: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    return token.new_empty(shape, dtype=dtype)


def _gather_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.key, ctx.bucket, ctx.num_inputs = inputs[1], inputs[2], len(inputs)


def _gather_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    return (reduce_bucket([grad], ctx.key, ctx.bucket),) + (None,) * (ctx.num_inputs - 1)


gather.register_autograd(_gather_backward, setup_context=_gather_setup)


@torch.library.custom_op("zerospeed::reduce_grads", mutates_args=("grads",))
def reduce_grads(grads: list[torch.Tensor], key: int, params: list[int]) -> None:
    owner_of(key).reduce_grads(grads, params)


@reduce_grads.register_fake
def _reduce_grads_fake(grads: list[torch.Tensor], key: int, params: list[int]) -> None:
    return None


GATHER = torch.ops.zerospeed.gather.default
GATHER_WAIT = torch.ops.zerospeed.gather_wait.default
GATHER_START = torch.ops.zerospeed.gather_start.default
RELEASE = torch.ops.zerospeed.release.default
REDUCE_BUCKET = torch.ops.zerospeed.reduce_bucket.default
REDUCE_START = torch.ops.zerospeed.reduce_start.default
REDUCE_WAIT = torch.ops.zerospeed.reduce_wait.default
REDUCE_GRADS = torch.ops.zerospeed.reduce_grads.default
OFFLOAD = torch.ops.zerospeed.offload.default
RELOAD = torch.ops.zerospeed.reload.default
COLLECTIVES = (GATHER, GATHER_WAIT, GATHER_START, REDUCE_BUCKET, REDUCE_START, REDUCE_GRADS)
