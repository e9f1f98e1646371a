"""The batch-size triple: ``train_batch_size == micro_batch * grad_accumulation * dp_size``.

DeepSpeed rules (``DeepSpeedConfig._set_batch_related_parameters`` and ``_batch_assertion`` in
``deepspeed/runtime/config.py``), which zerospeed follows:

* all three given -> they must satisfy the identity;
* ``train_batch_size`` + micro batch -> derive gradient accumulation;
* ``train_batch_size`` + gradient accumulation -> derive the micro batch;
* micro batch + gradient accumulation -> derive ``train_batch_size``;
* only ``train_batch_size`` -> gradient accumulation 1, micro batch = tbs / dp;
* only the micro batch -> gradient accumulation 1, ``train_batch_size`` = mbs * dp;
* neither ``train_batch_size`` nor the micro batch -> error.

Decision: where DeepSpeed floors a division (``//``) and then fails the identity check with a
generic message, zerospeed refuses non-integer divisions up front and prints the arithmetic, e.g.
``train_batch_size: 32 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 2 *
data-parallel world size 2 = 16``.  Every error names ``train_batch_size`` (the value the other two
must multiply up to), except a missing size that was ``"auto"``, which names the ``"auto"`` key.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

TBS = "train_batch_size"
MBS = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchSizes:
    """The resolved triple; invariant ``train_batch_size == micro * accumulation * dp``."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int


def _divide(total: int, parts: dict[str, int], dp_world_size: int) -> int:
    """``total / (product of parts * dp)``, refusing a remainder with the arithmetic spelled out."""
    divisor = dp_world_size
    for value in parts.values():
        divisor *= value
    if total % divisor:
        factors = " * ".join(f"{name} {value}" for name, value in parts.items())
        raise ConfigError(
            TBS,
            f"{total} is not divisible by {factors} * data-parallel world size "
            f"{dp_world_size} = {divisor}",
        )
    return total // divisor


def resolve_batch(
    train_batch_size: int | None,
    micro_batch: int | None,
    grad_accum: int | None,
    dp_world_size: int,
    auto_keys: tuple[str, ...] = (),
) -> BatchSizes:
    """Derive the missing members of the triple for ``dp_world_size`` data-parallel ranks.

    Inputs are positive ints or ``None`` (not given); ``auto_keys`` lists keys that were "auto".
    """
    tbs, mbs, gas, dp = train_batch_size, micro_batch, grad_accum, dp_world_size
    if tbs is None and mbs is None:
        for key in (MBS, TBS):
            if key in auto_keys:
                raise ConfigError(
                    key,
                    "'auto' cannot be resolved outside the HF Trainer; give "
                    f"{TBS} or {MBS} a value",
                )
        raise ConfigError(TBS, f"neither {TBS} nor {MBS} is given; set at least one of them")
    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * dp:
            raise ConfigError(
                TBS,
                f"{tbs} != {MBS} {mbs} * {GAS} {gas} * data-parallel world size {dp} "
                f"= {mbs * gas * dp}",
            )
    elif tbs is not None and mbs is not None:
        gas = _divide(tbs, {MBS: mbs}, dp)
    elif tbs is not None:
        gas = 1 if gas is None else gas
        mbs = _divide(tbs, {GAS: gas}, dp)
    else:
        assert mbs is not None
        gas = 1 if gas is None else gas
        tbs = mbs * gas * dp
    assert tbs is not None and mbs is not None and gas is not None
    return BatchSizes(tbs, mbs, gas)
