"""Hardware-specific fast paths, chosen by measurement on the machine that runs them.

A *fast path* is one of several implementations of the same operation that give the same result
within what the arithmetic allows (an int8, bfloat16 or float32 greedy LM head; zerospeed's C CPU
kernels or plain torch; a fused or a multi-tensor Adam kernel; direct or buffered file I/O). Which
one is fastest depends on the CPU, not on a feature flag: oneDNN's int8 linear reads an int8 head at
memory speed on an Intel Xeon with AMX, and took 35.7 ms per call where float32 took 0.26 ms on an
AMD EPYC that reports VNNI too (issue #25). So nothing here asks the CPU what it has; each choice is
made once per process by *timing* the candidates on the shapes they will serve, cached per shape
class, and reported once (logger ``zerospeed.fast_paths``, and :func:`report` for benchmarks).

Every path has a switch (:data:`PATHS`): ``auto`` measures; any other value forces that candidate,
and a forced candidate that cannot run on this machine is an error naming the switch, never a
silent fallback. Where a config key or CLI flag exists (``greedy_head``, ``cpu_kernels``, ...), the
caller passes its value; the environment variable ``ZEROSPEED_FAST_PATHS`` (``"greedy_head=float32,
cpu_kernels=off"``) sets the paths left at ``auto`` for a whole process, e.g. a test run under a
capped instruction set.

Measurement (:meth:`FastPathChooser.choose`): each available candidate runs once to warm up (one-time
packing, page faults), then up to ``repeats`` timed runs interleaved across candidates (so a load
change on a shared machine hits all of them alike) within ``budget_s`` per candidate; the minimum
wall time of each decides; the *reference* candidate (the plain one, listed first) keeps the job unless
another is faster by more than ``margin`` (5%: timing noise never switches a path).
A candidate that raises while measured is excluded and the reason recorded; if every candidate
fails, the reference is returned (the caller's plain path). The clock is injectable: the tests feed
fake timings and time nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

log = logging.getLogger("zerospeed.fast_paths")

#: Every switchable fast path and its allowed settings ("auto" first, the reference candidate second).
PATHS: dict[str, tuple[str, ...]] = {
    "greedy_head": ("auto", "float32", "bf16", "int8"),
    "cpu_kernels": ("auto", "off", "on"),
    "adam_kernel": ("auto", "forloop", "foreach", "fused"),  # torch's three Adam implementations
    "direct_io": ("auto", "off", "on"),  # O_DIRECT file I/O (aio engine, NVMe offload)
    "block_quant": ("auto", "torch", "c"),  # ZeRO++ block quantization (ops/block_quant_kernel.py)
    "packed_linear": ("auto", "off", "on"),  # oneDNN's float32 linear on packed weights (ops/packed_linear.py)
}

ENV_VAR = "ZEROSPEED_FAST_PATHS"


class FastPathError(ValueError):
    """A fast-path switch has a bad value, or forces a candidate this machine cannot run."""


@dataclass(frozen=True)
class Candidate:
    """One implementation: ``run`` executes it once on representative inputs (None when it cannot run
    here, with ``why_not`` saying why). ``setup``, if given, runs before each measured call and is not
    timed (e.g. evicting the caches, so that a kernel that streams its weight from memory in a real
    step is not timed on a weight the previous call left in L2)."""

    run: Callable[[], object] | None
    why_not: str = ""
    setup: Callable[[], object] | None = None


@dataclass(frozen=True)
class Choice:
    path: str
    shape_class: Hashable
    chosen: str
    setting: str
    reason: str  # "measured", "forced by greedy_head=int8", "only candidate", ...
    timings_ms: Mapping[str, float] = field(default_factory=dict)
    excluded: Mapping[str, str] = field(default_factory=dict)  # candidate -> why it was not timed

    def describe(self) -> str:
        times = ", ".join(f"{k} {v:.3g} ms" for k, v in self.timings_ms.items())
        out = f"{self.path}[{self.shape_class}]: {self.chosen} ({self.reason}{'; ' + times if times else ''})"
        if self.excluded:
            out += "; not used: " + "; ".join(f"{k}: {v}" for k, v in self.excluded.items())
        return out


def validate_setting(path: str, value: object, source: str | None = None) -> str:
    """``value`` as a setting of ``path``, or :class:`FastPathError` naming ``source`` (the config key
    or flag the user wrote; default: the path's name) and the allowed values."""
    if path not in PATHS:
        raise FastPathError(f"{source or path}: unknown fast path {path!r} (known: {', '.join(PATHS)})")
    allowed = PATHS[path]
    if not isinstance(value, str) or value not in allowed:
        raise FastPathError(f"{source or path}: {value!r} is not one of {', '.join(allowed)}")
    return value


def env_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The settings in ``ZEROSPEED_FAST_PATHS`` (``path=value`` pairs separated by commas), validated."""
    raw = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise FastPathError(f"{ENV_VAR}: {item!r} is not of the form path=value (e.g. greedy_head=float32)")
        name, value = name.strip(), value.strip()
        out[name] = validate_setting(name, value, f"{ENV_VAR}: {name}")
    return out


def resolve_setting(path: str, configured: str = "auto", source: str | None = None,
                    environ: Mapping[str, str] | None = None) -> str:
    """The effective setting: ``configured`` when it forces a candidate, else the environment's, else auto."""
    configured = validate_setting(path, configured, source)
    if configured != "auto":
        return configured
    return env_settings(environ).get(path, "auto")


def size_class(n: int) -> int:
    """The power of two at or above ``n`` (>= 1): shape classes for row counts and lengths."""
    return 1 << max(0, int(n) - 1).bit_length()


def _wall_clock(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def thread_cpu_clock(name: str, fn: Callable[[], object]) -> float:
    """A ``measure`` for single-threaded candidates: the CPU time of the calling thread, which time
    slices lost to other processes on a shared machine do not inflate (a wall clock does)."""
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


class FastPathChooser:
    """Chooses among candidates by timing them, once per ``(path, shape_class, setting)``.

    ``measure(name, fn) -> seconds`` runs ``fn`` once and returns its duration (default: wall clock;
    tests pass fake timings). ``repeats`` timed runs per candidate at most, within ``budget_s``."""

    def __init__(self, measure: Callable[[str, Callable[[], object]], float] | None = None, repeats: int = 5,
                 budget_s: float = 0.05, margin: float = 0.05) -> None:
        self._measure = measure or (lambda name, fn: _wall_clock(fn))
        self.repeats = repeats
        self.budget_s = budget_s
        self.margin = margin
        self._cache: dict[tuple, Choice] = {}
        # reentrant: a candidate may itself run code that makes a choice (the greedy head's float32 candidate
        # computes logits, whose packed_linear choice is made on first use)
        self._lock = threading.RLock()
        #: wall seconds spent deciding (measuring) so far: what choosing has cost this process
        self.seconds_deciding = 0.0

    def choose(self, path: str, shape_class: Hashable, candidates: Mapping[str, Candidate],
               setting: str = "auto", source: str | None = None, *,
               measure: Callable[[str, Callable[[], object]], float] | None = None,
               budget_s: float | None = None, hopeless: float | None = None) -> str:
        """The name of the candidate to run. ``candidates`` in preference order, the reference first;
        ``setting`` is the switch's value (see :func:`resolve_setting`). ``measure`` / ``budget_s``
        replace the chooser's for this decision (e.g. :func:`thread_cpu_clock` for single-threaded
        candidates). ``hopeless``: a candidate whose warm-up alone took more than the budget and more
        than ``hopeless`` times the fastest warm-up is not run again (its warm-up time stands as its
        timing): an op 100x slower than the reference costs one call, not the whole budget."""
        return self.choice(path, shape_class, candidates, setting, source, measure=measure, budget_s=budget_s,
                           hopeless=hopeless).chosen

    def choice(self, path: str, shape_class: Hashable, candidates: Mapping[str, Candidate],
               setting: str = "auto", source: str | None = None, *,
               measure: Callable[[str, Callable[[], object]], float] | None = None,
               budget_s: float | None = None, hopeless: float | None = None) -> Choice:
        setting = validate_setting(path, setting, source)
        key = (path, shape_class, setting)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                return hit
            t0 = time.perf_counter()
            made = self._decide(path, shape_class, candidates, setting, source, measure or self._measure,
                                self.budget_s if budget_s is None else budget_s, hopeless)
            self.seconds_deciding += time.perf_counter() - t0
            self._cache[key] = made
        log.info("zerospeed fast path %s", made.describe())
        return made

    def _decide(self, path: str, shape_class: Hashable, candidates: Mapping[str, Candidate], setting: str,
                source: str | None, measure: Callable[[str, Callable[[], object]], float] | None = None,
                budget_s: float | None = None, hopeless: float | None = None) -> Choice:
        measure = measure or self._measure
        budget_s = self.budget_s if budget_s is None else budget_s
        if not candidates:
            raise FastPathError(f"{path}: no candidates given")
        names = list(candidates)
        excluded = {n: c.why_not or "not available" for n, c in candidates.items() if c.run is None}
        if setting != "auto":
            if setting not in candidates:
                raise FastPathError(f"{source or path}: {setting!r} does not apply here (candidates: "
                                    f"{', '.join(names)})")
            if setting in excluded:
                raise FastPathError(f"{source or path}: {setting!r} cannot run on this machine: {excluded[setting]}")
            return Choice(path, shape_class, setting, setting, f"forced by {source or path}={setting}")
        live = [n for n in names if n not in excluded]
        if not live:
            raise FastPathError(f"{path}: no candidate can run here: "
                                + "; ".join(f"{k}: {v}" for k, v in excluded.items()))
        if len(live) == 1:
            return Choice(path, shape_class, live[0], setting, "only candidate", {}, excluded)
        best: dict[str, float] = {}
        spent: dict[str, float] = {n: 0.0 for n in live}
        for n in list(live):  # warm-up: one-time costs (packing, page faults) are not the steady state
            try:
                if candidates[n].setup is not None:
                    candidates[n].setup()
                spent[n] += measure(n, candidates[n].run)
            except Exception as exc:  # a candidate that fails here is never chosen
                excluded[n] = f"failed when measured: {type(exc).__name__}: {exc}"
                live.remove(n)
        if hopeless is not None and live:
            fastest = min(spent[n] for n in live)
            for n in live:
                if spent[n] > budget_s and spent[n] > hopeless * fastest:
                    best[n] = spent[n]
        for _ in range(self.repeats):
            for n in list(live):
                if best.get(n) is not None and spent[n] >= budget_s:
                    continue
                try:
                    if candidates[n].setup is not None:
                        candidates[n].setup()
                    t = measure(n, candidates[n].run)
                except Exception as exc:
                    excluded[n] = f"failed when measured: {type(exc).__name__}: {exc}"
                    live.remove(n)
                    best.pop(n, None)
                    continue
                spent[n] += t
                best[n] = t if n not in best else min(best[n], t)
        if not best:
            return Choice(path, shape_class, names[0], setting, "every candidate failed; the reference", {},
                          excluded)
        chosen = min(best, key=lambda n: (best[n], names.index(n)))
        if names[0] in best and chosen != names[0] and best[names[0]] <= best[chosen] * (1 + self.margin):
            chosen = names[0]
        return Choice(path, shape_class, chosen, setting, "measured",
                      {n: best[n] * 1e3 for n in names if n in best}, excluded)

    def report(self) -> list[Choice]:
        """Every choice made so far, in the order made."""
        with self._lock:
            return list(self._cache.values())

    def reset(self) -> None:
        with self._lock:
            self._cache.clear()


_default = FastPathChooser()


def default_chooser() -> FastPathChooser:
    """The process-wide chooser (choices are cached for the life of the process)."""
    return _default


def report() -> list[dict]:
    """The process-wide choices as plain dicts (for benchmark results and start-up logs)."""
    return [{"path": c.path, "shape_class": str(c.shape_class), "chosen": c.chosen, "setting": c.setting,
             "reason": c.reason, "timings_ms": dict(c.timings_ms), "excluded": dict(c.excluded)}
            for c in _default.report()]
