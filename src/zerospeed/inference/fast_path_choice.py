"""Which hardware-specific fast paths an inference model runs, chosen by measurement (issue #25).

Two switches, each ``auto`` (measure), or a forced value (see :data:`zerospeed.ops.fast_paths.PATHS`):

* ``cpu_kernels`` ``auto|on|off``: zerospeed's C kernels (:mod:`~zerospeed.inference.cpu_kernel`) against
  their torch twins, per *kernel family* and shape class: ``attention`` (decode attention from the
  paged cache, with the rotary and cache writes of a layer, against gather + SDPA), ``rms_norm``,
  ``silu_mul`` (SwiGLU's gate), ``skinny_gemm`` (the packed GEMM of few-row linears, against MKL),
  ``greedy_refine`` and ``int8_rows`` (the approximate greedy heads' candidate pass and int8
  activation side). ``off``: plain torch everywhere. ``on``: the C kernels wherever they apply by the
  fixed rules measured when they were written (the skinny GEMM for 2-24 rows and the single-threaded
  kernels only with one torch thread), or an error naming the switch when they do not build.
  ``auto``: a family runs in C where the kernels build *and* the C kernel was measured faster than its
  twin on the shape class it serves (below). The C kernels apply to float32 on CPU only.
* ``greedy_head`` ``auto|float32|bf16|int8``: how greedy rows get their tokens from the LM head:
  ``float32`` logits and argmax (the reference, what sampling computes), or a bfloat16 / int8 copy of
  the head whose approximate logits select candidates within a proven bound, refined in float32
  (:meth:`CausalLM.greedy_tokens`; the same tokens whichever runs). A head is *available* when its op
  runs here (bfloat16 ``torch.mm`` / oneDNN; oneDNN's int8 linear exists and its probe gives the exact
  integer products); whether it is *fast* is measured: the whole greedy-token computation of each
  candidate on representative rows of the served shape class.

Shape classes: rows rounded up to a power of two (:func:`~zerospeed.ops.fast_paths.size_class`), with
the weight shapes and the torch thread count; attention by decode count and longest context (or, with
no decodes, the token count). A choice is made once per process and class by
:func:`zerospeed.ops.fast_paths.default_chooser` (timed, cached, logged by ``zerospeed.fast_paths``)
and cached again per model in a plain dict, so a forward pays one dict lookup for its
:class:`KernelPlan` (measured: see :meth:`~zerospeed.inference.forward_plan.ForwardPlanner.plan`) and a
greedy step one for its head.
The engine measures a few classes eagerly at build (1 row and the decode batch class) and reports
them in one log line (:meth:`~zerospeed.inference.forward_plan.ForwardPlanner.report`, in forward_plan.py: it
times the model's layers, which read their plans from here); other classes are measured when first served.

With tensor parallelism in SPMD mode (``init_inference``, every rank samples) ranks must make the same
choice, and timings differ per rank: there ``auto`` is not measured (the caller passes ``on`` or
``off`` for the kernels and ``float32`` for the head; see :mod:`zerospeed.inference.v1`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from zerospeed.inference import cpu_kernel
from zerospeed.ops import packed_linear
from zerospeed.ops.fast_paths import Candidate, FastPathError, default_chooser, resolve_setting, thread_cpu_clock

log = logging.getLogger("zerospeed")

#: ``cpu_kernels=on``: the skinny GEMM for this many rows (inclusive; measured when it was written,
#: see models/layers.py), and only with one torch thread, as SwiGLU's gate.
ON_SKINNY_ROWS = (2, 24)
#: ``cpu_kernels=auto`` measures the skinny GEMM up to this many rows (beyond, MKL's blocked GEMM is
#: what the kernel was never meant to beat, and measuring big classes would cost start-up time)
AUTO_SKINNY_MAX_ROWS = 64
#: the synthetic K/V of an attention measurement is at most this many bytes per cache (sequences
#: beyond share blocks): larger than the caches, as a step's K/V reads are, without allocating a
#: whole batch's contexts for classes of hundreds of sequences
ATTENTION_PROBE_BYTES = 8 << 20
#: time one candidate may take to be measured (warm-up included; at least one timed run after it): the
#: float32 head of 16 rows over a 32000 x 256 vocabulary takes ~5 ms a call, a kernel family's
#: candidates from 0.01 to ~2.5 ms (attention of 16 sequences of 512 tokens in torch)
BUDGET_S = {"greedy_head": 0.015, "cpu_kernels": 0.005, "packed_linear": 0.01}


#: a candidate whose warm-up took this many times the fastest one's (and more than the budget) is not
#: timed further; a greedy head this many times slower than the best at k rows is not tried at 2k rows
#: (under an AVX2 cap the bfloat16 head took 15 ms at 2 rows against 5 for float32, and doubled with the
#: rows: measuring it at 32 rows cost 0.4 s)
HOPELESS = 4.0


@contextmanager
def quiet_choices() -> Iterator[None]:
    """Hold back the chooser's per-choice INFO lines (logger ``zerospeed.fast_paths``) while an engine
    starts: its one start-up line reports them. Unless a user set that logger's level: theirs to decide.
    Choices made later (shape classes first served) are logged by the chooser when made."""
    chooser_log = logging.getLogger("zerospeed.fast_paths")
    if chooser_log.level != logging.NOTSET:
        yield
        return
    chooser_log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        chooser_log.setLevel(logging.NOTSET)


def choose(path: str, shape_class: tuple, candidates: dict[str, Candidate], setting: str, source: str) -> str:
    """The name :func:`choice` picks."""
    return choice(path, shape_class, candidates, setting, source).chosen


def choice(path: str, shape_class: tuple, candidates: dict[str, Candidate], setting: str, source: str):
    """:meth:`FastPathChooser.choice` of the process's chooser, timed in this thread's CPU time when
    torch runs one thread (every candidate then runs in this thread: time slices lost to other
    processes on a shared machine do not count), else in wall time; within :data:`BUDGET_S`, a
    :data:`HOPELESS` candidate timed once."""
    measure = thread_cpu_clock if torch.get_num_threads() == 1 else None
    return default_chooser().choice(path, shape_class, candidates, setting, source, measure=measure,
                                    budget_s=BUDGET_S[path], hopeless=HOPELESS)


@dataclass(frozen=True)
class KernelPlan:
    """The C kernels one forward uses; every False / absent family runs its torch twin."""

    attention: bool = False
    rms_norm: bool = False
    silu_mul: bool = False
    skinny: frozenset = frozenset()  # weight shapes (N, K) whose linears go through the skinny GEMM
    skinny_all: bool = False  # every linear the skinny GEMM can take (cpu_kernels=on's rule)
    packed: frozenset = frozenset()  # weight shapes (N, K) whose linears run on oneDNN's packed weight
    any: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "any", bool(self.attention or self.rms_norm or self.silu_mul or self.skinny
                                             or self.skinny_all or self.packed))

    def use_skinny(self, weight: torch.Tensor) -> bool:
        return self.skinny_all or weight.shape in self.skinny

    def use_packed(self, weight: torch.Tensor) -> bool:
        return weight.shape in self.packed

    def describe(self) -> str:
        fams = [f"attention {'C' if self.attention else 'torch'}", f"rms_norm {'C' if self.rms_norm else 'torch'}",
                f"silu_mul {'C' if self.silu_mul else 'torch'}"]
        if self.skinny_all:
            fams.append("skinny_gemm C")
        elif self.skinny:
            fams.append("skinny_gemm C for " + ", ".join(f"{n}x{k}" for n, k in sorted(self.skinny)))
        else:
            fams.append("skinny_gemm torch")
        if self.packed:
            fams.append("packed_linear for " + ", ".join(f"{n}x{k}" for n, k in sorted(self.packed)))
        return ", ".join(fams)


OFF = KernelPlan()


def legacy_plan(on: bool) -> KernelPlan:
    """What ``AttentionMetadata.build(decode_kernel=on)`` meant before plans existed: every kernel by
    ``cpu_kernels=on``'s rules for the current thread count (the skinny GEMM's row rule is applied by
    :func:`~zerospeed.inference.models.layers.cpu_linear` then), or none."""
    if not on:
        return OFF
    one = torch.get_num_threads() == 1
    return KernelPlan(attention=True, rms_norm=True, silu_mul=one, skinny_all=one)


class _TimedSwitch:
    """One model's on / off / auto switch of a fast path (``path``): its setting, whether the path can run here
    at all (``live``, else ``why`` not), and per shape class whether it runs (:meth:`_decide`).

    ``applies``: the model computes in float32 on CPU (else the path cannot run: ``on`` is an error, ``auto`` is
    the plain path). ``on`` where the path is not available is an error naming ``source``."""

    path = ""
    unavailable = ""  # completes "{source}: 'on' but ..." when :meth:`_available` says no

    def __init__(self, setting: str = "auto", *, source: str = "", applies: bool = True,
                 why_not_applies: str = "") -> None:
        source = source or self.path
        self.setting = resolve_setting(self.path, setting, source)
        self.source = source
        self.live, self.why = False, ""
        self._cache: dict[tuple, bool] = {}
        if self.setting == "off":
            self.why = f"{source}=off"
        elif not applies:
            if self.setting == "on":
                raise FastPathError(f"{source}: 'on' needs float32 on CPU ({why_not_applies})")
            self.why = why_not_applies
        else:
            ok, why = self._available()
            if not ok and self.setting == "on":
                raise FastPathError(f"{source}: 'on' but {self.unavailable}: {why}")
            self.live, self.why = ok, why

    def _available(self) -> tuple[bool, str]:
        raise NotImplementedError

    def _decide(self, key: tuple, candidates: Callable[[], dict[str, Candidate]]) -> bool:
        """Never when not live, always with ``on``, else measured once per ``key`` (``candidates()`` is called
        only then: ``{"off": the plain path, "on": the fast one}``)."""
        if not self.live:
            return False
        if self.setting == "on":
            return True
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = choose(self.path, key, candidates(), "auto", self.source) == "on"
        return hit


class CpuKernels(_TimedSwitch):
    """The ``cpu_kernels`` switch of one model (:class:`_TimedSwitch`): zerospeed's C kernels per kernel family
    and shape class (:meth:`use`)."""

    path = "cpu_kernels"
    unavailable = "the C kernels could not be built"

    def _available(self) -> tuple[bool, str]:
        if self.setting == "on":
            cpu_kernel.kernel_isa()  # a bad ZEROSPEED_KERNEL_ISA is an error naming it, not a fallback
        return cpu_kernel.available()

    def describe(self) -> str:
        if self.live:
            state = cpu_kernel.describe()
        elif self.setting == "off":
            state = "plain torch"
        else:
            state = f"not used: {self.why}" if self.why else "not used"
        return f"cpu_kernels={self.setting} ({state})"

    def use(self, family: str, shape_class: tuple, candidates: Callable[[], dict[str, Candidate]]) -> bool:
        """Whether ``family`` runs in C on ``shape_class`` (``candidates()``: ``{"off": torch twin, "on": C}``)."""
        return self._decide((family, *shape_class), candidates)


class PackedLinears(_TimedSwitch):
    """The ``packed_linear`` switch of one model: float32 CPU linears (the decoder blocks' and the LM head's)
    on weights packed once for oneDNN (:mod:`zerospeed.ops.packed_linear`) or the plain path. ``off``: never;
    ``on``: every float32 linear it can take (an error naming ``source`` where oneDNN's float32 linear does
    not run here); ``auto``: per weight shape and rows class where it was timed faster than the path it
    would replace (:meth:`use`)."""

    path = "packed_linear"
    unavailable = "oneDNN's packed float32 linear cannot run here"

    def _available(self) -> tuple[bool, str]:
        return packed_linear.available()

    def describe(self) -> str:
        state = "oneDNN" if self.live else (f"not used: {self.why}" if self.why else "not used")
        return f"packed_linear={self.setting} ({state})"

    def use(self, shape_class: tuple, candidates: Callable[[], dict[str, Candidate]]) -> bool:
        """Whether the linear of ``shape_class`` runs packed (``candidates()``: ``{"off": plain, "on": packed}``)."""
        return self._decide(shape_class, candidates)

    def packed_head_used(self) -> bool:
        """Whether some rows class chose the packed LM head so far (else its copy, made to be measured, may go)."""
        return self.setting == "on" or any(v for k, v in self._cache.items() if k[0] == "lm_head")


def model_packed(model: Any) -> PackedLinears:
    """The model's :class:`PackedLinears` (set by the engine; for a bare model, ``auto`` made on first use)."""
    p = model.__dict__.get("_packed_linears")
    if p is None:
        w = getattr(getattr(model, "lm_head", None), "weight", None)
        applies = w is not None and w.device.type == "cpu" and w.dtype == torch.float32
        p = model.__dict__["_packed_linears"] = PackedLinears("auto", applies=applies,
                                                              why_not_applies="not float32 on CPU")
    return p


