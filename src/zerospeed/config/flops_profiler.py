"""``flops_profiler`` section (DeepSpeed's ``deepspeed/profiling/config.py`` keys and defaults).

``peak_tflops`` is a zerospeed key: the device's peak in TFLOP/s for MFU; absent, the profiler
measures a matmul probe. ``recompute_fwd_factor`` is accepted and unused (recomputation is
counted as it runs, see :mod:`zerospeed.profiling.flops_profiler`).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator

from .fields import Bool, NonNegInt, PosFloat, Section, Str, bounded, fail


def _depth(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise fail(f"{value!r} is not allowed; must be -1 (all depths) or an integer >= 0")
    return value


class FlopsProfilerConfig(Section):
    """``flops_profiler``: profile one training step (per-module FLOPs, MACs, params, latency, MFU)."""

    enabled: Bool = False
    recompute_fwd_factor: Annotated[float, bounded(float, 0.0, 1.0, "the share of the forward pass recomputed "
                                                                    "in backward")] = 0.0
    profile_step: NonNegInt = 1
    module_depth: Annotated[int, BeforeValidator(_depth)] = -1
    top_modules: NonNegInt = 1
    detailed: Bool = True
    output_file: Str | None = None
    peak_tflops: PosFloat | None = None
