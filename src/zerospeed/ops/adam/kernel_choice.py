"""Which Adam implementation runs: the ``adam_kernel`` fast path, chosen by timing it.

torch has three implementations of the same Adam/AdamW update (:data:`~zerospeed.ops.adam.kernel.KERNELS`):
the single-tensor for-loop (the reference, the plain path), the multi-tensor ``foreach`` one and the
one-pass ``fused`` kernel. Which is fastest depends on the machine and on the shapes: on this
project's 2-core AVX-512 box, 1 Mi fp32 elements in 8 tensors took 2.7 ms (for-loop), 2.8 ms
(foreach) and 0.8 ms (fused), while on CUDA foreach and fused are both far ahead of the for-loop. So
nothing here assumes: :func:`choose_adam_kernel` times each candidate that can run through
:class:`zerospeed.ops.fast_paths.FastPathChooser` (once per process and shape class, the for-loop
kept within the 5% noise margin) unless the switch forces one.

* Availability is a capability probe: ``fused`` runs torch's fused kernel once on a one-element
  tensor of the device and dtype (it is missing for some devices and dtypes); the other two are plain
  torch ops and always run.
* Speed is measured on synthetic tensors (never on the optimizer's own state), once per process for
  each device and parameter / state dtypes (:func:`shape_of` says why not per size: the families
  differ in rounding, and one run must not mix them on a timing coin toss): 8 tensors of 128 Ki
  elements, bigger than the caches, so the per-element cost is the steady one. Measured cost of one
  choice on this project's 2-core box (load ~2.5): 45-85 ms, once per process; fused won every size
  tried (4 x 4 Ki to 32 x 32 Ki elements) by 4-8x (e.g. 8 x 128 Ki: 0.62 ms against 2.7-3.3 ms).
* Results: for-loop and foreach are bit-identical on CPU (same operations, same order); fused differs
  in rounding order (up to about 1 ulp of the parameter per step). Within a family, zerospeed's run
  equals torch's optimizer of that family.

Who uses it: :class:`~zerospeed.ops.adam.CPUAdam` and the offload tier (``adam_update(kernel=)``), and
:class:`AdamKernelSwitch`, which sets torch's ``foreach``/``fused`` flags on a torch Adam/AdamW
(the optimizer built from the config, :class:`~zerospeed.ops.adam.FusedAdam`) - at its first step,
or earlier when the engine settles it (so that data-parallel replicas agree, see
:mod:`zerospeed.runtime.fast_paths`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zerospeed.ops.adam.kernel import (
    DEFAULT_CHUNK_NUMEL,
    KERNELS,
    AdamHyperParams,
    AdamThreadPool,
    Item,
    _run_task,
    adam_update,
)
from zerospeed.ops.fast_paths import Candidate, FastPathChooser, FastPathError, default_chooser, resolve_setting
from zerospeed.ops import fast_paths

__all__ = ["AdamKernelSwitch", "AdamShape", "PATH", "attach_switch", "check_forced", "choose_adam_kernel",
           "fused_unavailable", "kernel_of_flags", "resolve_kernel_setting", "shape_of", "switch_of"]

PATH = "adam_kernel"
#: the measured sample holds at most this many elements (see the module docstring)
SAMPLE_NUMEL = 1 << 20
#: the canonical sample's tensor count (see :func:`shape_of`)
CANONICAL_TENSORS = 8

_probe_lock = threading.Lock()
_fused_probe: dict[tuple[str, torch.dtype], str] = {}


def resolve_kernel_setting(value: object, source: str) -> str:
    """``value`` as an ``adam_kernel`` setting (``ZEROSPEED_FAST_PATHS`` fills in ``auto``), or a
    :class:`FastPathError` naming ``source``."""
    return resolve_setting(PATH, value, source)  # type: ignore[arg-type]


def fused_unavailable(device: torch.device | str, dtype: torch.dtype) -> str:
    """Why torch's fused Adam kernel cannot run on ``device`` with ``dtype`` ("" when it can)."""
    device = torch.device(device)
    key = (device.type, dtype)
    with _probe_lock:
        if key in _fused_probe:
            return _fused_probe[key]
    why = ""
    if not dtype.is_floating_point:
        why = f"{dtype} is not a floating-point dtype"
    elif not hasattr(torch, "_fused_adamw_"):
        why = f"torch {torch.__version__} has no fused Adam kernel"
    else:
        try:
            t = [torch.zeros(1, dtype=dtype, device=device) for _ in range(4)]
            torch._fused_adamw_([t[0]], [t[1]], [t[2]], [t[3]], [], [torch.ones((), device=device)], lr=1e-3,
                                beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
        except Exception as exc:  # noqa: BLE001 - any refusal means "not here"
            why = f"torch's fused Adam kernel refused {device.type}/{dtype}: {type(exc).__name__}: {exc}"
    with _probe_lock:
        _fused_probe[key] = why
    return why


@dataclass(frozen=True)
class AdamShape:
    """The shape class of one Adam update (see the module docstring)."""

    device: str
    dtype: str
    state_dtype: str
    pooled: bool
    num_tensors: int  # power of two, <= 32
    numel: int  # typical elements per tensor, power of two

    def __str__(self) -> str:
        return f"{self.device} {self.dtype}/{self.state_dtype}, timed on {self.num_tensors} x {self.numel} elements"


def shape_of(numels: Sequence[int], device: torch.device | str, dtype: torch.dtype, state_dtype: torch.dtype,
             pooled: bool, chunk_numel: int = DEFAULT_CHUNK_NUMEL) -> AdamShape:
    """The shape class an update of tensors of ``numels`` elements is decided in: one per device and
    dtypes, measured on a canonical sample (:data:`CANONICAL_TENSORS` tensors of
    ``SAMPLE_NUMEL / CANONICAL_TENSORS`` elements, one call), whatever ``numels`` and ``pooled`` are.

    Why not a class per size: the families differ in rounding (fused against for-loop: about 1 ulp
    per step), so a per-size choice could give two optimizers of one run, or an offloaded and a
    device-side step of the same model, different arithmetic on a timing coin toss, and a resumed run
    other bits than the run it resumes. Measured here, the ranking did not depend on the size
    (fused won every class from 4 x 4 Ki to 32 x 32 Ki elements by 4-8x), so one decision per device
    and dtypes loses nothing and makes every update of a process run one family."""
    del numels, pooled, chunk_numel  # documented above: the decision does not depend on them
    return AdamShape(torch.device(device).type, str(dtype).removeprefix("torch."),
                     str(state_dtype).removeprefix("torch."), False, CANONICAL_TENSORS,
                     SAMPLE_NUMEL // CANONICAL_TENSORS)


def _sample(shape: AdamShape, amsgrad: bool) -> list[Item]:
    dtype = getattr(torch, shape.dtype)
    state_dtype = getattr(torch, shape.state_dtype)
    items: list[Item] = []
    for _ in range(shape.num_tensors):  # ordinary values (no zeros, no denormals); the kernels' cost ignores them
        p = torch.linspace(-0.1, 0.1, shape.numel).add_(0.3).to(shape.device, dtype)
        grad = torch.linspace(1.0, -0.5, shape.numel).to(shape.device, dtype)
        m = torch.zeros(shape.numel, dtype=state_dtype, device=shape.device)
        v = torch.zeros_like(m)
        items.append((p, grad, m, v, torch.zeros_like(m) if amsgrad else None, torch.ones((), dtype=torch.float32)))
    return items


def choose_adam_kernel(setting: str, shape: AdamShape, *, amsgrad: bool = False, source: str | None = None,
                       pool: AdamThreadPool | None = None, chunk_numel: int = DEFAULT_CHUNK_NUMEL,
                       chooser: FastPathChooser | None = None) -> str:
    """The kernel to run updates of ``shape`` with: ``setting`` when it forces one (an error naming
    ``source`` when that one cannot run here), else the fastest measured (cached per shape class)."""
    own_clock = chooser is None
    chooser = chooser or default_chooser()
    why_fused = fused_unavailable(shape.device, getattr(torch, shape.state_dtype))
    items: list[list[Item]] = []  # built at the first measured run only (a forced or cached choice builds none)
    hp = AdamHyperParams(lr=1e-3, weight_decay=0.01, amsgrad=amsgrad)

    def runner(kernel: str) -> Callable[[], None]:
        def run() -> None:
            if not items:
                items.append(_sample(shape, amsgrad))
            if shape.pooled:
                adam_update(items[0], hp, pool=pool, chunk_numel=chunk_numel, kernel=kernel)
            else:
                _run_task(items[0], hp, kernel)
            if shape.device == "cuda":  # time the work, not its launch
                torch.cuda.synchronize()
        return run

    candidates = {k: Candidate(None, why_fused) if k == "fused" and why_fused else Candidate(runner(k))
                  for k in KERNELS}
    # one thread doing all the work (no pool, one torch thread, CPU): its CPU time, which time slices lost to other
    # processes do not inflate, so a loaded machine does not flip the choice from one run to the next (the families
    # differ by an ulp, and runs compared bit for bit across processes must agree); otherwise the wall clock
    # (a chooser passed in keeps its own clock)
    single = shape.device == "cpu" and not shape.pooled and torch.get_num_threads() == 1
    return chooser.choose(PATH, shape, candidates, setting, source,
                          measure=fast_paths.thread_cpu_clock if single and own_clock else None)


def check_forced(setting: str, tensors: Sequence[Any], source: str) -> None:
    """An error naming ``source`` when ``setting`` forces a family that cannot run on ``tensors``
    (their first tensor's device and dtype); nothing for ``auto`` or no tensors."""
    tensors = [t for t in tensors if torch.is_tensor(t)]
    if setting == "auto" or not tensors:
        return
    first = tensors[0]
    choose_adam_kernel(setting, shape_of([t.numel() for t in tensors], first.device, first.dtype, first.dtype,
                                         pooled=False), source=source)


def kernel_of_flags(foreach: Any, fused: Any) -> str | None:
    """The family a torch optimizer's ``foreach``/``fused`` flags ask for (None: left to torch)."""
    if fused:
        return "fused"
    if foreach:
        return "foreach"
    if foreach is False and not fused:
        return "forloop"
    return None


# ---------------------------------------------------------------------------------------------------
# torch Adam/AdamW: the switch owns the foreach/fused flags of one optimizer


def _served(optimizer: torch.optim.Optimizer, exclude: Iterable[int] = ()) -> list[torch.Tensor]:
    skip = set(exclude)
    return [p for g in optimizer.param_groups for p in g["params"]
            if torch.is_tensor(p) and p.is_floating_point() and id(p) not in skip]


class AdamKernelSwitch:
    """The ``adam_kernel`` choice of one torch Adam/AdamW (or CPU Adam) optimizer.

    ``setting`` forces a family or is ``auto``; ``kernel`` is the family in use once settled. A torch
    optimizer is settled at its first ``step()`` (a step pre-hook measures on the tensors of its param
    groups then) unless :meth:`settle` ran before (the engine settles at start-up, with the tensors a
    ZeRO stage has put in the groups, and makes replicas agree). The flags are re-applied before every
    step, so a ``load_state_dict`` of another machine's param groups does not switch families.
    It holds no reference to the optimizer (the registry is keyed by it, weakly).
    """

    def __init__(self, setting: str, source: str, pooled: bool = False, chunk_numel: int = DEFAULT_CHUNK_NUMEL) -> None:
        self.setting = setting
        self.source = source
        self.pooled = pooled
        self.chunk_numel = chunk_numel
        self.kernel: str | None = None
        self.reason = ""

    def force(self, setting: str, source: str) -> None:
        """A forcing setting from another place (the engine config); two different forced values
        are an error naming both."""
        if setting == "auto" or setting == self.setting:
            return
        if self.setting != "auto":
            raise FastPathError(f"{source}: {setting!r} conflicts with {self.source}={self.setting!r}; set one")
        self.setting, self.source, self.kernel = setting, source, None

    def shape(self, optimizer: torch.optim.Optimizer, exclude: Iterable[int] = ()) -> AdamShape | None:
        tensors = _served(optimizer, exclude)
        if not tensors:
            return None
        first = tensors[0]
        state_dtype = torch.float32 if getattr(optimizer, "fp32_optimizer_states", False) and \
            first.element_size() < 4 else first.dtype
        return shape_of([t.numel() for t in tensors], first.device, first.dtype, state_dtype, self.pooled,
                        self.chunk_numel)

    def measure(self, optimizer: torch.optim.Optimizer, exclude: Iterable[int] = ()) -> str | None:
        """The family this machine should run (forced, or measured now); None with nothing to update."""
        shape = self.shape(optimizer, exclude)
        if shape is None:
            return None
        amsgrad = any(g.get("amsgrad", False) for g in optimizer.param_groups)
        pool = AdamThreadPool.shared(max(1, torch.get_num_threads())) if self.pooled else None
        return choose_adam_kernel(self.setting, shape, amsgrad=amsgrad, source=self.source, pool=pool,
                                  chunk_numel=self.chunk_numel)

    def settle(self, optimizer: torch.optim.Optimizer, kernel: str | None = None, reason: str = "") -> str | None:
        """Fix the family (``kernel``, e.g. rank 0's choice, or measured now) and apply it."""
        if kernel is None:
            kernel = self.measure(optimizer)
            reason = reason or ("forced" if self.setting != "auto" else "measured")
        if kernel is None:
            return None
        self.kernel, self.reason = kernel, reason
        self.apply(optimizer)
        return kernel

    def apply(self, optimizer: torch.optim.Optimizer) -> None:
        if self.kernel is None or self.pooled:  # CPU Adam reads self.kernel itself
            return
        for group in optimizer.param_groups:
            group["foreach"] = self.kernel == "foreach"
            group["fused"] = self.kernel == "fused"
            if self.kernel == "fused":  # torch's fused step wants its step counters on the params' device
                for p in group["params"]:
                    state = optimizer.state.get(p)
                    step = state.get("step") if state else None
                    if torch.is_tensor(step) and (step.device != p.device or step.dtype != torch.float32):
                        state["step"] = step.to(p.device, torch.float32)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.kernel is None:
            self.settle(optimizer)
        else:
            self.apply(optimizer)


_switches: weakref.WeakKeyDictionary[torch.optim.Optimizer, AdamKernelSwitch] = weakref.WeakKeyDictionary()


def attach_switch(optimizer: torch.optim.Optimizer, setting: str, source: str, *, pooled: bool = False,
                  chunk_numel: int = DEFAULT_CHUNK_NUMEL) -> AdamKernelSwitch:
    """Give ``optimizer`` an :class:`AdamKernelSwitch` (a torch Adam/AdamW gets a step pre-hook that
    settles and applies it; a CPU Adam, ``pooled``, reads ``switch.kernel`` in its own step)."""
    switch = AdamKernelSwitch(setting, source, pooled, chunk_numel)
    if setting != "auto":  # forced: checked (an error naming the switch if it cannot run) and applied now
        switch.settle(optimizer)
    if not pooled:
        optimizer.register_step_pre_hook(switch._before_step)
    _switches[optimizer] = switch
    return switch


def switch_of(optimizer: Any) -> AdamKernelSwitch | None:
    """The switch of ``optimizer``: its own (CPU Adam, FusedAdam) or one zerospeed attached; None if neither."""
    own = getattr(optimizer, "kernel_switch", None)
    if isinstance(own, AdamKernelSwitch):
        return own
    try:
        return _switches.get(optimizer)
    except TypeError:
        return None
