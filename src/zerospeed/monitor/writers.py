"""The three monitor back-ends DeepSpeed's config names: ``tensorboard``, ``csv_monitor``, ``wandb``.

Each writer takes the parsed config section and writes ``(name, value, step)`` events. Writers
exist only on the rank that writes (global rank 0, see :mod:`zerospeed.monitor.master`).

Decisions:

* Where files go: ``<output_path>/<job_name>/``. An empty ``output_path`` means ``./runs`` for
  TensorBoard (DeepSpeed's default) and ``./csv_monitor`` for CSV.
* TensorBoard goes through ``torch.utils.tensorboard.SummaryWriter``; the event files are
  ordinary TensorBoard files. Each ``write`` is flushed, so a crash loses nothing written.
* CSV: one file per event name (``/`` and spaces become ``_``), header ``step,<last name part>``,
  one ``step,value`` row per event (DeepSpeed's layout). Files are kept open and flushed per write.
* W&B: ``wandb.init(project, group, entity=team)``. With neither ``WANDB_MODE`` nor
  ``WANDB_API_KEY`` set the run is offline (files under ``./wandb``, sync later with
  ``wandb sync``) instead of prompting for a login in the middle of a training job.
"""

from __future__ import annotations

import csv
import os
from typing import Any, Sequence

from zerospeed.config import extras

Event = tuple[str, float, int]


class TensorBoardWriter:
    def __init__(self, section: Any) -> None:
        extras.check("tensorboard", feature="tensorboard.enabled")
        from torch.utils.tensorboard import SummaryWriter
        self.log_dir = os.path.join(section.output_path or "runs", section.job_name)
        self._writer = SummaryWriter(log_dir=self.log_dir)

    def write(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def csv_file_name(event_name: str) -> str:
    """File name (without directory) the CSV monitor uses for ``event_name``."""
    return event_name.replace("/", "_").replace(" ", "_") + ".csv"


class CSVWriter:
    def __init__(self, section: Any) -> None:
        self.log_dir = os.path.join(section.output_path or "csv_monitor", section.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self._files: dict[str, Any] = {}

    def _writer_for(self, name: str) -> Any:
        entry = self._files.get(name)
        if entry is None:
            path = os.path.join(self.log_dir, csv_file_name(name))
            new = not os.path.exists(path) or os.path.getsize(path) == 0
            handle = open(path, "a", newline="")
            writer = csv.writer(handle)
            if new:
                writer.writerow(["step", name.rsplit("/", 1)[-1]])
            entry = self._files[name] = (handle, writer)
        return entry

    def write(self, events: Sequence[Event]) -> None:
        touched = set()
        for name, value, step in events:
            handle, writer = self._writer_for(name)
            writer.writerow([step, value])
            touched.add(handle)
        for handle in touched:
            handle.flush()

    def close(self) -> None:
        for handle, _ in self._files.values():
            handle.close()
        self._files.clear()


class WandbWriter:
    def __init__(self, section: Any) -> None:
        wandb = extras.require("wandb", feature="wandb.enabled")
        self._wandb = wandb
        mode = None if (os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY")) else "offline"
        self._run = wandb.init(project=section.project, group=section.group, entity=section.team, mode=mode)

    def write(self, events: Sequence[Event]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for name, value, step in events:
            by_step.setdefault(step, {})[name] = value
        for step in sorted(by_step):
            self._run.log(by_step[step], step=step)

    def close(self) -> None:
        self._run.finish()
