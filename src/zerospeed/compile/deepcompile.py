"""DeepCompile: ``engine.compile()`` with ``compile.deepcompile: true`` - the ZeRO work moves into the graphs.

Decisions:

* ZeRO-3. The compiled function is ``f(shards, *args) = functional_call(module, gather(shards), args)``:
  one ``zerospeed::gather`` per bucket feeds the parameters, so Dynamo and ``aot_autograd`` see
  full-size parameters without any hook (0 graph breaks) and the backward of each gather is that
  bucket's reduce-scatter. The shard leaves alias the strategy's shards and their ``.grad`` is the
  strategy's gradient shard, so autograd accumulates the reduced range in place. The strategy's
  Python hooks are removed (``Stage3Strategy.hand_over_to_graph``) for as long as the engine lives.
  Passes: ``gather_release`` (gather before the first use, release after the last), ``prefetch``
  (async all-gather started early enough by the profile to hide it, and earlier while at most
  ``stage3_prefetch_bucket_size`` elements of other buckets are gathered ahead of its use; never
  beyond ``stage3_max_live_parameters`` + ``stage3_prefetch_bucket_size`` elements gathered or in
  flight), ``selective_unshard`` (at partition time: the buckets with the highest measured gather
  seconds per byte stay gathered from forward to backward within ``unshard_budget_bytes``, default
  ``stage3_max_reuse_distance`` elements of the model dtype; with gradient accumulation they also
  stay gathered from one micro-step's forward to the next within the window - no all-gather - until
  their shard changes, which the shard's version counter tells), ``reduce_early`` (each reduce-scatter
  right after its last gradient), ``async_reduce`` (the reduce-scatters run asynchronously while the
  backward computes; they are waited for at the end of the backward graph, or earlier when more than
  ``reduce_bucket_size`` elements would be in flight).
* ZeRO-0/1/2. The module itself is compiled; in the backward graph ``insert_reduce_grads`` hands the
  gradients of each bucket to the strategy's reducer in one ``zerospeed::reduce_grads`` right after
  the bucket's last gradient is produced (``reduce_early``); the reducer starts the bucket's reduce
  or reduce-scatter then. Those gradients never reach autograd's accumulation, so the reducer's
  Python hooks do not fire for them (they still serve parameters used outside the graph).
* The schedule is a list of ``(from_step, [pass names])``; a phase that has a successor is a
  profiling phase: its graphs run eagerly under a timing interpreter (per-node seconds, per-bucket
  gather seconds), and the next phase is compiled (a recompile, counted) with that profile.
  Default: ZeRO-3 ``[(0, [gather_release, reduce_early]), (1, [gather_release, prefetch,
  selective_unshard, reduce_early, async_reduce])]``; ZeRO-0/1/2 ``[(0, [insert_reduce_grads,
  reduce_early])]``.
* The graphs' collectives (asynchronous where ``prefetch`` / ``async_reduce`` placed a start and a
  wait) are not seen by the ZeRO-3 watchdog (a hang is bounded by the process group's timeout).
* ``compile.offload_activation: true``: the forward's saved tensors of at least
  ``compile.free_activation_threshold`` bytes wait in host memory until the backward needs them
  (:mod:`zerospeed.compile.activation_offload`), in every phase.
* Not supported with DeepCompile (refused in one line): ``offload_param`` (shards may be on NVMe
  when a graph reads them), a callable backend (DeepCompile compiles with Inductor or runs eagerly).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import torch

from zerospeed import comm

from . import ops
from .activation_offload import ActivationStore, offload_activations
from .backend import backend_fn
from .zero_passes import Candidate, Profile, choose_unsharded, tag_recompute

PARTITION_PASSES = ("selective_unshard",)


def default_schedule(stage: int, compiler: str = "eager") -> list[tuple[int, list[str]]]:
    if stage == 3:
        return [(0, ["gather_release", "reduce_early"]),
                (1, ["gather_release", "prefetch", "selective_unshard", "reduce_early", "async_reduce"])]
    return [(0, ["insert_reduce_grads", "reduce_early"])]


def compiler_for(backend: Any) -> str:
    if backend == "inductor":
        return "inductor"
    if backend in ("eager", "aot_eager"):
        return "eager"
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)
    raise ValueError(f"engine.compile: backend {name!r} is not supported with compile.deepcompile "
                     "(DeepCompile hands its graphs to 'inductor' or runs them eagerly: 'eager' / 'aot_eager')")


class _Started:
    """One asynchronous collective over one or more buckets; ``take(bucket)`` gives a bucket's part."""

    def __init__(self, work: Any, take: Callable[[int], torch.Tensor], members: int, keep: Any = None) -> None:
        self.work, self.take, self.left = work, take, members
        self.keep = keep  # buffers the collective uses until it completes

    def result(self, bucket: int) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        self.left -= 1
        out = self.take(bucket)
        if self.left == 0:
            self.take = self.keep = None  # type: ignore[assignment]  (drops the collective's buffers)
        return out


