"""Initialisation code under ``zero.Init`` sees whole parameters, so a model initialises exactly as without it.

``zero.Init`` partitions a module's parameters as soon as its constructor returns. Initialisation
that runs later - HuggingFace's ``post_init()`` (``_init_weights`` on every module, after the whole
model is built), a parent's ``__init__`` calling ``nn.init.normal_(self.child.weight)``, a
``reset_parameters()`` pass - would otherwise write into the empty placeholders (a no-op, or an
``IndexError`` on ``weight[padding_idx]``) and the model would keep its constructor defaults.

While a ``zero.Init`` context is open, a profile function (``sys.setprofile``, the interpreter's
public call/return hook; nothing of torch or transformers is replaced) watches for calls of:

* an initialiser of ``torch.nn.init`` or ``transformers.initialization`` (``normal_``, ``zeros_``,
  ``kaiming_uniform_``, ``_calculate_fan_in_and_fan_out``...) whose tensor is a partitioned
  parameter: that parameter is gathered for the call;
* ``_init_weights(module)`` / ``_initialize_weights(module)`` (HF's per-module dispatch): the
  module's own parameters are gathered, so code that slices or reads their shape works;
* ``reset_parameters()`` / ``_reset_parameters()`` of a module: the module's parameters, its
  submodules' included (``nn.MultiheadAttention`` initialises its child's bias), are gathered.

Each gather is ``zero.GatheredParameters(params, modifier_rank=0)``: rank 0's values are broadcast
and re-partitioned when the call returns. Memory stays bounded by what one call touches (one
module's parameters for HF's init), as with DeepSpeed, which gathers around HF's init the same way.
Because the init code runs on whole tensors of the same shapes, in the same order, it draws the
same random numbers: with the same seed the model equals the one built without ``zero.Init``.

Not seen (documented limitation, as in DeepSpeed): writes through ``param.data`` or in-place tensor
methods (``weight.data.normal_()``) outside these calls, after the parameter's module was built;
use ``zero.GatheredParameters(params, modifier_rank=0)`` for those. Calls are matched only on the
thread that opened the context; nested gathers of an already gathered parameter are skipped.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

INIT_MODULES = ("torch.nn.init", "transformers.initialization")
MODULE_INIT_NAMES = {"_init_weights": False, "_initialize_weights": False,  # name -> gather submodules too
                     "reset_parameters": True, "_reset_parameters": True}


def _partitioned(params: Any) -> list[nn.Parameter]:
    from zerospeed.zero.stage3 import registry

    return [p for p in params if isinstance(p, nn.Parameter) and registry.lookup(p) is not None]


class InitCapture:
    """Installs the profile function for the lifetime of one (outermost) ``zero.Init`` context."""

    def __init__(self) -> None:
        self._open: dict[int, tuple[Any, Any, set[int]]] = {}  # id(frame) -> (frame, context, param ids)
        self._held: dict[int, int] = {}  # id(param) -> open gathers holding it
        self._previous: Any = None

    def start(self) -> None:
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)

    def stop(self) -> None:
        sys.setprofile(self._previous)
        self._previous = None
        for frame_id in list(self._open):  # a context closed from inside an init call (unusual)
            self._close(frame_id)

    # -- the profile function ---------------------------------------------------------------------
    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if self._previous is not None:
            self._previous(frame, event, arg)
        if event == "call":
            params = self._targets(frame)
            if params:
                self._open_gather(frame, params)
        elif event == "return" and id(frame) in self._open and self._open[id(frame)][0] is frame:
            self._close(id(frame))

    def _targets(self, frame: Any) -> list[nn.Parameter]:
        code = frame.f_code
        name = code.co_name
        if name in MODULE_INIT_NAMES:
            local = frame.f_locals
            args = code.co_varnames[:code.co_argcount]
            module = next((local[a] for a in args[1:2] if isinstance(local.get(a), nn.Module)), None)
            if module is None and args and isinstance(local.get(args[0]), nn.Module):
                module = local[args[0]]
            if module is None:
                return []
            return _partitioned(module.parameters(recurse=MODULE_INIT_NAMES[name]))
        if code.co_argcount and frame.f_globals.get("__name__") in INIT_MODULES:
            return _partitioned([frame.f_locals.get(code.co_varnames[0])])
        return []

    def _open_gather(self, frame: Any, params: list[nn.Parameter]) -> None:
        from zerospeed.zero.gathered import GatheredParameters

        fresh = [p for p in params if not self._held.get(id(p))]
        if not fresh:
            return
        ctx = GatheredParameters(fresh, modifier_rank=0)
        ctx.__enter__()
        ids = {id(p) for p in fresh}
        for i in ids:
            self._held[i] = self._held.get(i, 0) + 1
        self._open[id(frame)] = (frame, ctx, ids)

    def _close(self, frame_id: int) -> None:
        _, ctx, ids = self._open.pop(frame_id)
        for i in ids:
            self._held[i] -= 1
            if not self._held[i]:
                del self._held[i]
        ctx.__exit__(None, None, None)


__all__ = ["InitCapture"]
