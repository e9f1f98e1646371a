"""When ZeRO-3 parameters are gathered and released: module hooks and the bucket lifecycle.

:class:`BucketGatherer` starts, waits for and releases bucket all-gathers (through the watchdog,
with accounting of live gathered elements); ``GatheredParameters`` pins buckets through it.
:class:`Stage3Runtime` adds the hooks on a model:

* forward pre-hook of a module with a plan (its own buckets plus external / tied ones): report the
  event to the trace, gather what is missing (one all-gather per bucket, started together, then
  the prefetches, then the waits), count the module as a user of each bucket;
* forward post-hook: drop the use; release each bucket unless still used, persistent, or kept for
  a reuse within ``stage3_max_reuse_distance``; when gradients are on, hook the module's outputs
  (``register_multi_grad_hook``): the hook fires before the module's backward and gathers again;
* in backward a bucket with trainable parameters is released when the gradient reducer reports
  that all of its parameters' gradients were accumulated (after the last use, also for modules
  called twice and tied weights); a bucket without gradients (frozen) is released after the
  module's backward, detected by gradient hooks on the module's inputs (they fire when the input's
  gradient is complete, i.e. after every consumer of that input, this module included, ran its
  backward). Hooks, not an identity autograd function: a node inserted on the inputs would change the
  order in which autograd sums an input's gradient contributions (an activation read by q, k, v and a
  LoRA branch gets its sum in another order), so a frozen-base LoRA model's gradients would differ
  from the unsharded model's in the last bits; with hooks the graph, and every gradient, is the plain
  model's bit for bit;
* whatever is left is released at the end of backward; an evaluation forward (no gradients)
  releases everything when the root's forward returns.

Modules called more than once per forward count their uses; tied parameters (one Parameter
registered in two modules) and registered external parameters are in the plans of every module
that uses them. A pass starts at the root's forward pre-hook.

Parameter offload: the buckets a fetch is about to gather (those the module needs, then the
prefetched ones) first have their swapped-out shards read ahead, all reads in flight together
(:meth:`BucketGatherer.read_ahead`); each bucket's ``start_gather`` waits for its own read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from zerospeed.zero.stage3 import registry
from zerospeed.zero.stage3.bucket import BucketState, Stage3Bucket, gather_together
from zerospeed.zero.stage3.prefetch import GatherTrace, TraceEvent, plan_prefetch
from zerospeed.zero.stage3.watchdog import Watchdog, ZeroCollectiveDivergence


@dataclass
class ModulePlan:
    """What one module's forward needs gathered."""

    module: nn.Module
    name: str
    buckets: list[Stage3Bucket] = field(default_factory=list)
    fixed: list[Stage3Bucket] = field(default_factory=list)  # own and tied: never removed

    def add(self, bucket: Stage3Bucket, fixed: bool = False) -> None:
        if all(b is not bucket for b in self.buckets):
            self.buckets.append(bucket)
        if fixed and all(b is not bucket for b in self.fixed):
            self.fixed.append(bucket)

    @property
    def has_gradless_buckets(self) -> bool:
        return any(not b.num_grad_params for b in self.buckets)


@dataclass(frozen=True)
class Stage3Knobs:
    prefetch_numel: int
    max_live_numel: int
    max_reuse_distance: int


