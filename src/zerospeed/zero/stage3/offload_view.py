"""DeepSpeed's ZeRO-3 hook surface on the engine's optimizer (``optimizer.parameter_offload``), as a view.

TRL generates with a ZeRO-3 model by gathering every parameter (``GatheredParameters(model.parameters())``) and, for
the length of the generation, removing DeepSpeed's module hooks, which would otherwise run on every decoding step
(``trl.models.utils.remove_hooks`` / ``add_hooks``). It reaches them through DeepSpeed's internals:
``engine.optimizer.parameter_offload`` with ``module`` (whose ``ds_external_parameters()`` it reads),
``forward_hooks`` / ``backward_hooks`` (handles it removes, then lists it empties),
``_register_deepspeed_module(module)`` (re-installs) and ``param_coordinator`` (``is_invalid_trace()`` /
``_invalidate_trace()``), plus ``param.ds_active_sub_modules.clear()``.

zerospeed's hooks belong to :class:`~zerospeed.zero.stage3.hooks.Stage3Runtime`. As for parameters
(:mod:`zerospeed.zero.stage3.param_view`), the stage-3 strategy gives the optimizer object a subclass of its own class
(same name, same object: its state, groups and references are unchanged) with one read-only property,
``parameter_offload``, a :class:`ParameterOffloadView` over the runtime. Removing its one forward-hook handle removes
every hook of the runtime; ``_register_deepspeed_module(root)`` installs them again; the trace of the first step
(prefetch order) is invalidated, so the next training pass records it again. Backward hooks are attached per forward,
so there are none to list."""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from zerospeed.zero.stage3 import registry


class _RootView:
    """The partitioned root module as ``parameter_offload.module`` shows it: every attribute is the module's, plus
    DeepSpeed's ``ds_external_parameters()`` (``(key, parameter)`` pairs of the parameters registered on it with
    ``zero.register_external_parameter``), which DeepSpeed attaches to modules and TRL reads on the root."""

    def __init__(self, root: nn.Module) -> None:
        object.__setattr__(self, "_root", root)

    def ds_external_parameters(self) -> list[tuple[int, nn.Parameter]]:
        return [(id(p), p) for p in registry.externals_of(self._root)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._root, name)


class _RuntimeHooks:
    """One handle for all of the runtime's module hooks."""

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime

    def remove(self) -> None:
        self._runtime.remove_hooks()


class _Coordinator:
    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime

    def is_invalid_trace(self) -> bool:
        return not self._runtime.trace.complete

    def _invalidate_trace(self) -> None:
        self._runtime.trace.invalidate()


class ParameterOffloadView:
    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime

    @property
    def module(self) -> _RootView:
        return _RootView(self._runtime.root)

    @property
    def forward_hooks(self) -> list[_RuntimeHooks]:
        return [_RuntimeHooks(self._runtime)] if self._runtime.hooks_installed else []

    @forward_hooks.setter
    def forward_hooks(self, value: list[Any]) -> None:
        if value:
            raise ValueError("parameter_offload.forward_hooks: only [] can be assigned (after removing the hooks)")

    @property
    def backward_hooks(self) -> list[Any]:
        return []

    @backward_hooks.setter
    def backward_hooks(self, value: list[Any]) -> None:
        if value:
            raise ValueError("parameter_offload.backward_hooks: only [] can be assigned")

    @property
    def param_coordinator(self) -> _Coordinator:
        return _Coordinator(self._runtime)

    def _register_deepspeed_module(self, module: Any, count: Any = None) -> None:
        if isinstance(module, _RootView):
            module = module._root
        if module is not self._runtime.root:
            raise ValueError(f"_register_deepspeed_module: {type(module).__name__} is not the module this ZeRO-3 "
                             "engine partitions; only its root can be registered again")
        self._runtime.install_hooks()


class OptimizerView:
    """Mixed in before an optimizer's own class; see the module docstring."""

    _zs_runtimes: "weakref.WeakKeyDictionary[Any, Any]"

    @property
    def parameter_offload(self) -> ParameterOffloadView:
        runtime = type(self)._zs_runtimes.get(self)
        if runtime is None:
            raise AttributeError("parameter_offload: this optimizer's ZeRO-3 engine is gone")
        return ParameterOffloadView(runtime)


_classes: dict[type, type] = {}
_runtimes: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def adopt(optimizer: Any, runtime: Any) -> None:
    """Give ``optimizer`` the view class of its class, answering for ``runtime``'s hooks."""
    cls = type(optimizer)
    if not issubclass(cls, OptimizerView):
        made = _classes.get(cls)
        if made is None:
            made = type(cls.__name__, (OptimizerView, cls), {"__module__": cls.__module__,
                                                             "__qualname__": cls.__qualname__,
                                                             "_zs_runtimes": _runtimes})
            _classes[cls] = made
        optimizer.__class__ = made
    _runtimes[optimizer] = runtime


__all__ = ["OptimizerView", "ParameterOffloadView", "adopt"]
