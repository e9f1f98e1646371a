"""The engine's side of the ``flops_profiler`` config section: profile one optimizer step.

The window opens at the first training forward of the step whose ``global_steps`` (completed
optimizer steps) equals ``profile_step`` (DeepSpeed's comparison, so the default 1 skips the
first, warm-up step) and closes after that step's optimizer update: it holds every micro-batch's
forward and backward, recomputation included. Every rank counts (the counter is local, no
collective); rank 0 prints the profile, or writes it to ``output_file``. The profiler object stays
on the engine (``engine.flops_profiler``) with the step's totals until the next profile.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm
from zerospeed.profiling.flops_profiler import FlopsProfiler


class EngineFlopsProfiler:
    def __init__(self, section: Any, engine: Any) -> None:
        self.section = section
        self.engine = engine
        self.profiler: FlopsProfiler | None = None
        self.done = False
        if section is not None and section.enabled:
            self.profiler = FlopsProfiler(engine.module, ds_engine=engine,
                                          recompute_fwd_factor=section.recompute_fwd_factor,
                                          peak_flops=section.peak_tflops * 1e12 if section.peak_tflops else None)

    def on_forward(self) -> None:
        p = self.profiler
        if p is None or p.started or self.done or not torch.is_grad_enabled():
            return
        if self.engine.global_steps == self.section.profile_step:
            p.start_profile()

    def on_step(self) -> None:
        """After the optimizer step at an accumulation boundary."""
        p = self.profiler
        if p is None or not p.started:
            return
        p.stop_profile()
        self.done = True
        if comm.get_rank() == 0:
            s = self.section
            p.print_model_profile(profile_step=self.section.profile_step, module_depth=s.module_depth,
                                  top_modules=s.top_modules, detailed=s.detailed, output_file=s.output_file)