def _functorch_transforming() -> bool:
    """True under a torch.func transform (its backward runs inside the transform's interpreter)."""
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Tensors inside nested tuples / lists / dicts / dataclasses (module outputs)."""
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in tensors_in(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in tensors_in(x)]
    if hasattr(obj, "__dataclass_fields__"):
        return [t for name in obj.__dataclass_fields__ for t in tensors_in(getattr(obj, name, None))]
    return []


class BucketGatherer:
    """Gather / release buckets through the watchdog, counting live gathered elements."""

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog
        self.live_numel = 0  # elements of non-persistent buckets gathered or in flight
        self.live_bytes = 0
        self.live_peak_numel = 0
        self.live_peak_bytes = 0

    @staticmethod
    def read_ahead(buckets: Iterable[Stage3Bucket]) -> None:
        """Start reading the swapped-out shards (``offload_param``) of the released ``buckets``."""
        for b in buckets:
            if b.swapper is not None and b.state is BucketState.RELEASED:
                b.swapper.prefetch([b])

    def start(self, b: Stage3Bucket, why: str) -> None:
        self.watchdog.note_collective("all_gather", f"{b.name} [{why}]")
        b.start_gather()
        if not b.persistent:
            self.live_numel += b.padded_numel
            self.live_bytes += b.full_bytes
            self.live_peak_numel = max(self.live_peak_numel, self.live_numel)
            self.live_peak_bytes = max(self.live_peak_bytes, self.live_bytes)

    def finish(self, b: Stage3Bucket, attach: bool = True) -> None:
        if b.state is BucketState.INFLIGHT:
            self.watchdog.wait(b.work, "all_gather", b.name)
            b.finish_gather(attach=attach)

    def release(self, b: Stage3Bucket) -> None:
        if b.state is BucketState.RELEASED:
            return
        self.finish(b, attach=False)
        b.release()
        if not b.persistent:
            self.live_numel -= b.padded_numel
            self.live_bytes -= b.full_bytes

    def maybe_release(self, b: Stage3Bucket, keep_ok: bool = False) -> None:
        if not b.persistent and not b.in_use() and b.state is BucketState.GATHERED and not b.prefetched:
            self.release(b)

    def pin(self, buckets: list[Stage3Bucket], why: str) -> None:
        """Gather ``buckets`` (one all-gather each, all in flight together) and hold them."""
        self.read_ahead(buckets)
        for b in buckets:
            if b.state is BucketState.RELEASED:
                self.start(b, why)
        for b in buckets:
            self.finish(b)
            b.pins += 1

    def unpin(self, buckets: list[Stage3Bucket]) -> None:
        for b in buckets:
            b.pins = max(0, b.pins - 1)
            self.maybe_release(b)


class Stage3Runtime(BucketGatherer):
    def __init__(self, root: nn.Module, plans: dict[int, ModulePlan], buckets: list[Stage3Bucket],
                 knobs: Stage3Knobs, watchdog: Watchdog) -> None:
        super().__init__(watchdog)
        self.root = root
        self.plans = plans
        self.buckets = buckets
        self.knobs = knobs
        self.trace = GatherTrace()
        self.in_backward = False
        self.in_root_forward = False  # between the root's forward pre-hook and its forward hook
        self.stray_backward = False
        self._transform_pass = False  # a torch.func transform's backward is running (see _transform_backward)
        self._grads_done: set[int] = set()
        self._handles: dict[int, list[Any]] = {}
        self.on_begin_pass: Callable[[], None] | None = None  # the strategy's hook at each root forward
        #: parameters zero.GatheredParameters holds from outside the forward (grad on); those still held when a root
        #: forward starts may be read by it, so a failing backward names them (Stage3Strategy.explain_backward_error)
        self.user_held: dict[int, nn.Parameter] = {}
        self.held_in_forward: list[nn.Parameter] = []
        for b in buckets:
            b.owner = self
        for plan in plans.values():
            if plan.buckets:
                self._install(plan.module)
        self._install(root)
        registry.listen(self)

    # -- hook installation ------------------------------------------------------------------------
    def _install(self, module: nn.Module) -> None:
        if id(module) in self._handles:
            return
        # torch.compiler.disable: under engine.compile() the gather/release bookkeeping runs eagerly,
        # outside the graph (one graph break per hook) instead of being traced and guarded on
        self._handles[id(module)] = [
            module.register_forward_pre_hook(torch.compiler.disable(self._pre_forward), with_kwargs=True),
            module.register_forward_hook(torch.compiler.disable(self._post_forward), with_kwargs=True),
        ]

    def remove_hooks(self) -> None:
        for hs in self._handles.values():
            for h in hs:
                h.remove()
        self._handles.clear()

    def install_hooks(self) -> None:
        """Install the module hooks again after :meth:`remove_hooks` (TRL removes them around generation)."""
        for plan in list(self.plans.values()):
            if plan.buckets:
                self._install(plan.module)
        self._install(self.root)

    @property
    def hooks_installed(self) -> bool:
        return bool(self._handles)

    def on_external_parameter(self, module: nn.Module, param: nn.Parameter) -> None:
        found = registry.lookup(param)
        if found is None or getattr(found[0], "owner", None) is not self:
            return
        names = {id(m): n for n, m in self.root.named_modules()}
        if id(module) not in names:
            return
        module = registry.leaf_units(self.root).get(id(module), module)  # inside a z3 leaf: the leaf gathers it
        plan = self.plans.setdefault(id(module), ModulePlan(module, names[id(module)] or "<root>"))
        plan.add(found[0])
        self._install(module)

    def on_external_parameter_removed(self, module: nn.Module, param: nn.Parameter) -> None:
        plan = self.plans.get(id(module))
        if plan is None:
            return
        needed = list(plan.fixed) + [found[0] for p in registry.externals_of(module)
                                     if (found := registry.lookup(p)) is not None]
        plan.buckets = [b for b in plan.buckets if any(b is n for n in needed)]

    def adopt_forward_use(self, param: nn.Parameter) -> None:
        """``param`` was gathered by ``zero.GatheredParameters`` inside the root's forward, with grad on, and is
        not gathered by the forward of a module that owns it (TRL's fused LM head reads ``lm_head.weight`` in the
        model's forward without calling ``lm_head``): register it as an external parameter of the root, as
        DeepSpeed's ``GatheredParameters(fwd_module=...)`` would, so the root's backward gathers it again before
        its gradient arrives (a full-size gradient cannot accumulate into a partitioned placeholder) and later
        forwards gather it with the root."""
        if not param.requires_grad or self.in_backward:
            return
        if self.in_root_forward:
            if torch.is_grad_enabled():
                registry.add_external(self.root, param)
        else:
            self.user_held[id(param)] = param

    # -- forward ----------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if module is self.root:
            self._begin_pass()
            self.in_root_forward = True
            held = [p for p in self.user_held.values() if (found := registry.lookup(p)) is not None and found[0].pins]
            self.user_held = {id(p): p for p in held}
            self.held_in_forward = held if torch.is_grad_enabled() else []
        plan = self.plans.get(id(module))
        if plan is None or not plan.buckets:
            return None
        self._fetch(plan, "forward")
        for b in plan.buckets:
            b.fwd_refs += 1
        if self.in_backward and torch.is_grad_enabled():
            self._mark_backward_use(plan)  # a forward re-run inside backward (activation checkpointing)
        if torch.is_grad_enabled() and plan.has_gradless_buckets:
            self._hook_inputs(plan, args, kwargs)
        return None

    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if _functorch_transforming():  # releasing resizes buffers: outside the transform, as the gather
            with torch._C._DisableFuncTorch():
                return self._post_forward_now(module, output)
        return self._post_forward_now(module, output)

    def _post_forward_now(self, module: nn.Module, output: Any) -> None:
        plan = self.plans.get(id(module))
        grad_on = torch.is_grad_enabled()
        if plan is not None and plan.buckets:
            for b in plan.buckets:
                b.fwd_refs = max(0, b.fwd_refs - 1)
            outs = [t for t in tensors_in(output) if t.requires_grad] if grad_on else []
            # an output that is a view (nn.Linear on 3-D input) and is then modified in place
            # (ReLU(inplace=True)) leaves its own grad node out of the graph; its base's node stays
            outs += [t._base for t in outs if t._base is not None and t._base.requires_grad]
            if outs:
                register_multi_grad_hook(outs, lambda _grad, plan=plan: self._pre_backward(plan), mode="any")
            for b in plan.buckets:
                self.maybe_release(b, keep_ok=True)
        if module is self.root:
            self.in_root_forward = False
        if module is self.root and not (grad_on and any(t.requires_grad for t in tensors_in(output))):
            self.release_all()  # no backward follows this forward
        return None

    def _hook_inputs(self, plan: ModulePlan, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Call ``_post_backward(plan)`` once the gradients of the module's inputs are complete (hooks only: the
        autograd graph stays the model's own, see the module docstring)."""
        picked = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
        if picked:
            register_multi_grad_hook(picked, lambda _grads, plan=plan: self._post_backward(plan), mode="all")

    # -- backward ---------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        self.in_backward = True
        self._grads_done.clear()

    def _pre_backward(self, plan: ModulePlan) -> None:
        if not self.in_backward and _functorch_transforming():
            self._transform_backward(plan)
            return
        if not self.in_backward:
            self.stray_backward = True
        self._fetch(plan, "backward")
        self._mark_backward_use(plan)

    def _transform_backward(self, plan: ModulePlan) -> None:
        """A torch.func transform (``grad``, ``vjp``, ``jacrev``, ``vmap(grad(...))``) differentiates a function of the
        engine: not a training step (no gradient reaches the parameters' ``.grad``, none is reduced), as in DeepSpeed.
        The module's parameters are gathered for its backward and released when that autograd pass ends."""
        if not self._transform_pass:
            self._transform_pass = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_transform_backward)
        self._fetch(plan, "backward")
        for b in plan.buckets:
            b.bwd_calls += 1

    def _end_transform_backward(self) -> None:
        self._transform_pass = False
        for b in self.buckets:
            b.bwd_calls = 0
            self.maybe_release(b)

    def _mark_backward_use(self, plan: ModulePlan) -> None:
        """Keep the plan's buckets until their gradients are in (or the module's backward is done)."""
        for b in plan.buckets:
            if b.num_grad_params and b.index not in self._grads_done:
                b.bwd_active = True
            else:
                b.bwd_calls += 1

    def _post_backward(self, plan: ModulePlan) -> None:
        for b in plan.buckets:
            if b.bwd_calls:
                b.bwd_calls -= 1
                self.maybe_release(b)

    def on_grads_done(self, b: Stage3Bucket) -> None:
        """The reducer has every gradient of ``b`` for this backward: its backward use is over."""
        self._grads_done.add(b.index)
        b.bwd_active = False
        self.maybe_release(b)

    def end_backward(self) -> None:
        for b in self.buckets:
            b.bwd_active = False
            b.bwd_calls = 0
        self.in_backward = False
        self.in_root_forward = False  # a forward that raised never ran the root's forward hook
        self.release_all()
        if self.trace.finish_backward([b.padded_numel for b in self.buckets]):
            self._check_trace_agrees()
        self.watchdog.verify = False

    # -- the gather path --------------------------------------------------------------------------
    def _begin_pass(self) -> None:
        if self.on_begin_pass is not None:
            self.on_begin_pass()
        self.trace.begin_pass()
        self.watchdog.begin_pass()
        self.watchdog.verify = not self.trace.complete  # no recorded order yet: check collectives one by one
        for b in self.buckets:  # a forward that raised never ran its post-hooks
            b.fwd_refs = 0

    def _fetch(self, plan: ModulePlan, phase: str) -> None:
        if _functorch_transforming():  # the gather writes buffers torch.func must not see as captured mutations
            with torch._C._DisableFuncTorch():
                return self._fetch_now(plan, phase)
        return self._fetch_now(plan, phase)

    def _fetch_now(self, plan: ModulePlan, phase: str) -> None:
        event = TraceEvent(id(plan), phase, plan.name, tuple(b.index for b in plan.buckets))
        expected = self.trace.expected()
        if self.trace.observe(event) == "mismatch":
            want = f"'{expected.module}' ({expected.phase})" if expected else "the end of the pass"
            self.watchdog.confirm_deviation(self.watchdog.num_events + 1, phase, want, plan.name)
            self.trace.invalidate()
        self.watchdog.note_event(phase, plan.name)
        need = [b for b in plan.buckets if b.state is not BucketState.GATHERED]
        fresh = [b for b in need if b.state is BucketState.RELEASED]
        if fresh:
            self._make_room(sum(b.padded_numel for b in fresh), plan.buckets)
        self.read_ahead(fresh)
        for b in fresh:
            self.start(b, f"{phase} of {plan.name}")
        if self.trace.following:
            ahead = plan_prefetch(self.trace.upcoming(), self.buckets, self.knobs.prefetch_numel, self.live_numel,
                                  self.knobs.max_live_numel, allow_backward=torch.is_grad_enabled())
            self.read_ahead(ahead)
            for b in ahead:
                self.start(b, "prefetch")
                b.prefetched = True
        for b in need:
            self.finish(b)
        for b in plan.buckets:
            b.prefetched = False

    def maybe_release(self, b: Stage3Bucket, keep_ok: bool = False) -> None:
        if b.persistent or b.in_use() or b.state is not BucketState.GATHERED or b.prefetched:
            return
        if keep_ok and self.live_numel <= self.knobs.max_live_numel:
            distance = self.trace.reuse_distance(b.index)
            if distance is not None and distance < self.knobs.max_reuse_distance:
                return
        self.release(b)

    def _make_room(self, numel: int, protect: Iterable[Stage3Bucket]) -> None:
        """Evict buckets kept for reuse until ``numel`` more elements fit under the live bound."""
        if self.live_numel + numel <= self.knobs.max_live_numel:
            return
        keep = {id(b) for b in protect}
        idle = [b for b in self.buckets if b.state is BucketState.GATHERED and not b.persistent and not b.in_use()
                and not b.prefetched and id(b) not in keep]
        idle.sort(key=lambda b: -(d if (d := self.trace.reuse_distance(b.index)) is not None else 1 << 62))
        for b in idle:
            if self.live_numel + numel <= self.knobs.max_live_numel:
                break
            self.release(b)

    def release_all(self) -> None:
        """Release every non-persistent bucket nobody pins (end of a pass)."""
        for b in self.buckets:
            if b.state is BucketState.INFLIGHT:
                self.finish(b, attach=False)
                b.attach()
            b.prefetched = False
            b.fwd_refs = 0
            if not b.persistent and not b.pins:
                self.release(b)

    def gather_persistent(self) -> None:
        """(Re-)gather every persistent bucket: at start-up and after each optimizer step.

        Persistent buckets are the small parameters (``stage3_param_persistence_threshold``), often one per
        norm or bias: those with a plain all-gather share one collective per process group and dtype
        (:func:`~zerospeed.zero.stage3.bucket.gather_together`) instead of one each; the others (hpZ, qwZ,
        swapped shards) gather alone."""
        started = []
        batches: dict[tuple[int, torch.dtype], list[Stage3Bucket]] = {}
        for b in self.buckets:
            if b.persistent and b.can_coalesce_gather():
                batches.setdefault((id(b.group), b.dtype), []).append(b)
        for batch in batches.values():
            if len(batch) > 1:
                for b in batch:
                    self.finish(b, attach=False)
                self.watchdog.note_collective("all_gather", f"{len(batch)} persistent buckets [refresh, coalesced]")
                gather_together(batch)
        coalesced = {id(b) for batch in batches.values() if len(batch) > 1 for b in batch}
        for b in self.buckets:
            if not b.persistent or id(b) in coalesced:
                continue
            self.watchdog.note_collective("all_gather", f"{b.name} [persistent refresh]")
            if b.state is BucketState.RELEASED:
                b.start_gather()
            else:
                self.finish(b)
                b.refresh_in_place()
            started.append(b)
        for b in started:
            self.finish(b)

    def _check_trace_agrees(self) -> None:
        """Once per recorded trace: every rank must have recorded the same module order."""
        mine = json.dumps(self.trace.digest())
        peers = self.watchdog.agree(f"trace/{self.watchdog.pass_id}", mine, "comparing the recorded module order")
        digests = {self.watchdog.rank: json.loads(mine), **{q: json.loads(v) for q, v in peers.items()}}
        if all(d == digests[self.watchdog.rank] for d in digests.values()):
            return
        first = next(i for i in range(max(map(len, digests.values())))
                     if len({tuple(d[i]) if i < len(d) else None for d in digests.values()}) > 1)
        seen = "; ".join(f"rank {r}: {d[first][1]!r} ({d[first][0]})" if first < len(d) else f"rank {r}: end of pass"
                         for r, d in sorted(digests.items()))
        raise ZeroCollectiveDivergence(
            f"ZeRO-3 ranks recorded different module orders on their first step; first difference at module event "
            f"#{first + 1}: {seen}. Every rank must call the same modules in the same order.")
