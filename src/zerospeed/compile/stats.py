"""What a compilation cost, read from torch._dynamo's public-ish bookkeeping.

Decisions:

* The numbers come from ``torch._dynamo.utils.counters`` (``graph_break``: one entry per break
  reason, with its count) and ``torch._dynamo.utils.get_compilation_metrics()`` (one record per
  frame compilation, with ``recompile_reason`` and ``entire_frame_compile_time_s``). Both are
  process-wide, so :class:`CompileStats` takes a baseline when ``engine.compile`` runs and reports
  the difference: anything else compiled in the same process in the meantime is counted too (the
  report says so; one engine per process is the normal case).
* Graphs are ``counters["stats"]["unique_graphs"]``: every FX graph Dynamo handed to the backend.
* A recompile is a frame compilation with a ``recompile_reason`` (a guard failed: new shape,
  new dtype, changed Python constant); the reasons are kept so a recompile storm is visible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch._dynamo.utils import counters, get_compilation_metrics


def _graph_breaks() -> dict[str, int]:
    return {str(reason): int(n) for reason, n in counters["graph_break"].items()}


def _metrics() -> list[Any]:
    return list(get_compilation_metrics())


@dataclass
class CompileStats:
    """Counts since :meth:`start` (process-wide, see the module docstring)."""

    _graphs0: int = 0
    _breaks0: dict[str, int] = field(default_factory=dict)
    _seen: list[Any] = field(default_factory=list)  # records already accounted (held: ids stay unique)
    _frames: list[Any] = field(default_factory=list)

    def start(self) -> None:
        self._breaks0 = _graph_breaks()
        self._graphs0 = int(counters["stats"]["unique_graphs"])
        self._seen = _metrics()

    def _new_frames(self) -> list[Any]:
        seen = {id(m) for m in self._seen}
        for m in _metrics():
            if id(m) not in seen:
                self._seen.append(m)
                self._frames.append(m)
        return self._frames

    def break_reasons(self) -> dict[str, int]:
        now = _graph_breaks()  # (torch._dynamo.reset() clears the counters: never below zero)
        return {r: n - self._breaks0.get(r, 0) for r, n in now.items() if n - self._breaks0.get(r, 0) > 0}

    def report(self) -> dict[str, Any]:
        frames = self._new_frames()
        reasons = self.break_reasons()
        recompiles = [str(m.recompile_reason) for m in frames if m.recompile_reason]
        return {
            "graphs": max(0, int(counters["stats"]["unique_graphs"]) - self._graphs0),
            "graph_breaks": sum(reasons.values()),
            "graph_break_reasons": {r.splitlines()[0][:200]: n for r, n in reasons.items()},
            "frames_compiled": len(frames),
            "recompiles": len(recompiles),
            "recompile_reasons": [r.splitlines()[0][:200] for r in recompiles],
            "compile_time_s": float(sum(m.entire_frame_compile_time_s or 0.0 for m in frames)),
            "backend_time_s": float(sum(m.backend_compile_time_s or 0.0 for m in frames)),
        }
