"""Where the rollout copy's weights come from: the training module's parameters, read bucket by bucket.

Two pieces:

* :class:`WeightSource` maps the HF names the inference families ask for (``model.layers.0.mlp.up_proj.weight``)
  to the training module's parameters. A PEFT LoRA model is read through: its base weight
  (``...up_proj.base_layer.weight``) plus ``scaling * B @ A`` of every active adapter, computed into a fresh
  tensor at read time, so the adapters are applied to the rollout copy and never merged into the ZeRO shards.
  Under ZeRO-3 each parameter belongs to one bucket (:mod:`zerospeed.zero.stage3.registry`); parameters of
  stages 0-2 are whole on every rank and need no gather.
* :class:`PlanReader` is the reader the inference families' ``load_weights`` fill (the same calls as the
  folder reader :class:`zerospeed.inference.models.loader.TensorReader`), but it records each job (target
  parameter, the HF names its thunk reads, the thunk) instead of running it, so a pass can run the jobs in the
  order of the buckets they need: each bucket is gathered once per pass (:func:`run_pass`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

_PEFT_PREFIX = "base_model.model."


def _strip(name: str) -> str:
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX):]
    return name.replace(".base_layer.", ".")


def _is_lora(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("base_layer", "lora_A", "lora_B", "scaling"))


class WeightSource:
    """HF name -> the training parameters it is computed from, and how (see the module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._plain: dict[str, nn.Parameter] = {}
        self._lora: dict[str, tuple[nn.Parameter, list[tuple[nn.Parameter, nn.Parameter, float]]]] = {}
        lora_params: set[int] = set()
        for mname, m in module.named_modules():
            if not _is_lora(m):
                continue
            active = getattr(m, "active_adapters", None) or list(m.lora_A.keys())
            pairs = []
            for a in active:
                if a in m.lora_A and a in m.lora_B:
                    A, B = m.lora_A[a].weight, m.lora_B[a].weight
                    pairs.append((A, B, float(m.scaling[a])))
                    lora_params.update((id(A), id(B)))
            if getattr(m, "fan_in_fan_out", False):
                raise ValueError(f"hybrid_engine: LoRA module {mname!r} has fan_in_fan_out=True (Conv1D base); "
                                 "rollouts read LoRA on nn.Linear bases only")
            self._lora[_strip(mname) + ".weight"] = (m.base_layer.weight, pairs)
            lora_params.add(id(m.base_layer.weight))
        for name, p in module.named_parameters():
            if id(p) not in lora_params:
                self._plain[_strip(name)] = p
        self.buffers = {_strip(n): b for n, b in module.named_buffers()}
        #: where a parameter's current value is read from: None reads ``param.detach()`` (gathered); the rollout
        #: sets a function here while it reads from its own gathered storage (:mod:`zerospeed.rl.arena`)
        self.values: Callable[[nn.Parameter], torch.Tensor] | None = None

    def _data(self, p: nn.Parameter) -> torch.Tensor:
        return p.detach() if self.values is None else self.values(p)

    @property
    def has_lora(self) -> bool:
        return bool(self._lora)

    def names(self) -> set[str]:
        return set(self._plain) | set(self._lora) | set(self.buffers)

    def params_of(self, name: str) -> list[nn.Parameter]:
        if name in self._lora:
            base, pairs = self._lora[name]
            return [base] + [t for A, B, _ in pairs for t in (A, B)]
        if name in self._plain:
            return [self._plain[name]]
        return []

    def adapter_params(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) of every LoRA A / B matrix, in module order (the LoRA-delta sync sends these)."""
        out = []
        for name, p in self.module.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                out.append((name, p))
        return out

    def read(self, name: str) -> torch.Tensor:
        """The current value (the parameters must be gathered): a view for plain weights, a new tensor with
        the adapters applied for LoRA weights."""
        if name in self._lora:
            base, pairs = self._lora[name]
            w = self._data(base)
            if pairs:
                w = w.clone()
                for A, B, s in pairs:
                    w.add_(self._data(B).to(w.dtype) @ self._data(A).to(w.dtype), alpha=s)
            return w
        if name in self._plain:
            return self._data(self._plain[name])
        return self.buffers[name].detach()


class Job:
    """One tensor to produce: ``thunk()`` reads the HF tensors ``names`` (or the parameters ``params``) and gives
    the value for ``target`` (None when a consumer takes it, as the weight sync does)."""

    __slots__ = ("target", "names", "thunk", "params")

    def __init__(self, target: nn.Parameter | None, names: tuple[str, ...], thunk: Callable[[], torch.Tensor],
                 params: list[nn.Parameter] | None = None) -> None:
        self.target, self.names, self.thunk, self.params = target, names, thunk, params


class PlanReader:
    """Collects a family's ``load_weights`` calls as :class:`Job` s (names checked against the source)."""

    def __init__(self, source: WeightSource, dtype: torch.dtype, device: torch.device) -> None:
        self.source = source
        self.dtype, self.device = dtype, device
        self.model_dir = f"<{type(source.module).__name__}>"
        self._names = source.names()
        self._pending: list[str] = []
        self.jobs: list[Job] = []
        self._missing: list[str] = []
        self.whole: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}  # name -> piece to whole tensor (TP)

    def _value(self, name: str) -> torch.Tensor:
        t = self.source.read(name)
        fn = self.whole.get(name)
        return t if fn is None else fn(t)

    def has(self, name: str) -> bool:
        return name in self._names

    def ignore(self, name: str) -> None:
        pass

    def get(self, name: str, shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
        if name not in self._names:
            self._missing.append(name)
        self._pending.append(name)
        return lambda: self._value(name).to(device=self.device, dtype=self.dtype)

    def assign(self, param: nn.Parameter, thunk: Callable[[], torch.Tensor]) -> None:
        self.jobs.append(Job(param, tuple(self._pending), thunk))
        self._pending = []

    def put(self, param: nn.Parameter, name: str, shape: tuple[int, ...]) -> None:
        self.assign(param, self.get(name, shape))

    def finish(self, model: nn.Module) -> None:
        if self._missing:
            raise ValueError(f"hybrid_engine: the training module has no parameter for "
                             f"{', '.join(self._missing[:8])} (is it the HF model the config describes?)")
        filled = {id(j.target) for j in self.jobs}
        unfilled = [n for n, p in model.named_parameters() if id(p) not in filled]
        if unfilled:
            raise ValueError(f"internal: rollout parameters with no source: {', '.join(unfilled[:8])}")


def bucket_of(param: nn.Parameter) -> Any:
    """The ZeRO-3 bucket holding ``param``, or None (whole on every rank)."""
    from zerospeed.zero.stage3 import registry

    found = registry.lookup(param)
    return None if found is None else found[0]


def order_jobs(jobs: list[Job], source: WeightSource, skip: set[int] = frozenset()) -> list[tuple[Job, list[Any]]]:
    """Jobs sorted by the first bucket they need (bucket order = module order), each with its buckets (those whose
    id is in ``skip`` left out: their values come from elsewhere, see :attr:`WeightSource.values`)."""
    out = []
    for j in jobs:
        buckets: list[Any] = []
        for n in j.names:
            for p in source.params_of(n):
                b = bucket_of(p)
                if b is not None and id(b) not in skip and all(b is not c for c in buckets):
                    buckets.append(b)
        out.append((j, buckets))
    return sorted(out, key=lambda jb: min((b.index for b in jb[1]), default=-1))


def run_pass(ordered: Iterable[tuple[Job, list[Any]]], consume: Callable[[Job], None] | None = None) -> int:
    """Run ``ordered`` jobs (copy each source value into its target, or call ``consume(job)``), pinning each
    bucket from its first use to its last, so each is gathered once; returns the number of bucket gathers
    started. A collective: every rank of the data-parallel group runs the same pass."""
    ordered = list(ordered)
    last: dict[int, int] = {}
    for i, (_, buckets) in enumerate(ordered):
        for b in buckets:
            last[id(b)] = i
    pinned: dict[int, Any] = {}
    gathers = 0
    try:
        for i, (job, buckets) in enumerate(ordered):
            new = [b for b in buckets if id(b) not in pinned]
            by_owner: dict[int, list[Any]] = {}
            for b in new:
                by_owner.setdefault(id(b.owner), []).append(b)
                pinned[id(b)] = b
            for group in by_owner.values():
                gathers += sum(1 for b in group if not b.persistent and b.state.value == "released")
                group[0].owner.pin(group, "hybrid_engine rollout")
            if consume is not None:
                consume(job)
            else:
                value = job.thunk()
                if value.shape != job.target.shape:  # a layout the plan did not expect: never broadcast
                    raise ValueError(f"hybrid_engine: a rollout weight of shape {tuple(value.shape)} for a "
                                     f"parameter of shape {tuple(job.target.shape)} ({job.names})")
                with torch.no_grad():
                    job.target.copy_(value)
            done = [pinned.pop(id(b)) for b in buckets if last[id(b)] == i]
            for b in done:
                b.owner.unpin([b])
    finally:
        for b in pinned.values():
            b.owner.unpin([b])
    return gathers
