"""Optimizer and LR-schedule names: what zerospeed builds, does not build yet, and what is gone.

These tables are the single source of truth for names; the builders in
``zerospeed.ops.optimizers`` and ``zerospeed.runtime.lr_schedules`` import them.

Matching is case-insensitive (DeepSpeed lower-cases optimizer names too) and the canonical
spelling below is what :class:`~zerospeed.config.sections.OptimizerConfig` stores in ``type``.

Sources (checked with the search tool, DeepSpeed master, 2026):

* ``deepspeed/runtime/config.py`` ``DEEPSPEED_OPTIMIZERS`` = adagrad, adam, adamw, lamb, muadam,
  muadamw, musgd, lion, muon.  Any other name is looked up with ``getattr(torch.optim, name)``, so
  DeepSpeed also accepts every ``torch.optim`` class (that is where ``SGD`` comes from).
* The 1-bit optimizers (OneBitAdam, ZeroOneAdam, OneBitLamb) are no longer in that list: their
  communication backends were removed by DeepSpeed PR #8535 (tracking issue #8489), so a config
  naming them fails in current DeepSpeed too. zerospeed brings them back (issue #28): OneBitAdam
  (``OnebitAdam`` too), ZeroOneAdam and OneBitLamb are built (ZeRO stage 0).
* ``deepspeed/runtime/lr_schedules.py`` ``VALID_LR_SCHEDULES`` = LRRangeTest, OneCycle, WarmupLR,
  WarmupDecayLR, WarmupCosineLR; other names fall back to ``torch.optim.lr_scheduler``.
"""

from __future__ import annotations

import difflib

#: optimizers zerospeed builds, canonical spelling.
OPTIMIZER_NAMES: tuple[str, ...] = ("Adam", "AdamW", "SGD", "Adagrad", "Lamb", "Muon", "Lion", "MuAdam", "MuAdamW",
                                    "MuSGD", "OneBitAdam", "ZeroOneAdam", "OneBitLamb")

#: names DeepSpeed accepts (its own or torch.optim's) that zerospeed does not build yet.
OPTIMIZER_NAMES_NOT_YET: tuple[str, ...] = ("LBFGS", "SparseAdam")

#: the rest of torch.optim, built by DeepSpeed's fallback ``getattr(torch.optim, name)`` (issue #30)
TORCH_OPTIMIZER_NAMES: tuple[str, ...] = (
    "Adadelta", "Adafactor", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop",
)  # fmt: skip

#: optimizer names DeepSpeed itself has removed.
OPTIMIZER_NAMES_REMOVED: tuple[str, ...] = ()

#: LR schedules zerospeed builds (all of DeepSpeed's own), canonical spelling.
SCHEDULER_NAMES: tuple[str, ...] = (
    "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest",
)  # fmt: skip

#: torch.optim.lr_scheduler classes DeepSpeed would accept by name; not built by zerospeed yet.
SCHEDULER_NAMES_NOT_YET: tuple[str, ...] = (
    "StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR", "PolynomialLR",
    "CosineAnnealingLR", "CosineAnnealingWarmRestarts", "CyclicLR", "OneCycleLR",
    "ReduceLROnPlateau", "LambdaLR", "MultiplicativeLR", "SequentialLR", "ChainedScheduler",
)  # fmt: skip


class NameProblem(ValueError):
    """A name that is not accepted; ``str(self)`` is the one-line problem description."""


def _lookup(names: tuple[str, ...], name: str) -> str | None:
    lowered = name.lower()
    for candidate in names:
        if candidate.lower() == lowered:
            return candidate
    return None


def _canonical(
    name: object,
    kind: str,
    built: tuple[str, ...],
    not_yet: tuple[str, ...],
    removed: tuple[str, ...],
) -> str:
    if not isinstance(name, str):
        raise NameProblem(f"{name!r} is not a string; expected one of {', '.join(built)}")
    found = _lookup(built, name)
    if found is not None:
        return found
    if _lookup(removed, name) is not None:
        raise NameProblem(f"{name!r}: removed in DeepSpeed and not supported by zerospeed")
    if _lookup(not_yet, name) is not None:
        raise NameProblem(
            f"{name!r}: not supported by zerospeed yet (supported: {', '.join(built)})"
        )
    known = {n.lower(): n for n in built + not_yet + removed}
    close = difflib.get_close_matches(name.lower(), list(known), n=1, cutoff=0.6)
    hint = f"; did you mean {known[close[0]]!r}?" if close else ""
    raise NameProblem(f"{name!r} is not a known {kind}{hint} (supported: {', '.join(built)})")


def canonical_optimizer_name(name: object) -> str:
    """Canonical spelling of an optimizer name zerospeed builds; :class:`NameProblem` otherwise."""
    return _canonical(
        name, "optimizer", OPTIMIZER_NAMES + TORCH_OPTIMIZER_NAMES, OPTIMIZER_NAMES_NOT_YET, OPTIMIZER_NAMES_REMOVED
    )


def canonical_scheduler_name(name: object) -> str:
    """Canonical spelling of an LR schedule zerospeed builds; :class:`NameProblem` otherwise."""
    return _canonical(name, "scheduler", SCHEDULER_NAMES, SCHEDULER_NAMES_NOT_YET, ())
