"""Shared building blocks of the schema: the section base class and strict scalar types.

Decisions:

* Every section is a frozen pydantic v2 model with ``extra="forbid"``, so a misspelt key is an
  error (with a "did you mean" hint, see :mod:`zerospeed.config.loader`).  This includes the top
  level, where DeepSpeed silently ignores keys it does not know.
* Scalars are stricter than pydantic's lax mode, because a DeepSpeed JSON file is typed data:
  ``true`` is not the integer 1, ``"8"`` is not the integer 8 and ``"false"`` is not a boolean.
  The one leniency is the one DeepSpeed users rely on everywhere: an integral float such as
  ``5e8`` (JSON has no integer exponent syntax) is accepted for an integer field.
* The validators raise :class:`pydantic_core.PydanticCustomError` with type ``"zerospeed"`` whose
  message already states the bad value and what is allowed; the loader prints it verbatim.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict
from pydantic_core import PydanticCustomError

#: pydantic error type used by every zerospeed validator; the loader prints its message as is.
ZS_ERROR = "zerospeed"
#: error-context entry holding the sub-key a model-level validator blames.
ZS_KEY = "zs_key"


def fail(message: str, key: str | None = None) -> PydanticCustomError:
    """A validation error whose message is shown to the user unchanged.

    ``key`` (dotted, relative to the model being validated) lets a model-level validator point at
    the field it is about, so the error names e.g. ``offload_optimizer.nvme_path`` rather than
    ``offload_optimizer``.
    """
    return PydanticCustomError(ZS_ERROR, message, {ZS_KEY: key} if key else None)


def to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise fail(f"{value!r} is not an integer (JSON true/false is a boolean)")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    raise fail(f"{value!r} is not an integer")


def _to_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(f"{value!r} is not a number")
    result = float(value)
    if not math.isfinite(result):
        raise fail(f"{value!r} is not a finite number")
    return result


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise fail(f"{value!r} is not a boolean; use true or false")


def _to_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise fail(f"{value!r} is not a string")


def _at_least(bound: int | float, kind: Any) -> Any:
    def check(value: Any) -> Any:
        converted = kind(value)
        if converted < bound:
            raise fail(f"{value!r} is not allowed; must be >= {bound}")
        return converted

    return check


def _positive_float(value: Any) -> float:
    number = _to_float(value)
    if number <= 0:
        raise fail(f"{value!r} is not allowed; must be > 0")
    return number


def _fraction(low_open: bool) -> Any:
    interval = "(0, 1]" if low_open else "[0, 1]"

    def check(value: Any) -> float:
        number = _to_float(value)
        if number > 1 or number < 0 or (low_open and number == 0):
            raise fail(f"{value!r} is not a number in {interval}")
        return number

    return BeforeValidator(check)


#: largest finite float32: a loss scale, or a reciprocal, beyond it is infinite in fp32 arithmetic
FP32_MAX = 3.4028234663852886e38


def bounded(kind: Any, low: float | None, high: float | None, why: str, low_open: bool = False) -> Any:
    """A validator for numbers of ``kind`` (``to_int`` / float) in ``[low, high]`` (``(low, high]`` when
    ``low_open``); ``why`` says what goes wrong outside (the error's last words)."""
    convert = to_int if kind is int else _to_float

    def check(value: Any) -> Any:
        number = convert(value)
        too_low = low is not None and (number <= low if low_open else number < low)
        if too_low or (high is not None and number > high):
            lo = "" if low is None else f"{'>' if low_open else '>='} {low:g}"
            hi = "" if high is None else f"<= {high:g}"
            raise fail(f"{value!r} is out of range; must be {' and '.join(x for x in (lo, hi) if x)} ({why})")
        return number

    return BeforeValidator(check)


Int = Annotated[int, BeforeValidator(to_int)]
NonNegInt = Annotated[int, BeforeValidator(_at_least(0, to_int))]
PosInt = Annotated[int, BeforeValidator(_at_least(1, to_int))]
Float = Annotated[float, BeforeValidator(_to_float)]
NonNegFloat = Annotated[float, BeforeValidator(_at_least(0.0, _to_float))]
PosFloat = Annotated[float, BeforeValidator(_positive_float)]
Bool = Annotated[bool, BeforeValidator(_to_bool)]
Fraction = Annotated[float, _fraction(low_open=False)]
PosFraction = Annotated[float, _fraction(low_open=True)]
Str = Annotated[str, BeforeValidator(_to_str)]


def one_of(*allowed: Any, case_insensitive: bool = False) -> Any:
    """A validator accepting exactly ``allowed`` (strings optionally case-insensitively).

    Returns the canonical spelling from ``allowed`` so downstream code compares exact values.
    """
    shown = ", ".join(repr(a) if isinstance(a, str) else str(a) for a in allowed)

    def check(value: Any) -> Any:
        for candidate in allowed:
            if isinstance(value, bool) != isinstance(candidate, bool):
                continue
            if value == candidate and type(value) is type(candidate):
                return candidate
            if (
                case_insensitive
                and isinstance(value, str)
                and isinstance(candidate, str)
                and value.lower() == candidate.lower()
            ):
                return candidate
        if isinstance(value, float) and value.is_integer() and int(value) in allowed:
            return int(value)
        raise fail(f"{value!r} is not one of {shown}")

    return BeforeValidator(check)


#: accepted spellings of a data type -> canonical short name (DeepSpeed's DtypeEnum spellings).
DTYPE_SPELLINGS = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
}  # fmt: skip


def _to_dtype(value: Any) -> str:
    if isinstance(value, str) and value.lower() in DTYPE_SPELLINGS:
        return DTYPE_SPELLINGS[value.lower()]
    raise fail(f"{value!r} is not one of 'fp32', 'fp16', 'bf16' (or float32, float16, bfloat16)")


DType = Annotated[Literal["fp32", "fp16", "bf16"], BeforeValidator(_to_dtype)]


class Section(BaseModel):
    """Base of every config section: frozen, unknown keys rejected, aliases accepted."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
