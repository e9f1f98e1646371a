"""``engine.compile(backend, compile_kwargs, schedule)``: torch.compile of the wrapped module in place.

Decisions:

* What is compiled is ``engine.module`` (``nn.Module.compile``), not the engine: loss scaling, the
  accumulation boundary, the ZeRO strategy's step and the communication counters stay eager
  Python outside the graph. The strategy's module and gradient hooks are still called by the
  compiled module; where Dynamo cannot trace them (ZeRO-3's gather/release hooks) the graph
  breaks there, and :meth:`CompiledState.report` counts the breaks and names their reasons.
* ``backend`` is a name from ``torch._dynamo.list_backends(exclude_tags=())`` (``"inductor"``,
  ``"eager"``, ``"aot_eager"``...) or a callable backend; anything else is refused by name.
  ``compile_kwargs`` go to ``torch.compile`` (``dynamic``, ``fullgraph``, ``mode``, ``options``...);
  an unknown key is refused by name. ``dynamic=None`` (torch's default) recompiles once when a
  dimension first changes and then treats it as dynamic; ``dynamic=True`` starts dynamic;
  ``dynamic=False`` recompiles for every new shape (bounded by torch's recompile limit). Every
  recompile is counted with its reason.
* With ``compile.deepcompile: true`` the ZeRO work moves into the graphs
  (:mod:`zerospeed.compile.deepcompile`); ``schedule`` (DeepSpeed's: which passes run from which
  step) is a list of ``(step, [pass names])``, each name a built-in pass or one registered with
  ``engine.register_compile_pass`` (else the error lists the known ones). Without DeepCompile a
  schedule is refused: passes only run under DeepCompile.
* Compiling twice is an error (DeepSpeed would silently keep the first compilation).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from .passes import PassRegistry
from .stats import CompileStats

_COMPILE_KWARGS = tuple(p for p in inspect.signature(torch.compile).parameters if p not in ("model", "backend"))


def known_backends() -> list[str]:
    import torch._dynamo

    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def _check_backend(backend: Any) -> None:
    if isinstance(backend, str):
        if backend not in known_backends():
            raise ValueError(f"engine.compile: unknown backend {backend!r}; torch.compile knows: "
                             f"{', '.join(known_backends())} (or pass a callable backend)")
    elif not callable(backend):
        raise TypeError(f"engine.compile: backend must be a backend name or a callable, got {type(backend).__name__}")


def _check_kwargs(compile_kwargs: Any) -> dict[str, Any]:
    if compile_kwargs is None:
        return {}
    if not isinstance(compile_kwargs, dict):
        raise TypeError(f"engine.compile: compile_kwargs must be a dict, got {type(compile_kwargs).__name__}")
    for key in compile_kwargs:
        if key not in _COMPILE_KWARGS:
            raise ValueError(f"engine.compile: compile_kwargs key {key!r} is not a torch.compile option "
                             f"(known: {', '.join(_COMPILE_KWARGS)})")
    return dict(compile_kwargs)


def _check_schedule(schedule: Any, registry: PassRegistry, deepcompile: bool = False) -> None:
    if schedule is None:
        return
    entries = list(schedule) if isinstance(schedule, (list, tuple)) else None
    if entries is None or not all(isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[0], int)
                                  and isinstance(e[1], (list, tuple)) for e in entries):
        raise ValueError(f"engine.compile: schedule must be a list of (step, [pass names]), got {schedule!r}")
    for _, names in entries:
        registry.resolve(names)  # unknown names: the error lists the known passes
    if not deepcompile:
        raise ValueError("engine.compile: schedule runs graph passes, which need DeepCompile; set "
                         "compile.deepcompile: true (or call engine.compile() without schedule)")


class CompiledState:
    """Per-engine compile state: the pass registry, whether compiled, and the measurements."""

    def __init__(self) -> None:
        self.passes = PassRegistry()
        self.compiled = False
        self.backend: str | Callable[..., Any] | None = None
        self.compile_kwargs: dict[str, Any] = {}
        self.stats = CompileStats()
        self.deepcompile: Any = None  # zerospeed.compile.deepcompile.DeepCompile when enabled

    def report(self) -> dict[str, Any]:
        """Graphs, graph breaks (with reasons), recompiles (with reasons), compile time in seconds."""
        if not self.compiled:
            return {"compiled": False}
        backend = self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "callable")
        out = {"compiled": True, "backend": backend, "compile_kwargs": dict(self.compile_kwargs),
               "deepcompile": self.deepcompile is not None, **self.stats.report()}
        if self.deepcompile is not None:
            out["schedule"] = [list(e) for e in self.deepcompile.schedule]
            out["unsharded_buckets"] = list(self.deepcompile.kept)
            out["graph_ops"] = dict(self.deepcompile.owner.counts)
            if self.deepcompile.activations is not None:
                out["graph_ops"].update(self.deepcompile.activations.counts)
        return out


def state_of(engine: Any) -> CompiledState:
    state = engine.__dict__.get("_zs_compile_state")
    if state is None:
        state = CompiledState()
        engine.__dict__["_zs_compile_state"] = state
    return state


def compile_engine(engine: Any, backend: str | Callable[..., Any] = "inductor",
                   compile_kwargs: dict[str, Any] | None = None, schedule: Any = None) -> None:
    """Compile ``engine.module`` in place with ``torch.compile``; see the module docstring."""
    state = state_of(engine)
    if state.compiled:
        raise RuntimeError("engine.compile: the engine is already compiled (compile it once)")
    _check_backend(backend)
    kwargs = _check_kwargs(compile_kwargs)
    cfg = getattr(getattr(engine, "config", None), "compile", None)
    deepcompile = bool(getattr(cfg, "deepcompile", False))
    _check_schedule(schedule, state.passes, deepcompile)
    if deepcompile:
        from .deepcompile import DeepCompile

        dc = DeepCompile(engine, backend, kwargs, schedule, state.passes.resolve, getattr(cfg, "passes", None))
        state.stats.start()
        engine.__dict__["_zs_module_call"] = dc
        state.deepcompile = dc
    else:
        state.stats.start()
        engine.module.compile(backend=backend, **kwargs)
    state.backend, state.compile_kwargs, state.compiled = backend, kwargs, True