def set_model_packed(model: Any, packed: PackedLinears) -> None:
    model.__dict__["_packed_linears"] = packed


def packed_pair(plain: Callable[[], object], packed_fn: Callable[[], object], evict: bool) -> dict[str, Candidate]:
    """The plain path (the incumbent) and the packed one as the chooser's candidates."""
    setup = evict_caches if evict else None
    return {"off": Candidate(plain, setup=setup), "on": Candidate(packed_fn, setup=setup)}


def model_kernels(model: Any) -> CpuKernels:
    """The model's :class:`CpuKernels` (set by the engine; for a bare model, ``auto`` made on first use)."""
    k = model.__dict__.get("_cpu_kernels")
    if k is None:
        w = getattr(getattr(model, "lm_head", None), "weight", None)
        applies = w is not None and w.device.type == "cpu" and w.dtype == torch.float32
        k = CpuKernels("auto", applies=applies, why_not_applies="not float32 on CPU")
        model.__dict__["_cpu_kernels"] = k
    return k


def set_model_kernels(model: Any, kernels: CpuKernels) -> None:
    model.__dict__["_cpu_kernels"] = kernels
    model.__dict__.pop("_greedy_choices", None)  # the heads' C parts follow the kernels: choose again


def _pair(torch_fn: Callable[[], object], c_fn: Callable[[], object], evict: bool = False,
          c_first: bool = False) -> dict[str, Candidate]:
    """The torch twin and the C kernel as candidates; the first is the incumbent, which the other must
    beat by the chooser's margin (5%): torch, unless ``c_first``."""
    setup = evict_caches if evict else None
    pair = {"off": Candidate(torch_fn, setup=setup), "on": Candidate(c_fn, setup=setup)}
    return {"on": pair["on"], "off": pair["off"]} if c_first else pair


