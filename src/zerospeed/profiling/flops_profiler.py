"""The flops profiler: DeepSpeed's ``FlopsProfiler`` / ``get_model_profile`` API on torch's counter.

``FlopsProfiler(model)``: ``start_profile()`` begins counting (FLOPs through
:func:`zerospeed.profiling.counting.flop_counter`, forward latency through module hooks) and
``stop_profile()`` ends it; everything run in between counts, so a window around forward +
backward measures a training step, recomputation included. ``get_total_flops/macs/params/duration``,
``print_model_profile`` (summary, per-depth top modules, per-module tree) and ``end_profile``
(removes hooks, drops the results) follow DeepSpeed.

Decisions:

* Per-module rows: parameters (full size, also under ZeRO-3 where a rank holds a shard), MACs,
  FLOPs and forward latency (sum over calls in the window, CUDA-synchronised around each module
  while profiling). ``ignore_list`` (module types) removes those modules' FLOPs from every total.
* The summary states achieved FLOP/s (FLOPs of the window / its wall time) and MFU against
  ``peak_flops`` when given, else against a measured matmul probe (:mod:`zerospeed.profiling.peak`).
  FLOPs are this rank's: with data parallelism every rank does the same work on its micro-batch.
* ``recompute_fwd_factor`` is accepted for DeepSpeed compatibility and not used: recomputed forwards
  run inside the window and are counted as they run.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from typing import Any, Sequence, TextIO

import torch
from torch import nn

from zerospeed.profiling.counting import flop_counter, module_flops
from zerospeed.profiling.peak import measure_peak_flops


def _scaled(value: float, units: Sequence[tuple[float, str]], suffix: str, precision: int) -> str:
    for scale, prefix in units:
        if abs(value) >= scale:
            return f"{value / scale:.{precision}f} {prefix}{suffix}"
    return f"{value:.{precision}f} {suffix}".rstrip()


_SI = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def flops_to_string(flops: float, precision: int = 2) -> str:
    return _scaled(flops, _SI, "FLOPS", precision)


def macs_to_string(macs: float, precision: int = 2) -> str:
    return _scaled(macs, _SI, "MACs", precision)


def params_to_string(params: float, precision: int = 2) -> str:
    if abs(params) < 1e3:
        return str(int(params))
    return _scaled(params, _SI[2:], "", precision)


def rate_to_string(flops_per_s: float, precision: int = 2) -> str:
    return _scaled(flops_per_s, _SI, "FLOP/s", precision)


def duration_to_string(seconds: float, precision: int = 2) -> str:
    if seconds >= 1:
        return f"{seconds:.{precision}f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.{precision}f} ms"
    return f"{seconds * 1e6:.{precision}f} us"


def full_numel(param: nn.Parameter) -> int:
    """Elements of ``param`` as the model defines it (a ZeRO-3 partitioned one holds a shard)."""
    from zerospeed.zero.stage3 import registry

    found = registry.lookup(param)
    if found is None:
        return param.numel()
    bucket, pos = found
    return int(bucket.layout.slots[pos].numel)


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.numel() or p.device.type != "cpu":
            return p.device
    return torch.device("cpu")


def _dtype_of(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


class FlopsProfiler:
    """Per-module FLOPs, MACs, parameters and latency of what runs between start and stop."""

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0,
                 peak_flops: float | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"FlopsProfiler: model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.peak_flops = peak_flops
        self.started = False
        self._counter: Any = None
        self._handles: list[Any] = []
        self._reset_stats()

    def _reset_stats(self) -> None:
        self._latency: dict[str, float] = defaultdict(float)
        self._calls: dict[str, int] = defaultdict(int)
        self._flops: dict[str, int] = {}
        self._total_flops = 0
        self._duration = 0.0
        self._ignored: set[str] = set()

    # -- lifecycle ----------------------------------------------------------------------------
    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        if self.started:
            raise RuntimeError("FlopsProfiler.start_profile: already started; call stop_profile() first")
        self._reset_stats()
        ignore = tuple(ignore_list or ())
        names = {id(m): n for n, m in self.model.named_modules()}
        self._ignored = {n for n, m in self.model.named_modules() if ignore and isinstance(m, ignore)}
        cuda = _device_of(self.model).type == "cuda"
        stack: list[tuple[str, float]] = []

        def pre(module: nn.Module, _inputs: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            stack.append((names.get(id(module), "?"), time.perf_counter()))

        def post(module: nn.Module, _inputs: Any, _output: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            if stack:
                name, t0 = stack.pop()
                self._latency[name] += time.perf_counter() - t0
                self._calls[name] += 1

        for module in self.model.modules():
            self._handles.append(module.register_forward_pre_hook(pre))
            self._handles.append(module.register_forward_hook(post))
        self._counter = flop_counter()
        self._counter.__enter__()
        if cuda:
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()
        self.started = True

    def stop_profile(self) -> None:
        if not self.started:
            raise RuntimeError("FlopsProfiler.stop_profile: the profile was not started")
        if _device_of(self.model).type == "cuda":
            torch.cuda.synchronize()
        self._duration = time.perf_counter() - self._t0
        self._counter.__exit__(None, None, None)
        total, per_module = module_flops(self._counter, self.model)
        self._counter = None
        self._remove_hooks()
        # ignored modules: drop their FLOPs from themselves, every ancestor and the total
        outermost = [n for n in self._ignored if not any(n.startswith(o + ".") for o in self._ignored if o != n)]
        for name in outermost:
            removed = per_module.get(name, 0)
            total -= removed
            for other in list(per_module):
                if other == name or other.startswith(name + "."):
                    per_module[other] = 0
                elif other == "" or name.startswith(other + "."):
                    per_module[other] -= removed  # an ancestor
        self._flops, self._total_flops = per_module, total
        self.started = False

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def reset_profile(self) -> None:
        self._reset_stats()

    def end_profile(self) -> None:
        """Remove the hooks and drop the results (DeepSpeed's end_profile)."""
        if self.started:
            self._counter.__exit__(None, None, None)
            self._counter = None
            self.started = False
        self._remove_hooks()
        self._reset_stats()

    # -- results ------------------------------------------------------------------------------
    def module_params(self, name: str = "") -> int:
        module = self.model.get_submodule(name) if name else self.model
        return sum(full_numel(p) for p in module.parameters())

    def module_flops(self, name: str = "") -> int:
        """FLOPs counted inside module ``name``; a container that is never called itself (a
        ModuleList) gets the sum of its children."""
        if name == "":
            return self._total_flops
        if name in self._flops or self._calls.get(name):
            return self._flops.get(name, 0)
        module = self.model.get_submodule(name)
        return sum(self.module_flops(f"{name}.{child}") for child, _ in module.named_children())

    def get_total_flops(self, as_string: bool = False) -> int | str:
        return flops_to_string(self._total_flops) if as_string else self._total_flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        macs = self._total_flops // 2
        return macs_to_string(macs) if as_string else macs

    def get_total_params(self, as_string: bool = False) -> int | str:
        params = self.module_params("")
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False) -> float | str:
        return duration_to_string(self._duration) if as_string else self._duration

    def achieved_flops_per_s(self) -> float:
        return self._total_flops / self._duration if self._duration > 0 else 0.0

    def peak(self) -> tuple[float, str]:
        """(peak FLOP/s, where it comes from)."""
        if self.peak_flops:
            return float(self.peak_flops), "given"
        dtype = _dtype_of(self.model)
        name = str(dtype).replace("torch.", "")
        return measure_peak_flops(_device_of(self.model), dtype), f"measured {name} matmul probe"

    def mfu(self) -> float:
        peak, _ = self.peak()
        return self.achieved_flops_per_s() / peak if peak > 0 else 0.0

    # -- report -------------------------------------------------------------------------------
    def _row(self, name: str) -> str:
        module = self.model.get_submodule(name) if name else self.model
        flops = self.module_flops(name)
        latency = self._latency.get(name, 0.0)
        rate = rate_to_string(flops / latency) if latency > 0 and name not in self._ignored else "-"
        label = name or "(model)"
        return (f"{label} ({type(module).__name__}): {params_to_string(self.module_params(name))} params, "
                f"{macs_to_string(flops // 2)}, {flops_to_string(flops)}, latency {duration_to_string(latency)}"
                f" over {self._calls.get(name, 0)} call(s), {rate}")

    def profile_text(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                     detailed: bool = True) -> str:
        peak, source = self.peak()
        achieved = self.achieved_flops_per_s()
        lines = ["-" * 30 + " zerospeed flops profiler " + "-" * 30,
                 f"profile at step {profile_step}",
                 f"params:                 {params_to_string(self.get_total_params())} ({self.get_total_params():,})",
                 f"MACs:                   {self.get_total_macs(as_string=True)}",
                 f"FLOPs:                  {self.get_total_flops(as_string=True)} ({self._total_flops:,})",
                 f"wall time:              {self.get_total_duration(as_string=True)}",
                 f"achieved:               {rate_to_string(achieved)}",
                 f"peak ({source}): {rate_to_string(peak)}",
                 f"MFU:                    {100 * achieved / peak:.2f}%" if peak > 0 else "MFU: -"]
        by_depth: dict[int, list[str]] = defaultdict(list)
        for name, _ in self.model.named_modules():
            if name:
                by_depth[name.count(".")].append(name)
        max_depth = max(by_depth) if by_depth else -1
        depth_limit = max_depth if module_depth < 0 else min(module_depth, max_depth + 1) - 1
        lines.append(f"top {top_modules} module(s) by FLOPs at each depth:")
        for depth in range(depth_limit + 1):
            ranked = sorted(by_depth[depth], key=self.module_flops, reverse=True)[:top_modules]
            lines.append(f"  depth {depth + 1}: " + ", ".join(
                f"{n} ({type(self.model.get_submodule(n)).__name__}) {flops_to_string(self.module_flops(n))}"
                for n in ranked))
        if detailed:
            lines.append("per module (params, MACs, FLOPs, forward latency, FLOP/s):")
            lines.append("  " + self._row(""))
            for name, _ in self.model.named_modules():
                if name and name.count(".") <= depth_limit:
                    lines.append("  " + "  " * (name.count(".") + 1) + self._row(name))
        lines.append("-" * 86)
        return "\n".join(lines)

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None) -> None:
        text = self.profile_text(profile_step, module_depth, top_modules, detailed)
        if output_file:
            with open(output_file, "w") as f:
                f.write(text + "\n")
        else:
            out: TextIO = sys.stdout
            print(text, file=out, flush=True)


