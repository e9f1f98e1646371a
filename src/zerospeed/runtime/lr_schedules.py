"""DeepSpeed's learning-rate schedules, with DeepSpeed's formulas, parameter names and defaults.

The five schedules ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle`` and
``LRRangeTest`` compute exactly what ``deepspeed/runtime/lr_schedules.py`` computes (DeepSpeed
master, 2026, read with the search tool), so a job moved from DeepSpeed sees the same learning rate
at every step. Facts taken from that file:

* The position is ``last_batch_iteration`` (``-1`` before the first ``step()``); ``step()`` with no
  argument advances it by one and writes ``get_lr()`` into every ``param_group["lr"]``.
* Constructing with ``last_batch_iteration=-1`` writes the schedule's start value into the optimizer
  at once (WarmupLR/WarmupDecayLR: ``warmup_min_lr``; WarmupCosineLR: ``0.0``; OneCycle:
  ``cycle_min_lr``; LRRangeTest: ``lr_range_test_min_lr``), so the first optimizer step runs with
  it. Constructing with another value (resuming) leaves the optimizer untouched until ``step()``.
* Warmup position ``i = last_batch_iteration`` over ``W = max(2, warmup_num_steps)`` steps:
  ``log`` gives ``log(i + 1) / log(W)``, ``linear`` gives ``i / W``; from ``i >= W`` it is 1.
* WarmupDecayLR after warmup: ``max(0, (T - i) / max(1, T - W))`` with ``T = total_num_steps``, so
  the lr is 0 from step ``T`` on.
* WarmupCosineLR scales each group's lr *as found at construction* by a ratio: during warmup
  ``warmup_min_ratio + gamma * (1 - warmup_min_ratio)``, after it
  ``cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2`` with
  ``p = min(1, (i - W + 1) / max(1, T - W))``, so it stays at ``cos_min_ratio`` past the end.
* OneCycle: ``x`` is the position of ``i + 1`` inside a cycle of ``first + second`` steps; the
  scale rises ``x / ratio`` then falls ``(x - 1) / (ratio - 1)``; a stair count ``n > 0`` holds the
  scale at ``floor(n * offset / half_size) / n``; past the cycle the lr is
  ``cycle_min_lr / (1 + decay_lr_rate * k / decay_step_size)`` (``k = i - cycle_size + 1``), or
  ``cycle_min_lr`` when either decay value is 0. Momentum runs opposite to the lr between
  ``cycle_max_mom`` and ``cycle_min_mom`` and afterwards grows as
  ``cycle_max_mom * (1 + decay_mom_rate * k / decay_step_size)``.
* LRRangeTest: ``min_lr * (1 + step_rate * (i + 1) / step_size)``, with ``floor`` of the interval in
  staircase mode.
* ``state_dict()`` is ``{"last_batch_iteration": i}``, the same as DeepSpeed's, so DeepSpeed
  checkpoints load.

Decisions where zerospeed differs on purpose (each is a place DeepSpeed only logs a warning or
silently changes a user's hyper-parameter):

* A bad value (unknown ``warmup_type``, ``total_num_steps < warmup_num_steps``, a negative step
  count) raises :class:`ConfigError` naming ``scheduler.params.<name>``; DeepSpeed warns and goes on.
* OneCycle momentum cycling writes only ``betas[0]`` and keeps the group's own ``betas[1]``;
  DeepSpeed replaces ``betas[1]`` with 0.99. As in DeepSpeed, cycling is switched off (with a
  warning) when the param groups have no ``betas`` (SGD and the like).
* A tensor ``lr`` in a param group (capturable / fused optimizers) is updated in place, so the
  optimizer keeps the same tensor object.

The schedules touch only the ``lr`` and ``betas`` keys of ``optimizer.param_groups``, never
``group["params"]``, so they work unchanged on an optimizer whose groups hold ZeRO flat shards,
and on any wrapper object that exposes ``param_groups``.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from zerospeed.config.errors import ConfigError

__all__ = [
    "BatchLRScheduler",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    "LRRangeTest",
    "build_lr_scheduler",
    "SCHEDULERS",
    # DeepSpeed's names of the schedules and of their parameters (deepspeed/runtime/lr_schedules.py, 0.19.8)
    "LR_SCHEDULE", "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR", "WARMUP_COSINE_LR",
    "VALID_LR_SCHEDULES", "LR_RANGE_TEST_MIN_LR", "LR_RANGE_TEST_STEP_RATE", "LR_RANGE_TEST_STEP_SIZE",
    "LR_RANGE_TEST_STAIRCASE", "EDGE_VALUE", "MID_VALUE", "CYCLE_FIRST_STEP_SIZE", "CYCLE_FIRST_STAIR_COUNT",
    "CYCLE_SECOND_STEP_SIZE", "CYCLE_SECOND_STAIR_COUNT", "DECAY_STEP_SIZE", "CYCLE_MIN_LR", "CYCLE_MAX_LR",
    "DECAY_LR_RATE", "CYCLE_MIN_MOM", "CYCLE_MAX_MOM", "DECAY_MOM_RATE", "WARMUP_MIN_LR", "WARMUP_MAX_LR",
    "WARMUP_NUM_STEPS", "WARMUP_TYPE", "WARMUP_LOG_RATE", "WARMUP_LINEAR_RATE", "WARMUP_MIN_RATIO", "COS_MIN_RATIO",
    "TOTAL_NUM_STEPS",
]

logger = logging.getLogger(__name__)

# DeepSpeed's constants (same names and values as deepspeed/runtime/lr_schedules.py in 0.19.8), so a script or test
# that builds a scheduler section from them runs unchanged: the schedule names ``scheduler.type`` takes ...
LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
# ... and the keys of ``scheduler.params`` (each is a keyword of the schedule's constructor below)
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"
EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"
WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"

WARMUP_TYPES = (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE)


# ----------------------------------------------------------------------------- value checks


def _key(name: str) -> str:
    return f"scheduler.params.{name}"


def _number(name: str, value: Any, *, minimum: float | None = 0.0, maximum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(_key(name), f"{value!r} is not a finite number")
    if minimum is not None and value < minimum:
        raise ConfigError(_key(name), f"{value!r} must be >= {minimum:g}")
    if maximum is not None and value > maximum:
        raise ConfigError(_key(name), f"{value!r} must be <= {maximum:g}")
    return float(value)


def _count(name: str, value: Any, *, minimum: int) -> int:
    """An integer step count; an integral float (JSON ``1e3``) is accepted."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(_key(name), f"{value!r} is not an integer")
    if value < minimum:
        raise ConfigError(_key(name), f"{value!r} must be >= {minimum}")
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(_key(name), f"{value!r} is not a boolean")
    return value


