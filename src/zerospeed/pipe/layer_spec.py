"""Deferred layer construction for pipeline stages (DeepSpeed's ``LayerSpec``/``TiedLayerSpec``).

A spec stores a module class and its constructor arguments; ``build()`` calls the constructor.
``PipelineModule`` builds only the specs of its own stage, so a model too large for one process is
never materialized whole, and ``partition_layers`` can count a spec's parameters on the meta device.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

__all__ = ["LayerSpec", "TiedLayerSpec"]


def _format_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    return ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])


class LayerSpec:
    """``LayerSpec(typename, *args, **kwargs)``: build ``typename(*args, **kwargs)`` on demand."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise ValueError(f"typename: LayerSpec needs a torch.nn.Module subclass, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        """Construct the layer (on the current default device, e.g. inside ``torch.device('meta')``)."""
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = _format_args(self.module_args, self.module_kwargs)
        return f"{type(self).__name__}({self.typename.__name__}({args}))"


class TiedLayerSpec(LayerSpec):
    """A layer whose weights are shared by every occurrence with the same ``key``.

    Typical use: the token embedding on the first stage and the LM head on the last stage. Each
    stage holding a ``key`` builds the module once (all its occurrences on that stage share it);
    across stages the runtime keeps the copies equal by summing their gradients over the stages
    that own the key (``PipelineModule.tied_stages``). ``forward_fn(module, x)``, when given,
    replaces ``module(x)`` at that occurrence (for instance ``x @ module.weight.T`` for the head).
    ``tied_weight_attr`` names the shared parameter(s): a dotted attribute path or a list of them.
    """

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | Sequence[str] = "weight",
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key or "." in key:
            raise ValueError(f"key: TiedLayerSpec needs a non-empty str key without '.', got {key!r}")
        if forward_fn is not None and not callable(forward_fn):
            raise ValueError(f"forward_fn: must be callable(module, input), got {forward_fn!r}")
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        if not attrs or not all(isinstance(a, str) and a for a in attrs):
            raise ValueError(f"tied_weight_attr: expected an attribute name or a list of them, "
                             f"got {tied_weight_attr!r}")
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr: list[str] = attrs

    def __repr__(self) -> str:
        return f"TiedLayerSpec(key={self.key!r}, {super().__repr__()[len('TiedLayerSpec('):]}"
