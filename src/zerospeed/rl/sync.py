"""The trainer side of weight sync (issue #32): ``engine.sync_weights(address)``.

Every data-parallel rank calls it (the ZeRO-3 gathers are collectives); data-parallel rank 0 alone talks to the
generator (``zerospeed serve --weight-update-group HOST:PORT``; the protocol is in
:mod:`zerospeed.inference.serving.weight_sync`).

Streaming from the shards: the bytes go into two send buffers of ``bucket_bytes / 2`` (one bucket of memory
together): while one is on the wire (an asynchronous send), the sync fills the other. A full sync reads the
ZeRO-3 shards directly (:mod:`zerospeed.rl.shard_stream`): dp rank 0 copies its own shards' bytes into the
buffer and receives the other ranks' bytes straight into it, point to point; no bucket is ever gathered, so the
trainer grows by the two buffers (one bucket) on rank 0 and by nothing elsewhere. What that cannot read (a PEFT
model, sent merged: base plus adapters computed per tensor; ``lora_only=True``, the adapters' A and B alone;
offloaded parameters) goes through one pass over the ZeRO-3 buckets (:func:`zerospeed.rl.weights.run_pass`),
one HF tensor at a time, each bucket gathered once and released after its last tensor: at most the ZeRO-3
bucket being read plus one sync bucket, never the whole model.

Tensor parallelism (AutoTP, ``tensor_parallel.autotp_size`` > 1): the server gets whole HF tensors. Each TP-split
weight is assembled from the TP ranks' pieces by an all-gather over the TP group (:func:`zerospeed.rl.tp_layout.
assemble_over_tp`) inside the pass over the buckets (never the shard stream), which every rank of data-parallel
rank 0's TP group runs; TP rank 0 of data-parallel rank 0 alone connects and sends. The outcome is agreed over the
data-parallel group, then over the TP group, so every rank returns or raises alike. LoRA under TP is refused.

Counting: every buffer sent is recorded in :data:`zerospeed.comm.COUNTER` as a ``send`` (the pair group is
outside the mesh, so comm/'s wrappers cannot carry it); :class:`SyncReport` has the bytes, the time and the peak
bytes the sync added on this rank.
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass
from typing import Any

import torch

from zerospeed import comm
from zerospeed.inference.serving import weight_sync as wire
from zerospeed.rl import shard_stream
from zerospeed.rl.weights import Job, WeightSource, bucket_of, run_pass

DEFAULT_BUCKET_BYTES = 32 << 20
_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class SyncReport:
    """One sync, as this rank saw it."""

    version: int  # the server's weights version after the sync (-1 on ranks other than dp rank 0)
    payload_bytes: int
    num_buckets: int
    bucket_bytes: int
    seconds: float
    send_seconds: float  # rank 0: time spent waiting for sends
    pass_seconds: float  # the pass over the shards: gathers, reads, packing, sends (until the last byte left)
    reply_seconds: float  # rank 0: from the last byte sent to the server's answer (its staging check and swap)
    peak_gathered_bytes: int  # ZeRO-3 buckets gathered at once during the pass, at most (0 read from the shards)
    send_buffer_bytes: int


class WeightSyncClient:
    """dp rank 0's connection to one generator server (kept on the engine between syncs)."""

    def __init__(self, address: str, timeout_s: float = 120.0, device: Any = "cpu") -> None:
        self.address = address
        host, port = wire.parse_address(address, "sync_weights(address)")
        try:
            self.store = torch.distributed.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # noqa: BLE001
            raise wire.WeightSyncError(f"sync_weights: no generator server at {address} ({exc})") from None
        check_backend(self.store.get("wsync/backend").decode(), device, address)
        generation = int(self.store.get("wsync/generation").decode())
        self.pg = wire.pair_group(self.store, generation, 1, timeout_s, device)


def check_backend(server_backend: str, device: Any, address: str) -> None:
    """Both ends of the pair must pick the same backend (:func:`~zerospeed.inference.serving.weight_sync.
    backend_for`): NCCL when the weights are on CUDA, gloo on CPU."""
    mine = wire.backend_for(device)
    if server_backend != mine:
        raise wire.WeightSyncError(
            f"sync_weights: the generator at {address} syncs over {server_backend} (its weights on "
            f"{'CUDA' if server_backend == 'nccl' else 'CPU'}) but this trainer's weights are on {torch.device(device)} "
            f"({mine}); put both on CUDA (NCCL) or both on CPU (gloo)")


