"""What the engine tells the monitor each step: ``StepEvents`` records and then writes it.

The engine calls three hooks: :meth:`StepEvents.on_forward` (counts samples and tokens of
training forwards), :meth:`StepEvents.on_backward` (records the loss) and
:meth:`StepEvents.on_step` (at the accumulation boundary: builds and writes the step's events).
With no monitor enabled every hook returns at once (no sync, no collective).

Events (DeepSpeed's names; the step axis is ``global_samples``, as in DeepSpeed):

* ``Train/Samples/train_loss``: the mean over micro-batches and data-parallel ranks of the loss
  passed to ``engine.backward`` (unscaled, before the division by the accumulation steps);
* ``Train/Samples/lr`` (first parameter group), ``Train/Samples/loss_scale``,
  ``Train/Samples/grad_norm`` (when the step computed one), ``Train/Samples/global_step``;
* ``Train/Samples/samples_per_sec`` and, when the first forward argument is an integer tensor
  of shape (batch, seq, ...), ``Train/Samples/tokens_per_sec`` (all ranks' tokens over the wall
  time from the window's first forward to its step);
* ``Train/Memory/rank<r>_MiB``: each data-parallel rank's memory, ``torch.cuda.max_memory_allocated``
  since the previous step on CUDA, else the process's resident set size.

The loss and memory of every rank reach rank 0 in one all_gather of ``2 * world`` float64s over
the data-parallel group, once per optimizer step, counted like every collective.
"""

from __future__ import annotations

import time
from typing import Any

import psutil
import torch

from zerospeed import comm


def _tokens_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int]:
    """(samples, tokens) of one forward: from the first tensor argument (tokens 0 if not integer)."""
    first = next((a for a in (*args, *kwargs.values()) if torch.is_tensor(a)), None)
    if first is None or first.dim() == 0:
        return 0, 0
    samples = int(first.shape[0])
    tokens = first.numel() if not first.is_floating_point() and first.dim() >= 2 else 0
    return samples, tokens


def _memory_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return float(peak)
    return float(psutil.Process().memory_info().rss)


class StepEvents:
    def __init__(self, monitor: Any, dp_group: Any = None) -> None:
        self.monitor = monitor
        self.dp_group = dp_group
        self._reset_window()

    def _reset_window(self) -> None:
        self._loss_sum: torch.Tensor | None = None
        self._num_losses = 0
        self._samples = 0
        self._tokens = 0
        self._t0: float | None = None

    def on_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.monitor.enabled or not torch.is_grad_enabled():
            return
        if self._t0 is None:
            self._t0 = time.perf_counter()
        samples, tokens = _tokens_in(args, kwargs)
        self._samples += samples
        self._tokens += tokens

    def on_backward(self, loss: torch.Tensor) -> None:
        if not self.monitor.enabled:
            return
        value = loss.detach().float().reshape(())
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._num_losses += 1

    def on_step(self, engine: Any) -> None:
        """At the accumulation boundary, after the optimizer step: gather and write the events."""
        if not self.monitor.enabled:
            return
        elapsed = time.perf_counter() - self._t0 if self._t0 is not None else 0.0
        mean_loss = float(self._loss_sum) / self._num_losses if self._num_losses else float("nan")
        device = self._loss_sum.device if self._loss_sum is not None else torch.device("cpu")
        world = comm.get_world_size(self.dp_group)
        mine = torch.tensor([mean_loss, _memory_bytes(device), self._samples, self._tokens],
                            dtype=torch.float64, device=device)
        everyone = torch.empty(world * mine.numel(), dtype=torch.float64, device=device)
        comm.all_gather(everyone, mine, group=self.dp_group)
        rows = everyone.view(world, -1).cpu().tolist()
        step = engine.global_samples
        events = [("Train/Samples/train_loss", sum(r[0] for r in rows) / world, step),
                  ("Train/Samples/lr", engine.get_lr()[0], step),
                  ("Train/Samples/loss_scale", engine.loss_scale, step),
                  ("Train/Samples/global_step", engine.global_steps, step)]
        if engine.get_global_grad_norm() is not None:
            events.append(("Train/Samples/grad_norm", engine.get_global_grad_norm(), step))
        if elapsed > 0:
            events.append(("Train/Samples/samples_per_sec", sum(r[2] for r in rows) / elapsed, step))
            tokens = sum(r[3] for r in rows)
            if tokens:
                events.append(("Train/Samples/tokens_per_sec", tokens / elapsed, step))
        events += [(f"Train/Memory/rank{r}_MiB", row[1] / 2**20, step) for r, row in enumerate(rows)]
        self.monitor.write_events(events)
        self._reset_window()
