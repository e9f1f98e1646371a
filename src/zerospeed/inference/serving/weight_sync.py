"""The generator side of weight sync (issue #32): ``zerospeed serve --weight-update-group HOST:PORT``.

The server hosts a ``torch.distributed`` TCP store at HOST:PORT and, on it, a two-member process group (the
server is member 0, the trainer's data-parallel rank 0 member 1): a process group of its own, outside any
training job's world (:class:`Pair`). Its backend follows the device of the served weights
(:func:`backend_for`): gloo on CPU, NCCL on CUDA, published in the store as ``wsync/backend``; a trainer whose
weights are on the other kind of device is refused with both named. The trainer's half is
:func:`zerospeed.rl.sync.sync_weights`.

One sync, over that group (every message a tensor on the pair's device; ``tag`` 0):

1. trainer -> server: a header ``int64[6]`` = ``MAGIC, mode (0 full, 1 LoRA delta), manifest bytes, buckets,
   bucket bytes, payload bytes``, then the manifest (UTF-8 JSON as ``uint8``): one entry per tensor in payload
   order, ``{"name", "shape", "dtype"}`` (LoRA delta: ``{"name": base weight, "a_shape", "b_shape",
   "dtype", "scaling"}``, A then B in the payload);
2. trainer -> server: the payload in ``buckets`` messages of ``bucket bytes`` (the last may be shorter): the
   tensors' bytes back to back, a tensor may span buckets;
3. full sync: the family's own load plan checks every name and shape of the manifest before the payload
   arrives; the server receives into a ring of ``RING_BUCKETS`` preallocated buckets (kept between syncs) and
   applies each bucket as it lands: every parameter whose tensors are complete is converted (fused, cast) into
   a *shadow* copy of the served weights, while later buckets are still on the wire. After the last bucket
   the engine loop swaps the shadow tensors in between two engine steps with no request in the engine
   (:meth:`~zerospeed.inference.serving.engine_loop.EngineLoop.request_update`): a pointer swap per parameter,
   no copy; the old tensors become the next sync's shadow (server memory: one more copy of the weights plus
   the ring). LoRA delta: the (small) payload is staged whole, and the loader copies it in on the engine
   thread. Either way the prefix cache is emptied (its K/V came from the old weights), and the version goes
   up by one;
4. server -> trainer: ``int64[3]`` = ``status (0 ok), weights version, message bytes`` and the message.

A sync that breaks (the trainer killed, a timeout, a bad manifest) leaves the served weights and version as
they were; the server logs the reason, answers it when the trainer is still there, and waits for the next
trainer on a fresh group (the store's ``wsync/generation`` key tells the trainer which).

LoRA delta: the server's base weights are its model folder's (the frozen base of LoRA training); each update
applies ``W_base + sum(scaling * B @ A)`` to the targeted weights. After a full sync the folder is no longer the
base, so a LoRA-delta sync is then refused with a message saying so.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("zerospeed.serve")

MAGIC = 0x5A535753  # "ZSWS"
FULL, LORA = 0, 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightSyncError(RuntimeError):
    """A weight sync that did not happen; the server keeps the weights it had."""


def parse_address(text: str, what: str = "--weight-update-group") -> tuple[str, int]:
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what}: expected HOST:PORT (e.g. 127.0.0.1:29600), got {text!r}")
    return host, int(port)


def backend_for(device: Any) -> str:
    """The pair group's backend for weights on ``device``: NCCL for CUDA tensors, gloo otherwise (CPU). Both ends
    must agree: the server publishes its choice in the store (``wsync/backend``) and a trainer whose weights
    live elsewhere is refused naming both."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class Pair:
    """The two-member process group of one trainer connection (``rank`` 0 the server, 1 the trainer), over the
    backend :func:`backend_for` picks for ``device``; every message is a tensor on ``device``."""

    def __init__(self, store: Any, generation: int, rank: int, timeout_s: float, device: Any = "cpu") -> None:
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        prefixed = dist.PrefixStore(f"wsync{generation}", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if self.backend == "nccl":
            if not dist.is_nccl_available():
                raise WeightSyncError(f"weight sync: weights on {self.device} need NCCL, and this torch has none")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)

    def empty(self, n: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, device=self.device)

    def isend(self, tensor: torch.Tensor, dst: int) -> Any:
        return self.pg.send([tensor], dst, 0)

    def irecv(self, tensor: torch.Tensor, src: int) -> Any:
        return self.pg.recv([tensor], src, 0)