def _device(engine: Any) -> torch.device:
    """Where the trainer's weights live (the pair's backend follows it)."""
    device = getattr(engine, "device", None)
    return torch.device(device) if device is not None else torch.device("cpu")


def _shape(p: torch.nn.Parameter) -> list[int]:
    from zerospeed.zero.stage3 import registry

    found = registry.lookup(p)
    if found is None:
        return list(p.shape)
    bucket, pos = found
    return list(bucket.layout.slots[pos].shape)


def _entries(source: WeightSource, lora_only: bool, splits: dict[int, Any] | None = None,
             tp_group: Any = None) -> tuple[list[dict[str, Any]], list[Job]]:
    """The manifest and one job per tensor (its HF name(s) and how to read it), in module order. ``splits``: the
    training parameters split over tensor-parallel ranks (id -> ``TPSplit``): their jobs assemble the whole tensor
    from every TP rank's piece (an all-gather over ``tp_group``, so every rank of the TP group runs them)."""
    splits = splits or {}
    entries, jobs = [], []
    if lora_only:
        if not source.has_lora:
            raise ValueError("sync_weights(lora_only=True): the model has no LoRA adapters (a PEFT model)")
        for name, (base, pairs) in source._lora.items():
            if len(pairs) != 1:
                raise ValueError(f"sync_weights(lora_only=True): {name} has {len(pairs)} active adapters; one is "
                                 "supported")
            A, B, s = pairs[0]
            entries.append({"name": name, "a_shape": _shape(A), "b_shape": _shape(B), "dtype": _NAMES[A.dtype],
                            "scaling": s})
            jobs.append(Job(None, (), lambda A=A, B=B: torch.cat([A.detach().reshape(-1), B.detach().reshape(-1)]),
                            params=[A, B]))
        return entries, jobs
    for name in list(source._plain) + list(source._lora):
        params = source.params_of(name)
        base = params[0]
        split = splits.get(id(base))
        if split is None:
            entries.append({"name": name, "shape": _shape(base), "dtype": _NAMES[base.dtype]})
            jobs.append(Job(None, (name,), lambda name=name: source.read(name)))
            continue
        from zerospeed.rl.tp_layout import assemble_over_tp

        entries.append({"name": name, "shape": list(split.full_shape), "dtype": _NAMES[base.dtype]})
        jobs.append(Job(None, (name,), lambda name=name, split=split: assemble_over_tp(source.read(name), split,
                                                                                        tp_group)))
    return entries, jobs


