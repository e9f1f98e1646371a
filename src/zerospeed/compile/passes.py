"""The registry of named graph passes behind ``engine.register_compile_pass(name, fn)``.

A pass is a function ``(graph_module, profile) -> graph_module`` over an FX graph. Every registry
starts with DeepCompile's built-in passes (:mod:`zerospeed.compile.zero_passes`, plus
``selective_unshard``, which acts at partition time); registered passes run under DeepCompile when
a schedule names them. A schedule naming an unknown pass fails with the list of known ones.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from zerospeed.config.compile import DEEPSPEED_PASS_NAMES

Pass = Callable[[Any, Any], Any]


def _partition_time(gm: Any, profile: Any) -> Any:
    """``selective_unshard`` acts on the joint graph at partition time; on a graph it is the identity."""
    return gm


class PassRegistry:
    def __init__(self) -> None:
        from .zero_passes import PASSES

        self._passes: dict[str, Pass] = dict(PASSES)
        self._passes["selective_unshard"] = _partition_time

    def register(self, name: str, fn: Pass) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"register_compile_pass: name must be a non-empty string, got {name!r}")
        if not callable(fn):
            raise TypeError(f"register_compile_pass({name!r}): fn must be callable "
                            f"(graph_module, profile) -> graph_module, got {type(fn).__name__}")
        if name in DEEPSPEED_PASS_NAMES:  # compile.passes reads these as DeepSpeed's (zerospeed.config.compile)
            raise ValueError(f"register_compile_pass: {name!r} is one of DeepSpeed's compile.passes values "
                             f"({', '.join(DEEPSPEED_PASS_NAMES)}); choose another name")
        if name in self._passes and self._passes[name] is not fn:
            raise ValueError(f"register_compile_pass: a different pass is already registered as {name!r}")
        self._passes[name] = fn

    def known(self) -> list[str]:
        return sorted(self._passes)

    def resolve(self, names: Iterable[str]) -> list[Pass]:
        out = []
        for name in names:
            if name not in self._passes:
                known = ", ".join(self.known()) or "none registered"
                raise ValueError(f"unknown compile pass {name!r}; known passes: {known}")
            out.append(self._passes[name])
        return out