_evict_buf: list[torch.Tensor] = []


def evict_caches() -> None:
    """Read a buffer of twice this core's L2 (at least 4 MiB), so that the next timed call finds its
    weight where a decode step finds it (beyond L2: between two uses of a layer's weight a step reads
    every other weight and the K/V). Costs ~0.2 ms, outside the timing (``Candidate.setup``)."""
    if not _evict_buf:
        try:
            l2 = int(os.sysconf("SC_LEVEL2_CACHE_SIZE"))
        except (ValueError, OSError, AttributeError):
            l2 = 0
        _evict_buf.append(torch.ones(max(2 * l2, 4 << 20) // 4))
    _evict_buf[0].sum()


# ----------------------------------------------------------------------------- the greedy head

def representative_hidden(model: Any, rows: int) -> torch.Tensor:
    """``[rows, H]`` float32 rows shaped like the LM head's input: a final norm's output (unit RMS
    times the norm's weight, plus its bias) where the model has one, else standard normal."""
    w = model.lm_head.weight
    h = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
    norm = getattr(model, "norm", None) or getattr(model, "ln_f", None)
    nw = getattr(norm, "weight", None)
    if isinstance(nw, torch.Tensor) and nw.shape == (w.shape[1],) and nw.dtype == torch.float32:
        h = h * nw.detach()
        nb = getattr(norm, "bias", None)
        if isinstance(nb, torch.Tensor):
            h = h + nb.detach()
    return h


def _refine_candidates(rows: int, w: torch.Tensor, dtype: torch.dtype) -> Callable[[], dict[str, Candidate]]:
    """C ``greedy_refine`` against :func:`refine_torch` over the head ``w`` on synthetic approximate
    logits with ~24 candidates a row."""
    def make() -> dict[str, Candidate]:
        from zerospeed.inference.models import greedy_head

        vocab, h = w.shape
        g = torch.Generator().manual_seed(vocab)
        x = torch.randn(rows, h, generator=g)
        approx = torch.randn(rows, vocab, generator=g)
        err = (approx.amax(dim=1) - approx.topk(min(24, vocab), dim=1).values[:, -1]) / 2
        approx = approx.to(dtype)
        return _pair(lambda: greedy_head.refine_torch(approx, x, w, err, 2048),
                     lambda: cpu_kernel.greedy_refine(approx, x, w, err, 2048))
    return make


def _int8_rows_candidates(rows: int, h: int) -> Callable[[], dict[str, Candidate]]:
    def make() -> dict[str, Candidate]:
        from zerospeed.inference.models import greedy_head

        x = torch.randn(rows, h, generator=torch.Generator().manual_seed(h))
        consts = (1e-3, 1e-2, 1.0, 0.1)
        return _pair(lambda: greedy_head.activation_rows(x, consts), lambda: cpu_kernel.int8_rows(x, consts))
    return make


@dataclass(frozen=True)
class GreedyChoice:
    head: str  # "float32", "bf16" or "int8"
    c_int8_rows: bool  # the int8 head's activation side in C
    c_refine: bool  # the candidates' pass of the chosen approximate head in C


def choose_greedy_head(model: Any, rows_class: int, setting: str, source: str) -> GreedyChoice:
    """The greedy head for ``rows_class`` rows of ``model`` (float32 CPU head without bias): forced by
    ``setting``, or measured (:func:`zerospeed.ops.fast_paths.default_chooser`); a forced head that
    cannot run here is a :class:`FastPathError` naming ``source``."""
    from zerospeed.inference.models import greedy_head

    setting = resolve_setting("greedy_head", setting, source)
    w = model.lm_head.weight
    vocab, h = w.shape
    threads = torch.get_num_threads()
    kernels = model_kernels(model)
    cand_rows = max(rows_class, 1)
    int8_ok, int8_why = greedy_head.int8_available()
    pruned = _pruned_heads(model, rows_class, threads) if setting == "auto" else {}
    bf16_ok = "bf16" not in pruned
    int8_ok, int8_why = (False, pruned["int8"]) if int8_ok and "int8" in pruned else (int8_ok, int8_why)
    c_bf16 = c_f32 = c_rows = False
    if bf16_ok or setting == "bf16":
        c_bf16 = kernels.use("greedy_refine", (rows_class, vocab, h, "bf16", threads),
                             _refine_candidates(cand_rows, w.detach(), torch.bfloat16))
    if int8_ok:
        c_f32 = kernels.use("greedy_refine", (rows_class, vocab, h, "float32", threads),
                            _refine_candidates(cand_rows, w.detach(), torch.float32))
        c_rows = kernels.use("int8_rows", (rows_class, h, threads), _int8_rows_candidates(cand_rows, h))
    hidden = representative_hidden(model, cand_rows)

    def int8_copy() -> object:  # built once (~0.1 s for 32000 x 256), outside the timing
        head = model._derived("_lm_head_int8", w, greedy_head.build_int8_head)
        if head is None:
            raise RuntimeError("oneDNN's int8 linear did not give the exact integer products on this head")
        return head

    candidates = {
        "float32": Candidate(lambda: model.compute_logits(hidden).max(dim=1).indices,
                             setup=lambda: model._lm_head_transposed(w) if cand_rows >= 3 else None),
        "bf16": Candidate(lambda: model._greedy_tokens_bf16(hidden, w, c_bf16), setup=lambda: model._lm_head_bf16(w))
        if bf16_ok else Candidate(None, pruned["bf16"]),
        "int8": Candidate(lambda: model._greedy_tokens_int8(hidden, w, int8_copy(), c_rows, c_f32), setup=int8_copy)
        if int8_ok else Candidate(None, int8_why),
    }
    shape_class = (rows_class, vocab, h, threads, c_bf16, c_f32, c_rows, int8_ok, bf16_ok)
    made = choice("greedy_head", shape_class, candidates, setting, source)
    if made.timings_ms:
        model.__dict__.setdefault("_greedy_timings", {})[(threads, rows_class)] = dict(made.timings_ms)
    return GreedyChoice(made.chosen, c_rows, c_f32 if made.chosen == "int8" else c_bf16)


def _pruned_heads(model: Any, rows_class: int, threads: int) -> dict[str, str]:
    """Heads measured :data:`HOPELESS` times slower than the best at the largest smaller row class of this
    model, with why (not tried again: they grow with the rows as fast as the best, or faster)."""
    timings = model.__dict__.get("_greedy_timings", {})
    below = [r for (t, r) in timings if t == threads and r < rows_class]
    if not below:
        return {}
    r = max(below)
    ms = timings[(threads, r)]
    best = min(ms, key=ms.get)
    return {n: f"{t / ms[best]:.0f}x slower than {best} at {r} rows ({t:.3g} ms against {ms[best]:.3g})"
            for n, t in ms.items() if n != "float32" and t > HOPELESS * ms[best]}
