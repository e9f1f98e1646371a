"""Tensor-parallel serving: rank 0 schedules and samples, every rank runs the forward.

As DeepSpeed-MII does: only rank 0 holds requests, the scheduler and the sampler; before each
forward it broadcasts the ragged batch (token ids, per-sequence ``(cached, new)`` and block tables,
copy-on-write block copies, which rows need logits) to the other ranks of the TP group, which
apply the same block copies to their own KV-cache shard and run the same forward; the row-parallel
layers' all-reduces meet inside it. Since the allocator lives on rank 0 and the others just follow
its block ids, every rank's cache holds the same blocks for its own heads. Only rank 0 computes
logits.

Wire format (int64, two broadcasts per forward from the group's first rank): a header
``[command, num_ids, num_items, num_decodes, num_copies, num_rows, num_block_ids]``, then one payload
with those sections concatenated. Command 0 ends :func:`worker_loop` (``engine.shutdown()``).
Every broadcast goes through :mod:`zerospeed.comm.collectives` (counted).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zerospeed.comm import collectives
from zerospeed.inference.models.layers import TPInfo

_RUN, _STOP = 1, 0
_HEADER = 7


def tp_info(tp_size: int, group: Any = None) -> TPInfo:
    """This rank's place in the TP group (the whole world when ``group`` is None)."""
    if not dist.is_initialized():
        from zerospeed.comm.dist import init_distributed

        init_distributed()
    size = dist.get_world_size(group)
    if size != tp_size:
        raise ValueError(f"tensor_parallel: {tp_size} does not match the {'group' if group else 'world'} size "
                         f"{size}; launch with torchrun --nproc_per_node {tp_size}")
    return TPInfo(rank=dist.get_rank(group), size=size, group=group)


def _src(engine: Any) -> int:
    group = engine.tp.group
    return dist.get_global_rank(group, 0) if group is not None else 0


def _device(engine: Any) -> torch.device:
    return engine.device if dist.get_backend(engine.tp.group) == "nccl" else torch.device("cpu")


def _broadcast_batch(engine: Any, ids, items, num_decodes, copies, rows) -> None:
    tables = [b for _, _, blocks in items for b in blocks]
    header = torch.tensor([_RUN, len(ids), len(items), num_decodes, len(copies), len(rows), len(tables)],
                          dtype=torch.int64, device=_device(engine))
    collectives.broadcast(header, _src(engine), engine.tp.group)
    flat = list(ids)
    for cached, new, blocks in items:
        flat += [cached, new, len(blocks)]
    flat += tables
    for s, d in copies:
        flat += [s, d]
    flat += rows
    payload = torch.tensor(flat, dtype=torch.int64, device=_device(engine))
    collectives.broadcast(payload, _src(engine), engine.tp.group)


def attach_rank0(engine: Any) -> None:
    engine._worker_hook = lambda *batch: _broadcast_batch(engine, *batch)


def send_shutdown(engine: Any) -> None:
    header = torch.zeros(_HEADER, dtype=torch.int64, device=_device(engine))
    collectives.broadcast(header, _src(engine), engine.tp.group)


def worker_loop(engine: Any) -> None:
    """Follow rank 0's forwards until it shuts down (ranks > 0)."""
    dev = _device(engine)
    while True:
        header = torch.empty(_HEADER, dtype=torch.int64, device=dev)
        collectives.broadcast(header, _src(engine), engine.tp.group)
        cmd, n_ids, n_items, num_decodes, n_copies, n_rows, n_tables = header.tolist()
        if cmd == _STOP:
            return
        payload = torch.empty(n_ids + 3 * n_items + n_tables + 2 * n_copies + n_rows, dtype=torch.int64, device=dev)
        collectives.broadcast(payload, _src(engine), engine.tp.group)
        flat = payload.tolist()
        ids, pos = flat[:n_ids], n_ids
        meta = [flat[pos + 3 * i:pos + 3 * i + 3] for i in range(n_items)]
        pos += 3 * n_items
        items = []
        for cached, new, nb in meta:
            items.append((cached, new, flat[pos:pos + nb]))
            pos += nb
        copies = [(flat[pos + 2 * i], flat[pos + 2 * i + 1]) for i in range(n_copies)]
        pos += 2 * n_copies
        rows = flat[pos:pos + n_rows]
        engine.run_forward(ids, items, num_decodes, copies, rows)