class _Stage3Owner:
    """What the ops ask of one ZeRO-3 engine's buckets.

    Several buckets started together (``gather_start`` / ``reduce_start`` with more than one bucket)
    share one collective per (process group, dtype) over a buffer laid out as ``(world, sum of shard
    sizes)`` (row r: rank r's part of each bucket, in order), which every backend's all-gather /
    reduce-scatter handles; each bucket's gathered parameters are then copied out of it
    (contiguous, fresh: a custom op may not return an alias) and each reduced shard is a slice."""

    def __init__(self, strategy: Any, prescale: float, comm_dtype: torch.dtype | None) -> None:
        self.buckets = {b.index: b for b in strategy.buckets}
        self.prescale, self.comm_dtype = prescale, comm_dtype
        self.pending: dict[int, _Started] = {}  # started all-gathers
        self.reducing: dict[int, _Started] = {}  # started reduce-scatters
        self.counts = {"gather": 0, "prefetched": 0, "reduce_bucket": 0, "gather_collectives": 0,
                       "reduce_collectives": 0, "resident": 0}  # what the graphs ran
        # selective unsharding across micro-steps: gathered buckets kept until their shard changes
        self.resident_buckets: set[int] = set()  # which buckets may stay (the kept ones)
        self.store_resident = False  # whether this forward's gathers are kept (not the window's last)
        self.resident: dict[int, tuple[Any, torch.Tensor]] = {}  # bucket -> (shard's identity, full buffer)

    def full_numel(self, bucket: int) -> int:
        return self.buckets[bucket].padded_numel

    def shard_numel_dtype(self, bucket: int) -> tuple[int, torch.dtype]:
        b = self.buckets[bucket]
        return b.layout.shard_numel, b.dtype

    def _together(self, buckets: Sequence[int], dtype_of: Callable[[Any], torch.dtype]) -> list[list[int]]:
        """``buckets`` split by (process group, dtype), order kept: one collective each."""
        groups: dict[tuple[int, torch.dtype], list[int]] = {}
        for i in buckets:
            b = self.buckets[i]
            groups.setdefault((id(b.group), dtype_of(b)), []).append(i)
        return list(groups.values())

    # -- all-gathers ------------------------------------------------------------------------------
    def _resident(self, bucket: int) -> torch.Tensor | None:
        held = self.resident.get(bucket)
        if held is None:
            return None
        if held[0] != self._shard_identity(bucket):  # the shard changed (a step, a load): re-gather
            del self.resident[bucket]
            return None
        return held[1]

    def _shard_identity(self, bucket: int) -> tuple[int, int, int]:
        """Changes whenever the shard does: another tensor, or any in-place write (version counter)."""
        shard = self.buckets[bucket].shard
        return id(shard), shard.data_ptr(), shard._version

    def begin_forward(self, store: bool) -> None:
        """Before each forward: whether its gathers of resident buckets are kept for the next ones."""
        self.store_resident = store
        for i in list(self.resident):
            self._resident(i)  # drops the stale ones now (memory)
        # collectives a failed forward / backward left behind (every rank issued them): completed, dropped
        for started in {id(s): s for s in [*self.pending.values(), *self.reducing.values()]}.values():
            if started.work is not None:
                started.work.wait()
        self.pending.clear()
        self.reducing.clear()

    def gather_start(self, shards: Sequence[torch.Tensor], buckets: Sequence[int]) -> None:
        keep = [k for k, i in enumerate(buckets) if self._resident(i) is None]
        if not keep:
            return
        shards, buckets = [shards[k] for k in keep], [buckets[k] for k in keep]
        by_index = dict(zip(buckets, shards))
        for members in self._together(buckets, lambda b: b.dtype):
            for i in members:
                if i in self.pending:
                    raise RuntimeError(f"DeepCompile: the all-gather of bucket {i} was started twice")
            started = self._gather_async([by_index[i] for i in members], members)
            for i in members:
                self.pending[i] = started

    def _gather_async(self, shards: list[torch.Tensor], members: list[int]) -> _Started:
        self.counts["gather_collectives"] += 1
        first = self.buckets[members[0]]
        if len(members) == 1:
            full = torch.empty(first.padded_numel, dtype=shards[0].dtype, device=shards[0].device)
            return _Started(comm.all_gather(full, shards[0].detach(), group=first.group, async_op=True),
                            lambda i: full, 1, keep=shards[0])
        sizes = [self.buckets[i].layout.shard_numel for i in members]
        offsets = dict(zip(members, itertools.accumulate([0] + sizes)))
        total = sum(sizes)
        world = first.padded_numel // first.layout.shard_numel
        out = torch.empty(world * total, dtype=shards[0].dtype, device=shards[0].device)
        sent = torch.cat([s.detach().reshape(-1) for s in shards])
        work = comm.all_gather(out, sent, group=first.group, async_op=True)
        rows = out.view(world, total)

        def take(i: int) -> torch.Tensor:
            n = self.buckets[i].layout.shard_numel
            return rows.narrow(1, offsets[i], n).reshape(-1)  # a copy: contiguous, this bucket only

        return _Started(work, take, len(members), keep=sent)

    def gather(self, shard: torch.Tensor, bucket: int) -> torch.Tensor:
        self.counts["gather"] += 1
        held = self._resident(bucket)
        if held is not None:  # gathered by an earlier micro-step of this accumulation window
            self.counts["resident"] += 1
            if not self.store_resident:  # the window's last forward: its last use
                del self.resident[bucket]
                return held
            return held.clone()  # (a graph may reuse the buffers it is given: never hand it the kept one)
        started = self.pending.pop(bucket, None)
        self.counts["prefetched"] += started is not None
        if started is None:
            started = self._gather_async([shard], [bucket])
        full = started.result(bucket)
        if self.store_resident and bucket in self.resident_buckets:
            self.resident[bucket] = (self._shard_identity(bucket), full.clone())
        return full

    # -- reduce-scatters --------------------------------------------------------------------------
    def reduce_bucket(self, grads: Sequence[torch.Tensor], bucket: int) -> torch.Tensor:
        self.reduce_start(grads, [bucket])
        return self.reduce_wait(bucket)

    def _flat_grad(self, b: Any, grads: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The bucket's gradient as one flat buffer of ``padded_numel`` (``grads``: the flat gradient,
        or one per slot) that the collective may overwrite."""
        if len(grads) == 1 and grads[0].numel() == b.padded_numel:
            return grads[0].detach().reshape(-1).to(dtype, copy=True)
        dense = len(grads) == len(b.layout.slots) and sum(s.numel for s in b.layout.slots) == b.layout.numel
        full = (torch.empty if dense else torch.zeros)(b.padded_numel, dtype=dtype, device=b.device)
        for s, g in zip(b.layout.slots, grads):
            full.narrow(0, s.offset, s.numel).copy_(g.reshape(-1))
        full.narrow(0, b.layout.numel, b.padded_numel - b.layout.numel).zero_()
        return full

    def reduce_start(self, grads: Sequence[torch.Tensor], buckets: Sequence[int]) -> None:
        """Launch the buckets' reduce-scatters (asynchronously); :meth:`reduce_wait` completes each.
        ``grads``: one flat gradient per bucket (or, for a single bucket, one per slot)."""
        for i in buckets:
            if i in self.reducing:
                raise RuntimeError(f"DeepCompile: the reduce-scatter of bucket {i} was started twice without a wait")
        if len(buckets) > 1 and len(grads) != len(buckets):
            raise RuntimeError(f"DeepCompile: reduce_start of {len(buckets)} buckets got {len(grads)} gradients "
                               "(one flat gradient per bucket)")
        by_index = {buckets[0]: list(grads)} if len(buckets) == 1 else {i: [g] for i, g in zip(buckets, grads)}
        self.counts["reduce_bucket"] += len(buckets)
        for members in self._together(buckets, lambda b: self.comm_dtype or b.dtype):
            started = self._reduce_async(members, by_index)
            for i in members:
                self.reducing[i] = started

    def _reduce_async(self, members: list[int], grads: dict[int, list[torch.Tensor]]) -> _Started:
        self.counts["reduce_collectives"] += 1
        first = self.buckets[members[0]]
        dtype = self.comm_dtype or first.dtype
        sizes = [self.buckets[i].layout.shard_numel for i in members]
        offsets = dict(zip(members, itertools.accumulate([0] + sizes)))
        total = sum(sizes)
        world = first.padded_numel // first.layout.shard_numel
        if len(members) == 1:
            sent = self._flat_grad(first, grads[members[0]], dtype)
        else:
            sent = torch.empty(world * total, dtype=dtype, device=first.device)
            rows = sent.view(world, total)
            for i in members:
                b = self.buckets[i]
                n = b.layout.shard_numel
                flat = grads[i][0].detach().reshape(world, n) if grads[i][0].numel() == b.padded_numel else \
                    self._flat_grad(b, grads[i], dtype).view(world, n)
                rows.narrow(1, offsets[i], n).copy_(flat)
        if self.prescale != 1.0:
            sent.mul_(self.prescale)
        received = torch.empty(total, dtype=dtype, device=first.device)
        work = comm.reduce_scatter(received, sent, group=first.group, async_op=True)

        def take(i: int) -> torch.Tensor:
            b = self.buckets[i]
            return received.narrow(0, offsets[i], b.layout.shard_numel).to(b.dtype)

        return _Started(work, take, len(members), keep=sent)

    def reduce_wait(self, bucket: int) -> torch.Tensor:
        started = self.reducing.pop(bucket, None)
        if started is None:
            raise RuntimeError(f"DeepCompile: no reduce-scatter of bucket {bucket} was started")
        return started.result(bucket)


class _DataParallelOwner:
    """What ``reduce_grads`` asks of a ZeRO-0/1/2 engine: the reducer, by parameter index."""

    def __init__(self, strategy: Any) -> None:
        self.reducer = strategy.reducer
        self.params = [p for b in strategy.buckets for p in b.params]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.bucket_of = {id(p): bi for bi, b in enumerate(strategy.buckets) for p in b.params}
        self.counts = {"reduce_grads": 0, "grads_in_graph": 0}  # what the graphs ran

    def reduce_grads(self, grads: Sequence[torch.Tensor], params: Sequence[int]) -> None:
        self.counts["reduce_grads"] += 1
        self.counts["grads_in_graph"] += len(params)
        for g, i in zip(grads, params):
            self.reducer.accept_grad(self.params[i], g)


class DeepCompile:
    """One engine's DeepCompile: the compiled callable the engine's forward calls, its phases and profile."""

    def __init__(self, engine: Any, backend: Any, compile_kwargs: dict[str, Any], schedule: Any,
                 resolve: Callable[[Sequence[str]], list[Any]], passes: Sequence[str] | None = None) -> None:
        self.engine = engine
        self.compiler = compiler_for(backend)
        self.compile_kwargs = compile_kwargs
        strategy = engine.strategy
        self.stage = engine.zero_stage
        zcfg = engine.config.zero_optimization
        if self.stage == 3 and getattr(strategy, "swapper", None) is not None:
            raise ValueError("engine.compile: compile.deepcompile does not support zero_optimization.offload_param "
                             "(a graph reads the shards directly); disable one of them")
        self.schedule = [(int(s), list(names)) for s, names in (schedule or default_schedule(self.stage, self.compiler))]
        if passes:
            self.schedule[-1] = (self.schedule[-1][0], list(passes))
        self.resolve = resolve
        for _, names in self.schedule:
            resolve(names)  # unknown names: the error lists the known passes
        self.profiles = {"forward": Profile("forward"), "backward": Profile("backward")}
        for p in self.profiles.values():
            p.data["compiler"] = self.compiler
        if self.stage == 3:
            prescale = strategy.options.prescale
            self.owner: Any = _Stage3Owner(strategy, prescale, strategy.options.comm_dtype)
            elem = strategy.buckets[0].shard.element_size() if strategy.buckets else 2
            limit = (int(zcfg.stage3_max_live_parameters) + int(zcfg.stage3_prefetch_bucket_size)) * elem
            self.unshard_budget_bytes = int(zcfg.stage3_max_reuse_distance) * elem
            for p in self.profiles.values():
                p.bucket_bytes = {b.index: b.full_bytes for b in strategy.buckets}
                p.memory_limit_bytes = limit
                p.reduce_limit_bytes = int(zcfg.reduce_bucket_size) * elem
                p.prefetch_window_bytes = int(zcfg.stage3_prefetch_bucket_size) * elem
            self.profiles["forward"].coalesce_bytes = int(zcfg.stage3_prefetch_bucket_size) * elem
            self.profiles["backward"].coalesce_bytes = int(zcfg.reduce_bucket_size) * elem
            self._names = self._slot_names(engine.module, strategy.buckets)
            strategy.hand_over_to_graph()
        else:
            self.owner = _DataParallelOwner(strategy)
        self.key = ops.register_owner(self.owner)
        for p in self.profiles.values():
            p.owner_key = self.key
        self.phase: int | None = None
        self.fn: Callable[..., Any] | None = None
        self.kept: list[int] = []
        ccfg = engine.config.compile
        self.activations: ActivationStore | None = None
        if ccfg.offload_activation:
            self.activations = ActivationStore()
            self._activations_key = ops.register_owner(self.activations)
            self._offload_threshold = int(ccfg.free_activation_threshold)

    # -- the callable the engine's forward uses ---------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        phase = self._phase_at(self.engine.global_steps)
        if phase != self.phase:
            self._build(phase)
        assert self.fn is not None
        if self.stage == 3:
            engine = self.engine
            window = engine.gradient_accumulation_steps() > 1 and not engine.is_gradient_accumulation_boundary()
            self.owner.begin_forward(store=window and torch.is_grad_enabled())
            return self.fn(self._leaves(), args, kwargs)
        return self.fn(*args, **kwargs)

    def _phase_at(self, step: int) -> int:
        current = 0
        for i, (start, _) in enumerate(self.schedule):
            if step >= start:
                current = i
        return current

    def _build(self, phase: int) -> None:
        names = self.schedule[phase][1]
        profiling = phase + 1 < len(self.schedule)
        graph_passes = [fn for n, fn in zip(names, self.resolve(names)) if n not in PARTITION_PASSES]
        joint = []
        if self.stage == 3:
            self._gather_seconds()
            self.kept = self._choose_kept() if "selective_unshard" in names else []
            kept = list(self.kept)
            self.owner.resident_buckets = set(kept)
            self.owner.resident.clear()
            joint.append(lambda gm: tag_recompute(gm, kept))
            graph_passes.insert(0, _record_gathers)
        partition = []
        if self.activations is not None:
            store, key, threshold = self.activations, self._activations_key, self._offload_threshold
            partition.append(lambda fw, bw: offload_activations(fw, bw, store, key, threshold))
        be = backend_fn(graph_passes, compiler="profile" if profiling else self.compiler,
                        profile_for=self.profiles.__getitem__, joint_passes=joint, on_profiled=self._on_profiled,
                        partition_passes=partition)
        if self.stage == 3:
            self.fn = torch.compile(_zero3_forward(self.engine.module, self._names, self.key), backend=be,
                                    **self.compile_kwargs)
        else:
            self.fn = torch.compile(self.engine.module, backend=self._with_param_outputs(be), **self.compile_kwargs)
        self.phase = phase

    def _on_profiled(self, phase: str) -> None:
        """After the backward of the profiling phase's last step: agree on the profile (ZeRO-3)."""
        assert self.phase is not None
        following = self.schedule[self.phase + 1][0]
        if self.stage == 3 and phase == "backward" and self.engine.global_steps + 1 >= following:
            self._agree_on_profile()

    def _agree_on_profile(self) -> None:
        """Every rank must build the same graphs (same collectives in the same order): the per-node
        seconds become the maximum over the data-parallel group (one all-reduce, in the profiling step)."""
        keys = [(phase, name) for phase in ("forward", "backward")
                for name in sorted(self.profiles[phase].node_seconds)]
        values = torch.tensor([self.profiles[ph].node_seconds[n] for ph, n in keys] + [float(len(keys))],
                              dtype=torch.float64)
        comm.all_reduce(values, op=comm.ReduceOp.MAX, group=self.engine.dp_group)
        if int(values[-1].item()) != len(keys):
            raise RuntimeError("DeepCompile: ranks profiled different graphs (node counts differ); every rank "
                               "must run the same model code")
        for (phase, name), v in zip(keys, values[:-1].tolist()):
            self.profiles[phase].node_seconds[name] = v

    def _choose_kept(self) -> list[int]:
        seconds = self._gather_seconds()
        # without a profile: a latency plus bytes over a nominal bandwidth (small buckets cost most per byte)
        cands = [Candidate(b, nbytes, seconds.get(b, 1e-4 + nbytes / 1e9))
                 for b, nbytes in self.profiles["forward"].bucket_bytes.items()]
        return choose_unsharded(cands, self.unshard_budget_bytes)

    def _gather_seconds(self) -> dict[int, float]:
        """Per bucket: the profiled all-gather seconds (the backward's re-gather nodes, else the forward's)."""
        out: dict[int, float] = {}
        for phase in ("forward", "backward"):
            prof = self.profiles[phase]
            for name, b in prof.data.get("gather_nodes", {}).items():
                if name in prof.node_seconds:
                    out[b] = prof.node_seconds[name]
        for prof in self.profiles.values():
            prof.gather_seconds = dict(out)
        return out

    def _with_param_outputs(self, be: Callable[..., Any]) -> Callable[..., Any]:
        """ZeRO-0/1/2: tell insert_reduce_grads which backward outputs are which parameters' gradients."""
        owner = self.owner

        def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            mapping = {i: (owner.bucket_of[id(t)], owner.index[id(t)]) for i, t in enumerate(example_inputs)
                       if id(t) in owner.index}
            self.profiles["backward"].data["param_of_output"] = mapping
            self.profiles["backward"].data["num_inputs"] = len(example_inputs)
            return be(gm, example_inputs)

        return backend

    # -- ZeRO-3 helpers ---------------------------------------------------------------------------
    @staticmethod
    def _slot_names(module: torch.nn.Module, buckets: Sequence[Any]) -> list[tuple[int, list[int], list[Any]]]:
        """Per bucket: its index, the sizes splitting its flat buffer into slots (and gaps / padding),
        and per slot ``(piece index, shape, parameter names)``."""
        names: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        out = []
        for b in buckets:
            per_slot: list[list[str]] = [[] for _ in b.layout.slots]
            for pos, p in b.live_params():
                per_slot[pos] = names.get(id(p), [])
            sizes: list[int] = []
            pieces = []
            end = 0
            for slot, slot_names in sorted(zip(b.layout.slots, per_slot), key=lambda e: e[0].offset):
                if slot.offset > end:
                    sizes.append(slot.offset - end)
                pieces.append((len(sizes), tuple(slot.shape), slot_names))
                sizes.append(slot.numel)
                end = slot.offset + slot.numel
            if b.padded_numel > end:
                sizes.append(b.padded_numel - end)
            out.append((b.index, sizes, pieces))
        return out

    def _leaves(self) -> list[torch.Tensor]:
        leaves = []
        for b in self.engine.strategy.buckets:
            leaf = b.shard.detach()
            if b.trainable and b.num_grad_params:
                leaf.requires_grad_(True)
                leaf.grad = b.grad_shard
            leaves.append(leaf)
        return leaves


def _record_gathers(gm: torch.fx.GraphModule, profile: Profile) -> torch.fx.GraphModule:
    """Remember which node gathers which bucket (the profiling step times them)."""
    profile.data["gather_nodes"] = {n.name: int(n.args[2]) for n in gm.graph.nodes if n.target is ops.GATHER}
    return gm


def _zero3_forward(module: torch.nn.Module, names: list[tuple[int, list[int], list[Any]]],
                   key: int) -> Callable[..., Any]:
    from torch.func import functional_call

    def zero3_forward(shards: list[torch.Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        values: dict[str, torch.Tensor] = {}
        for (bucket, sizes, pieces), shard in zip(names, shards):
            full = ops.gather(shard, key, bucket)
            split = torch.split(full, sizes)  # views in the graph: the op returns one fresh buffer
            for piece, shape, slot_names in pieces:
                param = split[piece].view(shape)
                for name in slot_names:
                    values[name] = param
        return functional_call(module, values, args, kwargs)

    return zero3_forward
