"""What the engine does inside an autotuning experiment: measure, write the metrics, end the run.

The tuner (:mod:`zerospeed.autotuning`) starts each experiment with a config whose ``autotuning``
section carries ``metric_path`` (and, for the model-info run, ``model_info_path``). With either
set, :class:`AutotuningProbe` is attached to the engine and:

* on the first micro-batch's forward, counts the FLOPs (``torch.utils.flop_counter``) and the
  bytes of tensors saved for backward (``saved_tensors_hooks``, distinct storages) per sample:
  the activation memory the tuner's memory model scales with the micro-batch size;
* times optimizer steps ``start_profile_step`` (exclusive) to ``end_profile_step`` (inclusive) on
  every rank, one duration per step, and keeps the slowest rank's duration of each step (a step
  is as slow as its slowest rank). The metric uses the *median* of those steps, not their mean
  (DeepSpeed's choice): one step slowed by another job on a shared machine, or by a late
  allocation, then does not decide the ranking of two configs. The mean is recorded too
  (``throughput_mean``, ``latency_mean``);
* at ``end_profile_step`` writes ``metrics.json`` (throughput in samples/s, latency in s/step,
  achieved FLOP/s per rank, peak memory per rank) and/or ``model_info.json`` from rank 0, waits
  for every rank, and ends the process with exit status 0 (as DeepSpeed's engine does), so the
  user's training script needs no change to be tuned.

Peak memory is ``torch.cuda.max_memory_allocated`` on CUDA and the process' peak RSS on CPU
(``ru_maxrss``), the largest over ranks. Without ``metric_path``/``model_info_path`` an enabled
``autotuning`` section changes nothing: the script trains as usual.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from typing import Any

import torch
from torch import nn

from zerospeed import comm


def peak_memory_bytes() -> int:
    """This process' peak memory: CUDA allocator peak when on a GPU, else peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class _FirstForwardCounter:
    """Counts FLOPs and saved-activation bytes of the module's first forward (hooks removed after)."""

    def __init__(self, module: nn.Module) -> None:
        self.flops = 0
        self.saved_bytes = 0
        self.batch_size = 0
        self._storages: set[int] = set()
        self._mode: Any = None
        self._saved: Any = None
        self._handles = [module.register_forward_pre_hook(self._pre, with_kwargs=True),
                         module.register_forward_hook(self._post, with_kwargs=True)]

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, torch.Tensor) and not isinstance(tensor, nn.Parameter):
            key = tensor.untyped_storage().data_ptr()
            if key not in self._storages:
                self._storages.add(key)
                self.saved_bytes += tensor.untyped_storage().nbytes()
        return tensor

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        first = next((a for a in (*args, *kwargs.values()) if torch.is_tensor(a) and a.dim() > 0), None)
        self.batch_size = int(first.shape[0]) if first is not None else 1
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._mode = FlopCounterMode(display=False)
        self._saved.__enter__()
        self._mode.__enter__()

    def _post(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        self._mode.__exit__(None, None, None)
        self._saved.__exit__(None, None, None)
        self.flops = int(self._mode.get_total_flops())
        for h in self._handles:
            h.remove()
        self._handles = []


class AutotuningProbe:
    """Attached to an engine inside an autotuning experiment (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        cfg = engine.config.autotuning
        self.engine = engine
        self.start_step = cfg.start_profile_step
        self.end_step = cfg.end_profile_step
        self.metric_path = cfg.metric_path
        self.model_info_path = cfg.model_info_path
        self._counter = _FirstForwardCounter(engine.module)
        # start_profile_step 0 measures from the engine's creation (first step's warm-up included)
        self._t_start: float | None = time.perf_counter() if self.start_step == 0 else None
        self._t_last = self._t_start or 0.0
        self._durations: list[float] = []

    @classmethod
    def attach(cls, engine: Any) -> AutotuningProbe | None:
        cfg = engine.config.autotuning
        if not cfg.enabled or not (cfg.metric_path or cfg.model_info_path):
            return None
        return cls(engine)

    def after_step(self) -> None:
        """Called by the engine after each optimizer step (``global_steps`` already advanced)."""
        step = self.engine.global_steps
        if step == self.start_step:
            comm.barrier(self.engine.dp_group)
            self._t_start = self._t_last = time.perf_counter()
        elif self._t_start is not None and step > self.start_step:
            now = time.perf_counter()
            self._durations.append(now - self._t_last)
            self._t_last = now
            if step >= self.end_step:
                self._finish(step)

    def _finish(self, step: int) -> None:
        engine = self.engine
        # up to the last step's end (not 'now'), so it is exactly the sum of this rank's step durations
        elapsed = self._t_last - (self._t_start or 0.0)
        steps = step - self.start_step
        times = comm.all_gather_object({"elapsed": elapsed, "steps": self._durations, "peak": peak_memory_bytes()},
                                       engine.dp_group)
        slowest = max(t["elapsed"] for t in times)
        per_step = [max(t["steps"][i] for t in times) for i in range(min(len(t["steps"]) for t in times))]
        median = statistics.median(per_step) if per_step else slowest / steps
        world = comm.get_world_size(engine.dp_group)
        per_sample_flops = self._counter.flops / max(1, self._counter.batch_size)
        throughput = engine.train_batch_size() / median
        metrics = {
            "throughput": throughput,
            "latency": median,
            "throughput_mean": engine.train_batch_size() * steps / slowest,
            "latency_mean": slowest / steps,
            "step_times": per_step,
            # forward + backward ~= 3x the forward's FLOPs; per rank, per second
            "flops": 3.0 * per_sample_flops * throughput / world,
            "peak_memory_bytes": max(t["peak"] for t in times),
            "steps_measured": steps,
            "train_batch_size": engine.train_batch_size(),
            "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
            "zero_stage": engine.zero_stage,
            "world_size": world,
        }
        if comm.get_rank() == 0:
            if self.metric_path:
                _write_json(self.metric_path, metrics)
            if self.model_info_path:
                num_params = sum(p.numel() for p in engine.strategy.managed_parameters()) or sum(
                    p.numel() for p in engine.module.parameters())
                _write_json(self.model_info_path, {
                    "num_params": int(num_params),
                    "activation_mem_per_sample": self._counter.saved_bytes / max(1, self._counter.batch_size),
                    "flops_per_sample": 3.0 * per_sample_flops,
                    "peak_memory_bytes": metrics["peak_memory_bytes"],
                    "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
                })
        comm.barrier()
        raise SystemExit(0)


def _write_json(path: str, data: dict[str, Any]) -> None:
    """Write atomically: a reader never sees a half-written file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)