def get_model_profile(model: nn.Module, input_shape: Sequence[int] | None = None, args: Sequence[Any] = (),
                      kwargs: dict[str, Any] | None = None, print_profile: bool = True, detailed: bool = True,
                      module_depth: int = -1, top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: str | None = None, ignore_modules: Sequence[type] | None = None,
                      mode: str = "forward") -> tuple[Any, Any, Any]:
    """Profile one forward of ``model`` (after ``warm_up`` unprofiled ones): ``(flops, macs, params)``.

    Inputs: ``input_shape`` builds one tensor of ones in the model's dtype and device (DeepSpeed's
    behaviour; pass ``args``/``kwargs`` for integer inputs such as token ids), or ``args``/``kwargs``.
    Runs under ``torch.no_grad()``. ``mode`` must be ``"forward"`` (DeepSpeed's other modes call
    ``generate`` on HF models).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, got {type(model).__name__}")
    if mode != "forward":
        raise ValueError(f"get_model_profile: mode {mode!r} is not supported; use 'forward'")
    kwargs = dict(kwargs or {})
    args = list(args or [])
    if input_shape is not None:
        if args:
            raise ValueError("get_model_profile: give input_shape or args, not both")
        if not isinstance(input_shape, (tuple, list)) or not all(isinstance(d, int) and d > 0 for d in input_shape):
            raise ValueError(f"get_model_profile: input_shape must be a tuple of positive ints, got {input_shape!r}")
        args = [torch.ones(tuple(input_shape), dtype=_dtype_of(model), device=_device_of(model))]
    elif not args and not kwargs:
        raise ValueError("get_model_profile: no input; pass input_shape, args or kwargs")
    if not isinstance(warm_up, int) or warm_up < 0:
        raise ValueError(f"get_model_profile: warm_up must be an int >= 0, got {warm_up!r}")
    profiler = FlopsProfiler(model)
    with torch.no_grad():
        for _ in range(warm_up):
            model(*args, **kwargs)
        profiler.start_profile(ignore_list=ignore_modules)
        try:
            model(*args, **kwargs)
        finally:
            if profiler.started:
                profiler.stop_profile()
    flops, macs, params = profiler.get_total_flops(), profiler.get_total_macs(), profiler.get_total_params()
    if print_profile:
        profiler.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                     detailed=detailed, output_file=output_file)
    profiler.end_profile()
    if as_string:
        return flops_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
