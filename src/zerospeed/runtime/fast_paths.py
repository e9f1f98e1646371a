"""The training engine's fast paths (issue #25): settled at start-up and reported once.

The config's ``fast_paths`` section (:class:`zerospeed.config.FastPathsConfig`) reaches:

* ``adam_kernel`` - the optimizer built from the config (the factory attaches the switch), a client
  :class:`~zerospeed.ops.adam.CPUAdam` / :class:`~zerospeed.ops.adam.FusedAdam` (their own switch;
  a forced config value wins over their ``auto`` and contradicts their forced value by name), a
  client ``torch.optim.Adam``/``AdamW`` only when the config forces a family (``auto`` leaves a
  client's torch optimizer as the client built it), and the offloaded step (the offload tier, built
  with the ZeRO strategy);
* ``direct_io`` - the NVMe swap files' I/O handles (decided per swap folder when they are built);
* ``cpu_kernels`` / ``greedy_head`` - the inference engine's; listed here, validated by the schema.

:func:`settle_adam_kernel` runs once the ZeRO strategy has put the tensors it updates into the
optimizer's param groups, so the measurement sees the shapes served (flat shards at stages 1-3,
the parameters at stage 0; offloaded masters excluded, the tier has its own choice). Every
data-parallel rank runs rank 0's choice: at stage 0 the replicas must run the same arithmetic, and at
stages 1-3 a run's result should not depend on which rank's timing came out which way (rank 0 of the
data-parallel group measures and broadcasts: one 1-element broadcast at start-up, only then).

:func:`startup_line` is the one log line (rank 0) listing the settings, what runs and the choices
made while the engine started; :func:`quiet_choices` holds back the chooser's own per-choice lines
(logger ``zerospeed.fast_paths``, every rank) meanwhile, unless a user set that logger's level.
Choices made later (e.g. a CPU Adam the engine does not drive) are logged by the chooser when made.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from zerospeed import comm
from zerospeed.config import ConfigError
from zerospeed.ops.adam.kernel import KERNELS
from zerospeed.ops.adam.kernel_choice import (
    attach_switch,
    check_forced,
    kernel_of_flags,
    resolve_kernel_setting,
    switch_of,
)
from zerospeed.ops.fast_paths import ENV_VAR, FastPathError, default_chooser, resolve_setting

KEY = "fast_paths.adam_kernel"


@contextmanager
def quiet_choices() -> Iterator[None]:
    """Hold back the chooser's INFO lines while the engine starts (see the module docstring)."""
    log = logging.getLogger("zerospeed.fast_paths")
    if log.level != logging.NOTSET:  # the user configured it: theirs to decide
        yield
        return
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(logging.NOTSET)


def _served(optimizer: torch.optim.Optimizer, exclude: set[int]) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]
            if torch.is_tensor(p) and p.is_floating_point() and id(p) not in exclude]


def settle_adam_kernel(optimizer: torch.optim.Optimizer, fast_paths: Any, *, exclude: set[int] | None = None,
                       dp_group: Any = None, replicated: bool = False) -> str | None:
    """Apply ``fast_paths.adam_kernel`` to ``optimizer`` and settle its choice now (see the module
    docstring). Returns the family the optimizer runs, or None when zerospeed does not choose it.

    Raises ConfigError naming ``fast_paths.adam_kernel`` for a forced family that cannot run on the
    tensors, or that contradicts the optimizer's own forced setting or flags.
    """
    exclude = exclude or set()
    try:
        setting = resolve_kernel_setting(getattr(fast_paths, "adam_kernel", "auto"), KEY)
        switch = switch_of(optimizer)
        if switch is None:
            if setting == "auto" or not isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam
                return None
            own = {kernel_of_flags(g.get("foreach"), g.get("fused")) for g in optimizer.param_groups} - {None}
            if own and own != {setting}:
                raise ConfigError(KEY, f"{setting!r} conflicts with the client optimizer's own foreach/fused flags "
                                       f"({', '.join(sorted(own))}); set one")
            check_forced(setting, _served(optimizer, exclude), KEY)
            return attach_switch(optimizer, setting, KEY).kernel
        switch.force(setting, KEY)
        if switch.kernel is not None:
            return switch.kernel
        world = comm.get_world_size(dp_group) if replicated and comm.is_initialized() else 1
        if world == 1:
            name = switch.measure(optimizer, exclude)
            return switch.settle(optimizer, name, "forced" if switch.setting != "auto" else "measured") \
                if name is not None else None
        # replicas must agree: rank 0 of the group measures, the others take its choice
        index = torch.full((1,), -1, dtype=torch.int64)
        if comm.get_rank(dp_group) == 0:
            name = switch.measure(optimizer, exclude)
            index[0] = KERNELS.index(name) if name is not None else -1
        comm.broadcast(index, src=comm.get_global_rank(dp_group, 0) if dp_group is not None else 0, group=dp_group)
        if int(index[0]) < 0:
            return None
        own = "forced" if switch.setting != "auto" else "measured"
        reason = own if comm.get_rank(dp_group) == 0 else "data-parallel rank 0's choice"
        return switch.settle(optimizer, KERNELS[int(index[0])], reason)
    except FastPathError as exc:
        raise ConfigError(KEY, str(exc).removeprefix(KEY + ": ")) from None


def _in_use(optimizer: torch.optim.Optimizer, tier: Any, handles: list[Any]) -> list[str]:
    out = []
    switch = switch_of(optimizer)
    name = type(optimizer).__name__
    if switch is not None and switch.kernel is not None:
        out.append(f"optimizer {name}: {switch.kernel} ({switch.reason or switch.setting})")
    elif switch is not None:
        out.append(f"optimizer {name}: nothing to update outside the offloaded step")
    elif isinstance(optimizer, torch.optim.Adam):
        flags = {kernel_of_flags(g.get("foreach"), g.get("fused")) for g in optimizer.param_groups}
        out.append(f"optimizer {name}: its own flags ({', '.join(sorted(f or 'torch default' for f in flags))})")
    if tier is not None and getattr(tier, "slots", None):
        out.append(f"offloaded step: {tier.kernel}")
    for handle in handles:
        refused = "; ".join(handle.direct_io_fallbacks.values())
        for device, use in handle.direct_io_choices().items():
            how = "O_DIRECT" if use else "buffered" + (f" ({refused})" if refused else "")
            out.append(f"NVMe files on dev {device}: {how}")
    return out


def startup_line(fast_paths: Any, optimizer: torch.optim.Optimizer, tier: Any = None,
                 handles: list[Any] | None = None) -> str:
    """The start-up report: each switch's setting (and where a non-``auto`` one came from), what runs,
    and the choices measured so far in this process (later ones are logged by ``zerospeed.fast_paths``
    when made)."""
    written = {"adam_kernel": fast_paths.adam_kernel, "direct_io": fast_paths.direct_io,
               "cpu_kernels": fast_paths.cpu_kernels, "greedy_head": fast_paths.greedy_head}
    parts = []
    for name, value in written.items():
        effective = resolve_setting(name, value, f"fast_paths.{name}")
        note = f" (from {ENV_VAR})" if effective != value else ""
        note += " (inference)" if name in ("cpu_kernels", "greedy_head") else ""
        parts.append(f"{name}={effective}{note}")
    line = "zerospeed fast paths: " + ", ".join(parts)
    in_use = _in_use(optimizer, tier, handles or [])
    if in_use:
        line += "; in use: " + "; ".join(in_use)
    made = [c.describe() for c in default_chooser().report() if c.path in ("adam_kernel", "direct_io")]
    if made:
        line += "; choices: " + "; ".join(made)
    return line
