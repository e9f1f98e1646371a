"""The mechanics of ``zero.Init``: partition parameters as the model is being built.

``torch.nn.modules.module.register_module_parameter_registration_hook`` fires as each parameter
is registered, and ``register_module_module_registration_hook`` as each submodule is attached
(both public torch hooks, active only inside the context). A parameter cannot be partitioned at
its registration: modules initialise their parameters *after* registering them
(``nn.Linear.__init__`` registers ``weight`` and ``bias``, then calls ``reset_parameters()``).
So a registered parameter is *pending* until its module's ``__init__`` has returned; at every
registration event the pending modules that are no longer under construction (no ``__init__``
frame of theirs is on the Python stack) are partitioned, and whatever is left is partitioned when
the context exits. At any time a rank therefore holds whole only the parameters of the modules
whose constructors are running (a module, its parent...) and of the last module built.

Partitioning a module's pending parameters (one provisional bucket per module and dtype):
rank 0's values are broadcast (ranks may have initialised differently), cast to the target dtype,
and each rank keeps its 1/N shard; the parameters then point at an empty placeholder. The stage-3
strategy re-buckets them when the engine is built (see :mod:`zerospeed.zero.stage3.planner`).

Limitation shared with DeepSpeed: code that writes a parameter after its module's constructor
returned (a parent's ``__init__`` re-initialising a child's weight) writes into the empty
placeholder; use ``zero.GatheredParameters(params, modifier_rank=0)`` for that.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

from zerospeed import comm
from zerospeed.zero.layout import plan_buckets
from zerospeed.zero.stage3 import registry, state_dict_guard
from zerospeed.zero.stage3.bucket import Stage3Bucket
from zerospeed.zero.stage3.hooks import BucketGatherer
from zerospeed.zero.stage3.watchdog import Watchdog


def modules_under_construction() -> set[int]:
    """ids of the modules whose ``__init__`` (or a base class's) is on the Python stack."""
    out: set[int] = set()
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__init__" and code.co_argcount:
            obj = frame.f_locals.get(code.co_varnames[0])
            if isinstance(obj, nn.Module):
                out.add(id(obj))
        frame = frame.f_back
    return out


class ConstructionPartitioner:
    def __init__(self, dp_group: dist.ProcessGroup | None, dtype: torch.dtype | None, device: torch.device,
                 timeout_s: float | None) -> None:
        self.group = dp_group
        self.rank = comm.get_rank(dp_group)
        self.world_size = comm.get_world_size(dp_group)
        self.dtype = dtype
        self.device = device
        self.watchdog = Watchdog.for_group(dp_group, timeout_s)
        self.gatherer = BucketGatherer(self.watchdog)
        self.gatherer.adoptable = True  # type: ignore[attr-defined]  # the strategy may re-bucket these
        self._pending: dict[int, tuple[nn.Module, list[tuple[str, nn.Parameter]]]] = {}
        self._handles: list[Any] = []

    def start(self) -> None:
        self._handles = [register_module_parameter_registration_hook(self._on_parameter),
                         register_module_module_registration_hook(self._on_module)]

    def stop(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.flush(everything=True)

    # -- hooks ------------------------------------------------------------------------------------
    def _on_parameter(self, module: nn.Module, name: str, param: Any) -> None:
        if param is not None and registry.lookup(param) is None:
            entry = self._pending.setdefault(id(module), (module, []))
            entry[1][:] = [(n, p) for n, p in entry[1] if n != name] + [(name, param)]
        self.flush(keep=module)  # the hook runs before torch stores the parameter: keep its module pending
        return None

    def _on_module(self, parent: nn.Module, name: str, child: Any) -> None:
        self.flush()
        return None

    def flush(self, everything: bool = False, keep: nn.Module | None = None) -> None:
        if not self._pending:
            return
        busy = set() if everything else modules_under_construction()
        if keep is not None:
            busy.add(id(keep))
        for key, (module, params) in list(self._pending.items()):
            if key in busy:
                continue
            del self._pending[key]
            self.partition(module, params)

    # -- partitioning -----------------------------------------------------------------------------
    def partition_module(self, root: nn.Module) -> None:
        """Partition an already-built module (``zero.Init(module=model)``)."""
        for module in root.modules():
            self.partition(module, list(module.named_parameters(recurse=False)))

    def partition(self, module: nn.Module, params: list[tuple[str, nn.Parameter]]) -> None:
        registered = dict(module.named_parameters(recurse=False, remove_duplicate=False))
        live = [(n, p) for n, p in params if registered.get(n) is p and registry.lookup(p) is None]
        by_dtype: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
        for n, p in live:
            target = self.dtype if self.dtype is not None and p.is_floating_point() else p.dtype
            by_dtype.setdefault(target, []).append((n, p))
        for dtype, members in by_dtype.items():
            self._make_bucket(module, dtype, members)
        if by_dtype:
            state_dict_guard.guard(module)

    def _make_bucket(self, module: nn.Module, dtype: torch.dtype, members: list[tuple[str, nn.Parameter]]) -> None:
        layout = plan_buckets([(n, tuple(p.shape), 0) for n, p in members], 1 << 62, self.world_size)[0]
        name = f"zero.Init:{type(module).__name__}"
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).to(device=self.device, dtype=dtype) for _, p in members])
            if self.world_size > 1:  # one initialisation for everybody: rank 0's
                self.watchdog.note_collective("broadcast", name)
                work = comm.broadcast(flat, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                                      group=self.group, async_op=True)
                self.watchdog.wait(work, "broadcast", name)
            values = [v.view(s.shape) for v, s in zip(flat.split([s.numel for s in layout.slots]), layout.slots)]
        bucket = Stage3Bucket(layout, [p for _, p in members], values, dtype, self.device, self.group, self.rank,
                              name)
        bucket.owner = self.gatherer
        registry.add_bucket(bucket)
