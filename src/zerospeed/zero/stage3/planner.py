"""Which module owns which parameter, and the ZeRO-3 buckets built from them.

Units: every module that directly registers parameters owns those it registers first (in
``named_modules`` order, so a tied weight belongs to the first module that has it, as
``named_parameters`` reports it). Its owned parameters are split into buckets by kind: optimizer
parameter group (each group has its own lr / weight decay and a flat master per bucket), not
optimized (frozen, or left out of the optimizer), dtype, and persistent (numel at most
``stage3_param_persistence_threshold``, within ``stage3_model_persistence_threshold`` in total:
these stay gathered). A module's plan is its own buckets plus the buckets of parameters it uses
without owning: tied parameters registered in it too, parameters registered with
``zero.register_external_parameter``, and the submodule parameters that torch modules such as
``nn.MultiheadAttention`` read directly (:mod:`zerospeed.zero.stage3.implicit_params`). A ZeRO-3 leaf module
(``deepspeed.utils.set_z3_leaf_modules``) takes the buckets of its whole subtree into its own plan, and the modules
below it get none (no hooks): the leaf's forward gathers everything its subtree uses, in one go.

A bucket is the unit of every collective (one all-gather per bucket per gather, one
reduce-scatter per bucket per micro-step). Gathering is per module anyway, so a module's
parameters of one kind are never split further: the largest module bounds the live memory, as in
DeepSpeed.

Adoption of a ``zero.Init`` model: its parameters arrive as provisional buckets (one per module,
laid out before the optimizer existed). For each module, the provisional buckets it needs are
gathered (without re-pointing any parameter), the final buckets are filled from them and the
provisional ones are freed, so at most one module's parameters are ever whole on a rank.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from zerospeed.zero.layout import plan_buckets
from zerospeed.zero.stage3 import registry
from zerospeed.zero.stage3.bucket import BucketState, Stage3Bucket
from zerospeed.zero.stage3.hooks import BucketGatherer, ModulePlan
from zerospeed.zero.stage3.implicit_params import implicit_externals

NOT_OPTIMIZED = -1


@dataclasses.dataclass(frozen=True)
class PlannerOptions:
    persistence_threshold: int
    model_persistence_threshold: int = sys.maxsize


def build_buckets(root: nn.Module, group_of: dict[int, int], options: PlannerOptions,
                  dp_group: dist.ProcessGroup | None, dp_rank: int, dp_world_size: int,
                  adopter: BucketGatherer, group_of_param: Callable[[nn.Parameter], tuple[Any, int, int] | None]
                  | None = None, unit_name: Callable[[str], str] | None = None
                  ) -> tuple[list[Stage3Bucket], dict[int, ModulePlan]]:
    """Partition every parameter of ``root`` into buckets; return the buckets and the module plans.

    ``group_of_param(p)``: ``(process group, rank in it, its size)`` for a parameter sharded over
    another group than the data-parallel one (mixture-of-experts experts: their expert-data-parallel
    group), None for the others. Such parameters get buckets of their own, whose all-gathers and
    reduce-scatters run over that group; the bucket records it as ``comm_group`` / ``comm_rank`` /
    ``comm_size`` (as stages 1-2's buckets do), which the optimizer's norm and the checkpoint read.

    ``unit_name(module name)``: the label of a module in collectives and traces, which ranks compare
    (the watchdog); it must be the same on every rank for the same position in the model (MoE expert
    modules are named by global expert index, which differs between expert-parallel ranks).
    """
    label_of = unit_name or (lambda n: n)
    owner: dict[int, str] = {}
    owned_by: list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]] = []
    plans: dict[int, ModulePlan] = {}
    shared: list[tuple[nn.Module, nn.Parameter]] = []
    for mname, module in root.named_modules():
        mine = []
        for pname, p in module.named_parameters(recurse=False, remove_duplicate=False):
            full = f"{mname}.{pname}" if mname else pname
            if id(p) in owner:
                shared.append((module, p))  # tied: registered here too, owned elsewhere
                continue
            owner[id(p)] = full
            mine.append((full, p))
        plans[id(module)] = ModulePlan(module, label_of(mname) or "<root>")
        if mine:
            owned_by.append((mname, module, mine))

    adoption = _Adoption(adopter, {id(p) for _, _, ps in owned_by for _, p in ps})
    buckets: list[Stage3Bucket] = []
    where: dict[int, Stage3Bucket] = {}
    persistent_total = 0
    specs: list[tuple[Any, int, int]] = []  # the non-dp groups met, in order
    for mname, module, params in owned_by:
        kinds: dict[tuple[Any, ...], list[tuple[str, nn.Parameter]]] = {}
        for full, p in params:
            gi = group_of.get(id(p), NOT_OPTIMIZED) if p.requires_grad else NOT_OPTIMIZED
            numel = _numel(p, adoption)
            persistent = numel <= options.persistence_threshold and \
                persistent_total + numel <= options.model_persistence_threshold
            if persistent:
                persistent_total += numel
            spec = group_of_param(p) if group_of_param is not None else None
            which = -1
            if spec is not None:
                which = next((i for i, s in enumerate(specs) if s[0] is spec[0]), len(specs))
                if which == len(specs):
                    specs.append(spec)
            kinds.setdefault((persistent, gi, p.dtype, which), []).append((full, p))
        values = adoption.values_for([p for _, p in params])
        for (persistent, gi, dtype, which), members in kinds.items():
            group, rank, world = specs[which] if which >= 0 else (dp_group, dp_rank, dp_world_size)
            layout = plan_buckets([(n, _shape(p, adoption), 0) for n, p in members], 1 << 62, world)[0]
            layout = dataclasses.replace(layout, index=len(buckets), group_index=gi)
            label = f"{label_of(mname) or '<root>'}" + ("" if len(kinds) == 1 else f"#{len(buckets)}")
            device = members[0][1].device  # the placeholder's device for a zero.Init parameter
            b = Stage3Bucket(layout, [p for _, p in members], [values[id(p)] for _, p in members], dtype, device,
                             group, rank, label, persistent=persistent, trainable=gi != NOT_OPTIMIZED)
            if which >= 0:  # where its collectives run, in stages 1-2's names
                b.comm_group, b.comm_rank, b.comm_size = group, rank, world
            buckets.append(b)
            plans[id(module)].add(b, fixed=True)
            for _, p in members:
                where[id(p)] = b
        adoption.done_with([p for _, p in params])
    adoption.close()

    leaf_of = registry.leaf_units(root)  # DeepSpeed's z3 leaf modules: one plan for the leaf's whole subtree
    for module in root.modules():
        leaf = leaf_of.get(id(module))
        if leaf is not None and leaf is not module:
            for b in plans[id(module)].buckets:
                plans[id(leaf)].add(b, fixed=True)
            plans[id(module)].buckets, plans[id(module)].fixed = [], []

    def unit(module: nn.Module) -> ModulePlan:
        return plans[id(leaf_of.get(id(module), module))]

    for module, p in shared:
        unit(module).add(where[id(p)], fixed=True)
    for module in root.modules():
        for p in registry.externals_of(module) + implicit_externals(module):
            if id(p) in where:
                unit(module).add(where[id(p)])
    for b in buckets:
        registry.add_bucket(b)
    return buckets, plans


def _numel(p: nn.Parameter, adoption: "_Adoption") -> int:
    shape = _shape(p, adoption)
    n = 1
    for d in shape:
        n *= d
    return n


def _shape(p: nn.Parameter, adoption: "_Adoption") -> tuple[int, ...]:
    found = adoption.provisional(p)
    if found is None:
        return tuple(p.shape)
    bucket, pos = found
    return tuple(bucket.layout.slots[pos].shape)


class _Adoption:
    """Gathers ``zero.Init``'s provisional buckets as their parameters are re-bucketed, then frees them."""

    def __init__(self, gatherer: BucketGatherer, model_params: set[int]) -> None:
        self.gatherer = gatherer
        self.model_params = model_params
        self._remaining: dict[int, set[int]] = {}  # provisional bucket -> its model params not yet re-bucketed
        self._buckets: dict[int, Stage3Bucket] = {}

    def provisional(self, p: nn.Parameter) -> tuple[Stage3Bucket, int] | None:
        found = registry.lookup(p)
        if found is None:
            return None
        if getattr(found[0], "owner", None) is not None and not getattr(found[0].owner, "adoptable", False):
            raise ValueError("a parameter of this model is already managed by another ZeRO-3 engine")
        return found

    def values_for(self, params: list[nn.Parameter]) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        need: list[Stage3Bucket] = []
        for p in params:
            found = self.provisional(p)
            if found is None:  # an ordinary, whole parameter
                out[id(p)] = p.data
                continue
            b = found[0]
            if id(b) not in self._buckets:
                self._buckets[id(b)] = b
                self._remaining[id(b)] = {id(q) for _, q in b.live_params() if id(q) in self.model_params}
            if b.state is BucketState.RELEASED and all(x is not b for x in need):
                need.append(b)
        for b in need:
            self.gatherer.start(b, "adopt zero.Init partition")
        for b in need:
            self.gatherer.finish(b, attach=False)
        for p in params:
            found = self.provisional(p)
            if found is not None:
                out[id(p)] = found[0].slot_view(found[1])
        return out

    def done_with(self, params: list[nn.Parameter]) -> None:
        for p in params:
            for remaining in self._remaining.values():
                remaining.discard(id(p))
        for key, remaining in list(self._remaining.items()):
            if not remaining:
                self._free(key)

    def _free(self, key: int) -> None:
        b = self._buckets.pop(key)
        del self._remaining[key]
        registry.remove_bucket(b)
        if b.state is BucketState.GATHERED and not b.persistent:
            self.gatherer.live_numel -= b.padded_numel
            self.gatherer.live_bytes -= b.full_bytes
        b.discard()

    def close(self) -> None:
        for key in list(self._buckets):
            self._free(key)
