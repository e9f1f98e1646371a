"""DeepSpeed's parameter-level ZeRO-3 API: ``zero.GatheredParameters``, external parameters, ``is_partitioned``.

Split from :mod:`zerospeed.zero.init` (which re-exports every name, DeepSpeed's ``deepspeed.zero`` paths)
so that :mod:`zerospeed.zero.init_capture`, which gathers parameters for init code running under
``zero.Init``, imports this lower file and not the context that starts it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _params_of(params: Any) -> list[nn.Parameter]:
    if params is None:
        return []
    if torch.is_tensor(params):
        return [params]
    return [p for p in params if p is not None]


class GatheredParameters:
    """Gather partitioned parameters for the duration of the context (DeepSpeed's API)."""

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                 enabled: bool = True) -> None:
        self.params = _params_of(params)
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module
        self.enabled = enabled
        self._groups: list[tuple[Any, list[Any]]] = []

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled:
            return self
        from zerospeed.zero.stage3 import registry

        by_owner: dict[int, tuple[Any, list[Any]]] = {}
        for p in self.params:
            found = registry.lookup(p)
            if found is None:
                continue
            bucket = found[0]
            owner, buckets = by_owner.setdefault(id(bucket.owner), (bucket.owner, []))
            if all(b is not bucket for b in buckets):
                buckets.append(bucket)
            if self.fwd_module is not None:
                register_external_parameter(self.fwd_module, p)
            elif hasattr(bucket.owner, "adopt_forward_use"):
                bucket.owner.adopt_forward_use(p)  # inside a ZeRO-3 forward: its backward must gather p too
        self._groups = list(by_owner.values())
        for owner, buckets in self._groups:
            owner.pin(buckets, "GatheredParameters")
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if not self.enabled or not self._groups:
            return
        try:
            if self.modifier_rank is not None and exc_type is None:
                self._broadcast_and_repartition()
        finally:
            for owner, buckets in self._groups:
                owner.unpin(buckets)
            self._groups = []

    def _broadcast_and_repartition(self) -> None:
        from zerospeed import comm
        from zerospeed.zero.stage3 import reshape

        for i, (owner, buckets) in enumerate(self._groups):  # shapes changed (resize): rebuild those buckets
            changed = [b for b in buckets if reshape.reshaped(b)]
            for b in changed:
                reshape.rebuild(owner, b, self.modifier_rank)
            self._groups[i] = (owner, [b for b in buckets if all(b is not c for c in changed)])
        for owner, buckets in self._groups:
            for b in buckets:
                if comm.get_rank() == self.modifier_rank:
                    b.adopt_user_writes()
            works = []
            for b in buckets:
                owner.watchdog.note_collective("broadcast", f"{b.name} [GatheredParameters]")
                works.append((b, comm.broadcast(b.full_buffer(), src=self.modifier_rank, group=b.group,
                                                async_op=True)))
            for b, work in works:
                owner.watchdog.wait(work, "broadcast", b.name)
                b.write_back_shard()


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Tell ZeRO-3 that ``module``'s forward uses ``parameter``, which another module owns."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_external_parameter: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, nn.Parameter):
        raise TypeError("register_external_parameter: parameter must be a torch.nn.Parameter, got "
                        f"{type(parameter).__name__}")
    from zerospeed.zero.stage3 import registry

    registry.add_external(module, parameter)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo :func:`register_external_parameter`."""
    if not isinstance(module, nn.Module) or not isinstance(parameter, nn.Parameter):
        raise TypeError("unregister_external_parameter(module: nn.Module, parameter: nn.Parameter)")
    from zerospeed.zero.stage3 import registry

    registry.remove_external(module, parameter)


def is_partitioned(param: Any) -> bool:
    """True when ``param`` is partitioned by ZeRO-3 (by ``zero.Init`` or a stage-3 engine)."""
    from zerospeed.zero.stage3 import registry

    return registry.lookup(param) is not None


__all__ = ["GatheredParameters", "is_partitioned", "register_external_parameter", "unregister_external_parameter"]