def pair_group(store: Any, generation: int, rank: int, timeout_s: float, device: Any = "cpu") -> Pair:
    return Pair(store, generation, rank, timeout_s, device)


def send(pair: Pair, tensor: torch.Tensor, dst: int) -> None:
    """One message, waited for (counted by the caller); moved to the pair's device first."""
    pair.isend(tensor.to(pair.device), dst).wait()


def recv(pair: Pair, tensor: torch.Tensor, src: int) -> None:
    buf = tensor if tensor.device == pair.device else torch.empty_like(tensor, device=pair.device)
    pair.irecv(buf, src).wait()
    if buf is not tensor:
        tensor.copy_(buf)


def send_bytes(pair: Pair, data: bytes, dst: int) -> None:
    if data:
        send(pair, torch.frombuffer(bytearray(data), dtype=torch.uint8), dst)


def recv_bytes(pair: Pair, n: int, src: int) -> bytes:
    if n <= 0:
        return b""
    buf = torch.empty(n, dtype=torch.uint8)
    recv(pair, buf, src)
    return bytes(buf.numpy().tobytes())


def entry_nbytes(e: dict[str, Any]) -> int:
    size = _DTYPES[e["dtype"]].itemsize
    if "a_shape" in e:
        return size * (_numel(e["a_shape"]) + _numel(e["b_shape"]))
    return size * _numel(e["shape"])


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


RING_BUCKETS = 4  # receives posted ahead in a full sync (the trainer has two buffers in flight)


