"""``Monitor``: the writers the config enables, behind one ``write_events`` (DeepSpeed's MonitorMaster).

``engine.monitor.write_events([(name, value, step), ...])`` sends the user's own values to every
enabled writer; the engine sends its per-step events through the same call
(:mod:`zerospeed.monitor.step_events`).

Decisions:

* Only global rank 0 writes (as DeepSpeed); on other ranks ``write_events`` validates its input
  and returns, so a script can call it on every rank.
* A malformed event raises ``ValueError`` naming the event's index and what is wrong, on every
  rank, before anything is written: one bad entry never leaves a half-written batch behind.
* ``enabled`` is True when any writer section is enabled, on every rank (the engine uses it to
  decide whether to gather the step's loss and memory, a collective every rank must join).
"""

from __future__ import annotations

import numbers
from typing import Any, Iterable

from zerospeed import comm
from zerospeed.monitor.writers import CSVWriter, Event, TensorBoardWriter, WandbWriter


def _check_events(events: Iterable[Any]) -> list[Event]:
    if isinstance(events, (str, bytes)) or not isinstance(events, Iterable):
        raise ValueError(f"write_events expects a list of (name, value, step) tuples, got {type(events).__name__}")
    out: list[Event] = []
    for i, event in enumerate(events):
        if not isinstance(event, (tuple, list)) or len(event) != 3:
            raise ValueError(f"write_events: event {i} is {event!r}; expected a (name, value, step) tuple")
        name, value, step = event
        if not isinstance(name, str) or not name:
            raise ValueError(f"write_events: event {i} has name {name!r}; expected a non-empty string")
        if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"write_events: event {i} ({name}) has value {value!r}; expected a real number")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"write_events: event {i} ({name}) has step {step!r}; expected an integer >= 0")
        out.append((name, float(value), int(step)))
    return out


class Monitor:
    """Writers for the enabled ``tensorboard`` / ``csv_monitor`` / ``wandb`` sections of a config."""

    def __init__(self, config: Any, rank: int | None = None) -> None:
        sections = [(config.tensorboard, TensorBoardWriter), (config.csv_monitor, CSVWriter),
                     (config.wandb, WandbWriter)]
        self.enabled = any(section.enabled for section, _ in sections)
        self.rank = comm.get_rank() if rank is None else rank
        self.writers: list[Any] = []
        if self.rank == 0:
            self.writers = [kind(section) for section, kind in sections if section.enabled]

    def write_events(self, events: Iterable[Any]) -> None:
        """Write ``(name, value, step)`` events to every enabled writer (rank 0 only)."""
        checked = _check_events(events)
        if not self.writers or not checked:
            return
        for writer in self.writers:
            writer.write(checked)

    def close(self) -> None:
        """Flush and close every writer (the engine's ``destroy()`` calls it)."""
        for writer in self.writers:
            writer.close()
        self.writers = []