def _per_group(name: str, value: Any, num_groups: int, **bounds: Any) -> list[float]:
    """A scalar broadcast to every param group, or a list with one value per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ConfigError(
                _key(name), f"has {len(value)} values but the optimizer has {num_groups} param groups"
            )
        return [_number(name, v, **bounds) for v in value]
    return [_number(name, value, **bounds)] * num_groups


def _warmup_type(value: Any) -> str:
    if value not in WARMUP_TYPES:
        raise ConfigError(_key("warmup_type"), f"{value!r} is not one of {', '.join(WARMUP_TYPES)}")
    return value


def _warmup_gamma(iteration: int, warmup_steps: int, warmup_type: str) -> float:
    """Warmup progress in [0, 1] at ``iteration`` (< warmup_steps); DeepSpeed's two curves."""
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_steps)
    return iteration / warmup_steps


def _group_lr(group: Mapping[str, Any]) -> float:
    lr = group["lr"]
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


# ----------------------------------------------------------------------------- common base


class BatchLRScheduler:
    """Base of the five schedules: the position, applying lrs, the checkpoint state.

    Subclasses implement ``get_lr()`` for the current ``last_batch_iteration``. The engine can type
    against this class: ``step()``, ``get_lr()``, ``get_last_lr()``, ``state_dict()``,
    ``load_state_dict()`` are the whole protocol.
    """

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(f"{type(optimizer).__name__} has no param_groups; pass a torch optimizer")
        if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, int):
            raise ConfigError(_key("last_batch_iteration"), f"{last_batch_iteration!r} is not an integer")
        if last_batch_iteration < -1:
            raise ConfigError(_key("last_batch_iteration"), f"{last_batch_iteration} must be >= -1")
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    @property
    def num_groups(self) -> int:
        return len(self.optimizer.param_groups)

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The lrs written by the latest ``step()`` (or by construction when starting fresh)."""
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}: no learning rate applied yet; call step() first")
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Move to ``last_batch_iteration`` (default: the next batch) and apply its lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply(self.get_lr())

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the position; the optimizer's own state carries the lr until the next step()."""
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])

    def _apply(self, lrs: Sequence[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = list(lrs)


# ----------------------------------------------------------------------------- warmup family


class WarmupLR(BatchLRScheduler):
    """Warm the lr up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.

    ``warmup_max_lr=None`` (DeepSpeed's default) takes each param group's lr at construction.
    ``warmup_min_lr`` / ``warmup_max_lr`` may be lists with one value per param group.
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_num_steps = max(2, _count("warmup_num_steps", warmup_num_steps, minimum=1))
        self.warmup_type = _warmup_type(warmup_type)
        if warmup_max_lr is None:
            warmup_max_lr = [_group_lr(g) for g in optimizer.param_groups]
        self.min_lrs = _per_group("warmup_min_lr", warmup_min_lr, self.num_groups)
        self.max_lrs = _per_group("warmup_max_lr", warmup_max_lr, self.num_groups)
        if last_batch_iteration == -1:
            self._apply(self.get_lr())

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay that reaches 0 at ``total_num_steps`` and stays there.

    Unlike WarmupLR, DeepSpeed's default ``warmup_max_lr`` here is the constant 0.001.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        total = _count("total_num_steps", total_num_steps, minimum=1)
        warmup = _count("warmup_num_steps", warmup_num_steps, minimum=1)
        if total < warmup:
            raise ConfigError(
                _key("total_num_steps"), f"{total} is less than warmup_num_steps ({warmup})"
            )
        self.total_num_steps = total
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration
        )

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(BatchLRScheduler):
    """Scale each group's initial lr by a ratio: warm up to 1, then cosine-decay to ``cos_min_ratio``.

    The base lrs are the param groups' lrs at construction. Before the first ``step()`` the ratio is
    0 (DeepSpeed's behaviour), whatever ``warmup_min_ratio`` is.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = _count("total_num_steps", total_num_steps, minimum=1)
        warmup = _count("warmup_num_steps", warmup_num_steps, minimum=1)
        if self.total_num_steps < warmup:
            raise ConfigError(
                _key("total_num_steps"), f"{self.total_num_steps} is less than warmup_num_steps ({warmup})"
            )
        self.warmup_num_steps = max(2, warmup)
        self.warmup_min_ratio = _number("warmup_min_ratio", warmup_min_ratio, maximum=1.0)
        self.cos_min_ratio = _number("cos_min_ratio", cos_min_ratio, maximum=1.0)
        self.warmup_type = _warmup_type(warmup_type)
        self.org_lrs = [_group_lr(g) for g in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._apply(self.get_lr())

    def get_lr_ratio(self) -> float:
        i = self.last_batch_iteration
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            gamma = _warmup_gamma(i, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (i - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


# ----------------------------------------------------------------------------- 1Cycle, range test


class OneCycle(BatchLRScheduler):
    """DeepSpeed's 1Cycle: one triangle between the lr bounds (momentum opposite), then decay.

    ``cycle_second_step_size=None`` means equal to the first; ``cycle_second_stair_count=None``
    means equal to the first stair count; a stair count of 0 is the continuous schedule.
    """

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float,
        cycle_max_lr: float,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.first_step_size = _count("cycle_first_step_size", cycle_first_step_size, minimum=1)
        self.second_step_size = (
            self.first_step_size
            if cycle_second_step_size is None
            else _count("cycle_second_step_size", cycle_second_step_size, minimum=1)
        )
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = _count("cycle_first_stair_count", cycle_first_stair_count, minimum=0)
        self.second_stair_count = (
            self.first_stair_count
            if cycle_second_stair_count is None
            else _count("cycle_second_stair_count", cycle_second_stair_count, minimum=0)
        )
        self.decay_step_size = _count("decay_step_size", decay_step_size, minimum=0)

        self.min_lr = _number("cycle_min_lr", cycle_min_lr)
        self.max_lr = _number("cycle_max_lr", cycle_max_lr)
        self.decay_lr_rate = _number("decay_lr_rate", decay_lr_rate)
        self.skip_lr_decay = self.decay_step_size == 0 or self.decay_lr_rate == 0.0

        self.min_mom = _number("cycle_min_mom", cycle_min_mom, maximum=1.0)
        self.max_mom = _number("cycle_max_mom", cycle_max_mom, maximum=1.0)
        self.decay_mom_rate = _number("decay_mom_rate", decay_mom_rate)
        self.skip_mom_decay = self.decay_step_size == 0 or self.decay_mom_rate == 0.0
        self.cycle_momentum = _flag("cycle_momentum", cycle_momentum)
        if self.cycle_momentum and not all("betas" in g for g in optimizer.param_groups):
            logger.warning(
                "OneCycle: cycle_momentum disabled because %s has no 'betas' in its param groups",
                type(optimizer).__name__,
            )
            self.cycle_momentum = False

        if last_batch_iteration == -1:
            self._apply([self.min_lr] * self.num_groups)
            if self.cycle_momentum:
                self._apply_momentum(self.min_mom)

    def _scale_factor(self) -> float:
        batch = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1.0) / (self.step_ratio - 1.0), self.second_stair_count
        if stairs > 0:
            # Quantise from the integer offset, not from the float scale, so an exact stair
            # boundary never rounds down a whole stair.
            offset = batch % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_iteration(self) -> int:
        return self.last_batch_iteration - self.total_size + 1

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            lr = self.min_lr + (self.max_lr - self.min_lr) * self._scale_factor()
        elif self.skip_lr_decay:
            lr = self.min_lr
        else:
            lr = self.min_lr / (1.0 + self.decay_lr_rate * self._decay_iteration() / self.decay_step_size)
        return [lr] * self.num_groups

    def get_mom(self) -> list[float] | None:
        """``betas[0]`` for each group at the current position, or None when not cycling."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            mom = self.max_mom - (self.max_mom - self.min_mom) * self._scale_factor()
        elif self.skip_mom_decay:
            mom = self.max_mom
        else:
            mom = self.max_mom * (1.0 + self.decay_mom_rate * self._decay_iteration() / self.decay_step_size)
        return [mom] * self.num_groups

    def step(self, last_batch_iteration: int | None = None) -> None:
        super().step(last_batch_iteration)
        moms = self.get_mom()
        if moms is not None:
            self._apply_momentum(moms[0])

    def _apply_momentum(self, beta1: float) -> None:
        for group in self.optimizer.param_groups:
            group["betas"] = (beta1, group["betas"][1])


class LRRangeTest(BatchLRScheduler):
    """Grow the lr linearly (or in stairs) from ``lr_range_test_min_lr`` to find the usable range."""

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = _per_group("lr_range_test_min_lr", lr_range_test_min_lr, self.num_groups)
        self.step_size = _count("lr_range_test_step_size", lr_range_test_step_size, minimum=1)
        self.step_rate = _number("lr_range_test_step_rate", lr_range_test_step_rate)
        self.staircase = _flag("lr_range_test_staircase", lr_range_test_staircase)
        if last_batch_iteration == -1:
            self._apply(list(self.min_lrs))

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        increase = 1.0 + self.step_rate * interval
        return [lr * increase for lr in self.min_lrs]


# ----------------------------------------------------------------------------- factory

#: registry, keyed by lower-case name (names are matched case-insensitively).
SCHEDULERS: dict[str, type[BatchLRScheduler]] = {
    cls.__name__.lower(): cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
}


def build_lr_scheduler(type_name: str, params: Mapping[str, Any], optimizer: Any) -> BatchLRScheduler:
    """Build the schedule named by ``scheduler.type`` with ``scheduler.params`` for ``optimizer``.

    Raises:
        ConfigError: ``scheduler.type`` for an unknown name (with the nearest known one),
            ``scheduler.params.<name>`` for an unknown, missing or bad parameter.
    """
    if not isinstance(type_name, str):
        raise ConfigError("scheduler.type", f"{type_name!r} is not a string")
    cls = SCHEDULERS.get(type_name.lower())
    known = [c.__name__ for c in SCHEDULERS.values()]
    if cls is None:
        close = difflib.get_close_matches(type_name.lower(), list(SCHEDULERS), n=1, cutoff=0.5)
        hint = f"; did you mean {SCHEDULERS[close[0]].__name__!r}?" if close else ""
        raise ConfigError("scheduler.type", f"unknown scheduler {type_name!r}{hint} (allowed: {', '.join(known)})")

    signature = inspect.signature(cls.__init__)
    allowed = [name for name in signature.parameters if name not in ("self", "optimizer")]
    for name in params:
        if name not in allowed:
            raise ConfigError(
                _key(str(name)), f"unknown parameter for {cls.__name__}; allowed: {', '.join(allowed)}"
            )
    for name in allowed:
        if signature.parameters[name].default is inspect.Parameter.empty and name not in params:
            raise ConfigError(_key(name), f"required by {cls.__name__} but missing")
    return cls(optimizer, **dict(params))