def _aligned(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``raw`` bytes at an address ``dtype`` can be viewed at (a copy when the payload put them elsewhere)."""
    return raw.clone() if raw.storage_offset() % dtype.itemsize else raw


class _Refused(Exception):
    """A sync the server read to its end and refuses (``__cause__`` says why); the connection stays good."""


def _check_sizes(manifest: list[dict[str, Any]], num_buckets: int, bucket_bytes: int, total: int) -> None:
    if sum(entry_nbytes(e) for e in manifest) != total:
        raise WeightSyncError("manifest and payload sizes disagree")
    if bucket_bytes < 1 or num_buckets != -(-total // bucket_bytes):
        raise WeightSyncError(f"{num_buckets} buckets of {bucket_bytes} bytes for {total} payload bytes")


class _StreamPlan:
    """One full sync's load plan over the manifest: the family's ``load_weights`` run against the manifest's
    names and shapes (checked before any byte arrives), then fed the payload bucket by bucket (:meth:`take`);
    each plan job (one served parameter) runs as soon as every tensor it reads has arrived, into the parameter's
    shadow tensor. Tensors wholly inside one bucket are read in place when their job can run at once, else copied
    out (a job waiting for a later bucket, or a tensor spanning buckets)."""

    def __init__(self, engine: Any, manifest: list[dict[str, Any]], shadow: dict[int, torch.Tensor]) -> None:
        import importlib

        from zerospeed.inference.models.loader import TensorReader

        plan = self
        meta = {e["name"]: torch.empty(e["shape"], dtype=_DTYPES[e["dtype"]], device="meta") for e in manifest}

        class Reader(TensorReader):
            def get(self, name: str, shape: tuple[int, ...]) -> Any:
                plan._pending.append(name)
                return super().get(name, shape)

            def assign(self, param: torch.nn.Parameter, thunk: Any) -> None:
                plan._jobs.append((param, tuple(plan._pending), thunk))
                plan._pending = []

            def _read(self, name: str) -> torch.Tensor:
                return plan._ready[name].to(device=self.device, dtype=self.dtype)

        self._pending: list[str] = []
        self._jobs: list[tuple[torch.nn.Parameter, tuple[str, ...], Any]] = []
        self._ready: dict[str, torch.Tensor] = {}
        reader = Reader("<weight sync>", engine.dtype, engine.device, state_dict=meta)
        importlib.import_module(f"zerospeed.inference.models.{engine.spec.family}").load_weights(engine.model, reader)
        reader.check()  # names and shapes, before any payload byte
        jobbed = {id(p) for p, _, _ in self._jobs}
        unfilled = [n for n, p in engine.model.named_parameters() if id(p) not in jobbed]
        if unfilled:
            raise WeightSyncError(f"internal: served parameters the sync would not fill: {', '.join(unfilled[:5])}")
        self.params = list({id(p): p for p, _, _ in self._jobs}.values())
        for p in self.params:
            s = shadow.get(id(p))
            if s is None or s.shape != p.shape or s.stride() != p.stride() or s.dtype != p.dtype:
                shadow[id(p)] = torch.empty_like(p.data)  # same strides as the served tensor
        self._shadow = shadow
        self._entries = []  # (start, end, name, dtype, shape)
        offset = 0
        for e in manifest:
            n = entry_nbytes(e)
            self._entries.append((offset, offset + n, e["name"], _DTYPES[e["dtype"]], e["shape"]))
            offset += n
        self._next_entry = 0
        self._partial: dict[str, torch.Tensor] = {}
        self._missing = {i: len(set(names)) for i, (_, names, _) in enumerate(self._jobs)}
        self._jobs_of: dict[str, list[int]] = {}
        for i, (_, names, _) in enumerate(self._jobs):
            for name in set(names):
                self._jobs_of.setdefault(name, []).append(i)
        self._uses = {name: len(js) for name, js in self._jobs_of.items()}
        self.num_done = 0

    def take(self, start: int, data: torch.Tensor) -> None:
        """The payload bytes ``[start, start + len(data))`` arrived (``data`` is reused after this call)."""
        end = start + data.numel()
        in_place: list[str] = []
        while self._next_entry < len(self._entries):
            e0, e1, name, dtype, shape = self._entries[self._next_entry]
            if e0 >= end:
                break
            lo, hi = max(e0, start), min(e1, end)
            if e0 >= start and e1 <= end:  # wholly inside this bucket: a view, for now
                raw = data.narrow(0, e0 - start, e1 - e0)
                if raw.storage_offset() % dtype.itemsize:  # a message size that is no multiple of the element
                    raw = raw.clone()
                else:
                    in_place.append(name)
            else:
                raw = self._partial.get(name)
                if raw is None:
                    raw = self._partial[name] = torch.empty(e1 - e0, dtype=torch.uint8, device=data.device)
                raw.narrow(0, lo - e0, hi - lo).copy_(data.narrow(0, lo - start, hi - lo))
            if e1 > end:
                break  # continues in the next bucket
            self._partial.pop(name, None)
            self._arrived(name, raw.view(dtype).view(shape))
            self._next_entry += 1
        for name in in_place:  # still waiting for a job that needs a later bucket: copy out of the bucket
            if name in self._ready:
                self._ready[name] = self._ready[name].clone()

    def _arrived(self, name: str, t: torch.Tensor) -> None:
        if name not in self._jobs_of:
            return  # ignorable (e.g. a tied lm_head.weight)
        self._ready[name] = t
        for i in self._jobs_of[name]:
            self._missing[i] -= 1
            if self._missing[i] == 0:
                self._run(i)

    def _run(self, i: int) -> None:
        param, names, thunk = self._jobs[i]
        t = thunk()
        target = self._shadow[id(param)]
        if tuple(t.shape) != tuple(target.shape):  # only a bug in a family's plan can get here
            raise WeightSyncError(f"internal: tensor of shape {tuple(t.shape)} for parameter {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(t)
        self.num_done += 1
        for name in set(names):
            self._uses[name] -= 1
            if self._uses[name] == 0:
                self._ready.pop(name, None)

    def finish(self) -> None:
        if self.num_done != len(self._jobs):
            raise WeightSyncError(f"internal: {len(self._jobs) - self.num_done} parameters not filled by the sync")


class WeightUpdateReceiver:
    """The server's thread that accepts trainers and stages their syncs (see the module docstring)."""

    def __init__(self, handle: Any, address: str, model_dir: str | None = None, timeout_s: float = 120.0) -> None:
        self.host, self.port = parse_address(address)
        self.handle = handle
        self.engine = handle.engine
        self.loop = handle.engine_loop
        self.timeout_s = timeout_s
        self.model_dir = model_dir
        self.base_is_folder = True
        self.store = dist.TCPStore(self.host, self.port, None, True, datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.generation = 0
        self._shadow: dict[int, torch.Tensor] = {}  # id(served parameter) -> its next value (full syncs)
        self._ring: list[torch.Tensor] = []
        self.last_error: str | None = None
        self.num_syncs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zerospeed-weight-sync", daemon=True)

    def start(self) -> "WeightUpdateReceiver":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.store.set("wsync/backend", backend_for(self.engine.device))
            self.store.set("wsync/generation", str(self.generation))
            try:
                pg = pair_group(self.store, self.generation, 0, self.timeout_s, self.engine.device)
            except Exception as exc:  # noqa: BLE001 - nobody connected in time: offer the same generation again
                log.debug("weight sync: no trainer yet (%s)", exc)
                continue
            log.info("weight sync: trainer connected (generation %d)", self.generation)
            try:
                while not self._stop.is_set():
                    self._one_sync(pg)
            except Exception as exc:  # noqa: BLE001 - the connection broke: old weights stay, wait for another
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("weight sync broken, serving weights version %d: %s", self.loop.weights_version,
                            self.last_error)
            self.generation += 1

    def _one_sync(self, pg: Pair) -> None:
        header = torch.zeros(6, dtype=torch.int64)
        recv(pg, header, 1)
        magic, mode, manifest_len, num_buckets, bucket_bytes, total = (int(x) for x in header)
        if magic != MAGIC:
            raise WeightSyncError(f"bad header from the trainer (magic {magic:#x})")
        manifest = json.loads(recv_bytes(pg, manifest_len, 1).decode())
        status, message = 0, ""
        try:
            if mode == FULL:
                version = self._apply_streamed(pg, manifest, num_buckets, bucket_bytes, total)
            else:
                version = self._apply(mode, manifest, self._receive(pg, manifest, num_buckets, bucket_bytes, total))
        except _Refused as refused:  # the trainer hears why, the server keeps its weights
            exc = refused.__cause__
            status, message, version = 1, f"{type(exc).__name__}: {exc}", self.loop.weights_version
            self.last_error = message
        reply = message.encode()
        send(pg, torch.tensor([status, version, len(reply)], dtype=torch.int64), 1)
        send_bytes(pg, reply, 1)

    def _receive(self, pg: Any, manifest: list[dict[str, Any]], num_buckets: int, bucket_bytes: int,
                 total: int) -> torch.Tensor:
        _check_sizes(manifest, num_buckets, bucket_bytes, total)
        payload = pg.empty(total)  # staging: the served weights are untouched
        offset, works = 0, []
        for _ in range(num_buckets):  # every receive posted at once: the trainer's sends never wait for one
            n = min(bucket_bytes, total - offset)
            if n <= 0:
                raise WeightSyncError(f"{num_buckets} buckets of {bucket_bytes} bytes for {total} payload bytes")
            works.append(pg.irecv(payload.narrow(0, offset, n), 1))
            offset += n
        for work in works:
            work.wait()
        if offset != total:
            raise WeightSyncError(f"received {offset} of {total} payload bytes")
        return payload

    def _tensors(self, manifest: list[dict[str, Any]], payload: torch.Tensor) -> dict[str, Any]:
        out: dict[str, Any] = {}
        offset = 0
        for e in manifest:
            dtype = _DTYPES[e["dtype"]]
            if "a_shape" in e:
                parts = []
                for key in ("a_shape", "b_shape"):
                    n = _numel(e[key]) * dtype.itemsize
                    parts.append(_aligned(payload.narrow(0, offset, n), dtype).view(dtype).view(e[key]))
                    offset += n
                out[e["name"]] = (parts[0], parts[1], float(e["scaling"]))
            else:
                n = _numel(e["shape"]) * dtype.itemsize
                out[e["name"]] = _aligned(payload.narrow(0, offset, n), dtype).view(dtype).view(e["shape"])
                offset += n
        return out

    def _apply(self, mode: int, manifest: list[dict[str, Any]], payload: torch.Tensor) -> int:
        try:
            return self._apply_staged(mode, manifest, payload)
        except Exception as exc:  # noqa: BLE001 - the payload was read whole: the connection is still good
            raise _Refused() from exc

    def _apply_staged(self, mode: int, manifest: list[dict[str, Any]], payload: torch.Tensor) -> int:
        tensors = self._tensors(manifest, payload)
        if mode == LORA and not self.base_is_folder:
            raise WeightSyncError("a LoRA-delta sync needs the model folder's base weights, and a full sync has "
                                  "replaced them; sync the full weights instead")
        if mode == LORA and not self.model_dir:
            raise WeightSyncError("a LoRA-delta sync needs the server's model folder (the base weights)")
        done = threading.Event()
        result: dict[str, Any] = {}

        def apply() -> int:
            try:
                result["version"] = self._swap(mode, tensors)
                return result["version"]
            except BaseException as exc:
                result["error"] = exc
                raise
            finally:
                done.set()

        self._run_on_engine(apply, done, result)
        if mode == FULL:
            self.base_is_folder = False
        self.num_syncs += 1
        return int(result["version"])

    def _run_on_engine(self, apply: Any, done: threading.Event, result: dict[str, Any]) -> None:
        self.loop.request_update(apply)
        if not done.wait(self.timeout_s):
            raise WeightSyncError(f"the engine did not reach a point between steps within {self.timeout_s:.0f} s")
        if "error" in result:
            raise result["error"]

    # -- full sync, applied per bucket as it arrives --------------------------------------------------------------
    def _apply_streamed(self, pg: Any, manifest: list[dict[str, Any]], num_buckets: int, bucket_bytes: int,
                        total: int) -> int:
        """Receive a full sync into a ring of preallocated buckets and apply each bucket as it arrives: every
        tensor it completes is converted by the family's own load plan (fusing, transposing, dtype) into a
        *shadow* copy of the served parameters (never the served ones), while the next buckets are still on
        the wire. After the last bucket the engine thread swaps the shadow tensors in (a pointer swap per
        parameter, no copy); the old ones become the next sync's shadow. A plan that refuses the manifest
        (names, shapes) still drains the payload, so the trainer hears the reason."""
        _check_sizes(manifest, num_buckets, bucket_bytes, total)
        refused: Exception | None = None
        try:
            plan = _StreamPlan(self.engine, manifest, self._shadow)
        except Exception as exc:  # noqa: BLE001
            refused, plan = exc, None
        ring = self._ring_buffers(min(num_buckets, RING_BUCKETS), bucket_bytes, pg)
        works: dict[int, Any] = {}

        def post(k: int) -> None:
            n = min(bucket_bytes, total - k * bucket_bytes)
            works[k] = pg.irecv(ring[k % len(ring)].narrow(0, 0, n), 1)

        for k in range(min(len(ring), num_buckets)):
            post(k)
        for k in range(num_buckets):
            works.pop(k).wait()  # a broken connection raises here: the served weights were never touched
            data = ring[k % len(ring)].narrow(0, 0, min(bucket_bytes, total - k * bucket_bytes))
            if plan is not None and refused is None:
                try:
                    plan.take(k * bucket_bytes, data)
                except Exception as exc:  # noqa: BLE001 - keep draining the payload, then refuse
                    refused = exc
            if k + len(ring) < num_buckets:
                post(k + len(ring))
        if refused is not None:
            raise _Refused() from refused
        done = threading.Event()
        result: dict[str, Any] = {}

        def apply() -> int:
            try:
                result["version"] = self._swap_in(plan)
                return result["version"]
            except BaseException as exc:
                result["error"] = exc
                raise
            finally:
                done.set()

        try:
            plan.finish()
            self._run_on_engine(apply, done, result)
        except Exception as exc:  # noqa: BLE001
            raise _Refused() from exc
        self.base_is_folder = False
        self.num_syncs += 1
        return int(result["version"])

    def _ring_buffers(self, count: int, bucket_bytes: int, pair: Pair) -> list[torch.Tensor]:
        """``count`` receive buffers of ``bucket_bytes`` on the pair's device, kept between syncs (no fresh pages
        per sync)."""
        if len(self._ring) < count or any(b.numel() < bucket_bytes or b.device != pair.device
                                          for b in self._ring[:count]):
            self._ring = [pair.empty(bucket_bytes) for _ in range(count)]
        return self._ring[:count]

    def _swap_in(self, plan: "_StreamPlan") -> int:
        """On the engine thread, no request in the engine: the shadow tensors become the served ones."""
        for p in plan.params:
            old = p.data
            p.data = self._shadow[id(p)]
            self._shadow[id(p)] = old
            # caches derived from a weight (packed copies, the int8 head) key on its version and address; after
            # two swaps the address is the old one again, so the version must move
            torch.autograd.graph.increment_version(p)
        alloc = self.engine.allocator
        alloc._hash_of.clear()  # cached prefixes hold K/V of the old weights
        alloc._block_of.clear()
        return self.loop.weights_version + 1

    def _swap(self, mode: int, tensors: dict[str, Any]) -> int:
        """On the engine thread, no request in the engine: copy the new weights in (all checked first)."""
        import importlib

        from zerospeed.inference.models.loader import TensorReader

        engine = self.engine
        model = engine.model
        if mode == FULL:
            reader = TensorReader("<weight sync>", engine.dtype, engine.device, state_dict=tensors)
        else:
            reader = _LoraReader(self.model_dir, engine.dtype, engine.device, tensors)
        importlib.import_module(f"zerospeed.inference.models.{engine.spec.family}").load_weights(model, reader)
        reader.finish(model)  # names and shapes checked before any copy: a bad sync changes nothing
        alloc = engine.allocator
        alloc._hash_of.clear()  # cached prefixes hold K/V of the old weights
        alloc._block_of.clear()
        return self.loop.weights_version + 1


def _lora_reader_class() -> type:
    from zerospeed.inference.models.loader import TensorReader

    class LoraReader(TensorReader):
        """The model folder's tensors, with ``scaling * B @ A`` added to the LoRA-targeted weights."""

        def __init__(self, model_dir: str, dtype: torch.dtype, device: Any, deltas: dict[str, Any]) -> None:
            super().__init__(model_dir, dtype, device)
            unknown = [n for n in deltas if n not in self._location]
            if unknown:
                raise WeightSyncError(f"LoRA delta for weights the model does not have: {', '.join(unknown[:5])}")
            self._deltas = deltas

        def _read(self, name: str) -> torch.Tensor:
            t = super()._read(name)
            if name in self._deltas:
                a, b, s = self._deltas[name]
                t = t.float() + s * (b.float() @ a.float())
                t = t.to(self.dtype)
            return t

    return LoraReader


def _LoraReader(model_dir: str, dtype: torch.dtype, device: Any, deltas: dict[str, Any]) -> Any:
    return _lora_reader_class()(model_dir, dtype, device, deltas)