class _Sender:
    """Packs tensors' bytes into two buffers of ``bucket_bytes / 2`` (together one bucket of memory): while one is
    on the wire (an asynchronous send, rank 0), the pass fills the other; each full buffer is one message."""

    def __init__(self, pg: Any, bucket_bytes: int, total: int) -> None:
        self.pg = pg
        half = max(1, min(bucket_bytes // 2 if bucket_bytes > 1 else 1, max(total, 1)))
        self.bufs = [pg.empty(half) if pg is not None else torch.empty(half, dtype=torch.uint8) for _ in range(2)]
        self.works: list[Any] = [None, None]
        self.recvs: list[list[Any]] = [[], []]
        self.cur = 0
        self.fill = 0
        self.sent = 0
        self.num_buckets = 0
        self.send_s = 0.0
        self.error: BaseException | None = None

    @property
    def message_bytes(self) -> int:
        return self.bufs[0].numel()

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() for b in self.bufs)

    def _wait(self, i: int) -> None:
        work, self.works[i] = self.works[i], None
        if work is None:
            return
        start = time.perf_counter()
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - finish the pass (its gathers are collectives), then raise
            self.error = self.error or exc
        self.send_s += time.perf_counter() - start

    def reserve(self, n: int) -> torch.Tensor:
        """The next ``n`` bytes of the message being filled (``n`` never crosses its end), to be written in place
        (a copy, or a receive registered with :meth:`pending`) and then :meth:`commit` ted."""
        if self.fill == 0:
            self._wait(self.cur)  # this buffer's previous message has left
        buf = self.bufs[self.cur]
        if self.fill + n > buf.numel():
            raise RuntimeError(f"internal: {n} bytes reserved with {buf.numel() - self.fill} left in the message")
        return buf.narrow(0, self.fill, n)

    def pending(self, work: Any) -> None:
        """A receive writing into the current message: waited for before the message is sent."""
        self.recvs[self.cur].append(work)

    def commit(self, n: int) -> None:
        self.fill += n
        if self.fill == self.bufs[self.cur].numel():
            self.flush()

    def add(self, t: torch.Tensor) -> None:
        data = t.detach().contiguous().reshape(-1).view(torch.uint8)
        pos = 0
        while pos < data.numel():
            if self.fill == 0:
                self._wait(self.cur)  # this buffer's previous message has left
            buf = self.bufs[self.cur]
            n = min(buf.numel() - self.fill, data.numel() - pos)
            buf.narrow(0, self.fill, n).copy_(data.narrow(0, pos, n))
            self.fill += n
            pos += n
            if self.fill == buf.numel():
                self.flush()

    def flush(self) -> None:
        """Send the current buffer's bytes (asynchronously) and switch to the other buffer."""
        if not self.fill:
            return
        recvs, self.recvs[self.cur] = self.recvs[self.cur], []
        for work in recvs:  # the other ranks' bytes of this message (collectives: never skipped on error)
            try:
                work.wait()
            except Exception as exc:  # noqa: BLE001
                self.error = self.error or exc
        if self.pg is not None and self.error is None:
            try:
                self.works[self.cur] = self.pg.isend(self.bufs[self.cur].narrow(0, 0, self.fill), 0)
            except Exception as exc:  # noqa: BLE001
                self.error = exc
            comm.COUNTER.record("send", self.fill, 1)
        self.sent += self.fill
        self.num_buckets += 1
        self.fill = 0
        self.cur = 1 - self.cur

    def finish(self) -> None:
        self.flush()
        for i in range(2):
            self._wait(i)


def sync_weights(engine: Any, address: str, *, lora_only: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout_s: float = 120.0) -> SyncReport:
    """Send the training engine's current weights to the generator server at ``address`` (HOST:PORT of its
    ``--weight-update-group``). Every data-parallel rank calls it. Returns after the server applied them (its
    new version in the report) or raises :class:`~zerospeed.inference.serving.weight_sync.WeightSyncError` with
    the server's reason (the server then still serves its previous weights)."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"sync_weights(bucket_bytes=...): must be a positive number of bytes, got {bucket_bytes!r}")
    wire.parse_address(address, "sync_weights(address)")  # every rank refuses a bad address alike, at once
    from zerospeed.rl.tp_layout import training_splits

    start = time.perf_counter()
    rl = engine.__dict__.get("rl")
    source = rl.rollout.source if rl is not None and rl._rollout is not None else WeightSource(engine.module)
    splits = training_splits(engine.module)
    tp_group, tp_rank = None, 0
    if splits:  # tensor parallelism: whole tensors assembled over the TP group, (dp 0, tp 0) talks to the server
        if lora_only or source.has_lora:
            raise ValueError("sync_weights: LoRA adapters under tensor parallelism (tensor_parallel.autotp_size > 1) "
                             "are not synced yet; sync a LoRA model from a training engine without TP")
        tp_group = comm.get_mesh().tp_group
        tp_rank = comm.get_rank(tp_group)
    direct = not lora_only and not splits and shard_stream.usable(source, engine.dp_group)
    if direct:  # straight from the shards, no all-gather (see zerospeed.rl.shard_stream)
        entries, tasks = shard_stream.entries(source)
        jobs = []
    else:
        entries, jobs = _entries(source, lora_only, splits, tp_group)
    ordered = []
    for job in jobs:
        params = job.params or [p for n in job.names for p in source.params_of(n)]
        buckets = []
        for p in params:
            b = bucket_of(p)
            if b is not None and all(b is not c for c in buckets):
                buckets.append(b)
        ordered.append((job, buckets))
    if not direct:
        order = sorted(range(len(ordered)), key=lambda i: min((b.index for b in ordered[i][1]), default=-1))
        ordered = [ordered[i] for i in order]
        entries = [entries[i] for i in order]
    total = sum(wire.entry_nbytes(e) for e in entries)
    rank0 = comm.get_rank(engine.dp_group) == 0  # reads (and under TP assembles) what is sent
    talker = rank0 and tp_rank == 0  # the one rank connected to the server
    client, connect_error = None, None
    if talker:
        clients = engine.__dict__.setdefault("_weight_sync_clients", {})
        client = clients.get(address)
        if client is None:
            try:
                client = clients[address] = WeightSyncClient(address, timeout_s, _device(engine))
            except Exception as exc:  # noqa: BLE001 - the other ranks still run the pass: raise after it
                connect_error = exc
    sender = _Sender(client.pg if client else None, bucket_bytes, total)
    sender.error = connect_error
    manifest = json.dumps(entries).encode()
    n_buckets = -(-total // sender.message_bytes) if total else 0
    owners = {} if direct else {id(b.owner): b.owner for _, bs in ordered for b in bs}
    baseline = sum(o.live_bytes for o in owners.values())
    for o in owners.values():
        o.live_peak_bytes = o.live_bytes
    if talker and client is not None:
        try:
            wire.send(client.pg, torch.tensor([wire.MAGIC, wire.LORA if lora_only else wire.FULL, len(manifest),
                                               n_buckets, sender.message_bytes, total], dtype=torch.int64), 0)
            wire.send_bytes(client.pg, manifest, 0)
        except Exception as exc:  # noqa: BLE001
            sender.error = exc
    pass_start = time.perf_counter()
    if direct:
        shard_stream.stream(source, tasks, sender, engine.dp_group, rank0)
    else:  # every rank runs the pass (its gathers are collectives); dp rank 0 alone reads and packs what it sends
        def consume(job: Job) -> None:  # under TP every rank of dp rank 0's TP group assembles (a collective)
            value = job.thunk()
            if talker:
                sender.add(value)
        run_pass(ordered, consume=consume if rank0 else (lambda job: None))
    sender.finish()
    pass_s = time.perf_counter() - pass_start
    peak = sum(o.live_peak_bytes for o in owners.values()) - baseline
    version, failure = -1, None
    reply_start = time.perf_counter()
    if talker:
        try:
            if sender.error is not None:
                raise sender.error
            reply = torch.zeros(3, dtype=torch.int64)
            wire.recv(client.pg, reply, 0)
            status, version, n = (int(x) for x in reply)
            message = wire.recv_bytes(client.pg, n, 0).decode()
            if status != 0:
                failure = (f"the generator refused the weights (it keeps version {version}): {message}")
        except Exception as exc:  # noqa: BLE001 - the pair group is broken: reconnect next time
            engine.__dict__.get("_weight_sync_clients", {}).pop(address, None)
            failure = str(exc) if isinstance(exc, wire.WeightSyncError) else \
                f"sync_weights to {address} failed: {type(exc).__name__}: {exc}"
    reply_s = time.perf_counter() - reply_start
    outcome = torch.tensor([1 if failure else 0, max(version, 0) if talker else 0], dtype=torch.int64)
    groups = [g for g in [engine.dp_group] + ([tp_group] if tp_group is not None else [])
              if comm.get_world_size(g) > 1]  # dp_group None: the default group
    for g in groups:  # every rank returns or raises alike (over dp, then over TP: every rank hears the talker)
        comm.all_reduce(outcome, op=comm.ReduceOp.MAX, group=g)
    if int(outcome[0]):
        for g in groups:  # every rank raises the talker's message
            failure = next((m for m in comm.all_gather_object(failure, group=g) if m), failure)
        raise wire.WeightSyncError(failure)
    version = int(outcome[1])
    return SyncReport(version=version, payload_bytes=total, num_buckets=sender.num_buckets,
                      bucket_bytes=sender.message_bytes, seconds=time.perf_counter() - start,
                      send_seconds=sender.send_s, pass_seconds=pass_s, reply_seconds=reply_s,
                      peak_gathered_bytes=peak, send_buffer_bytes=sender.buffer_bytes)
