"""Loss scaling for fp16: static, or dynamic with DeepSpeed's hysteresis semantics.

Dynamic scaling (``fp16.loss_scale == 0``), per DeepSpeed's documented behaviour:

* start at ``2 ** initial_scale_power``;
* on an overflowing step (non-finite gradients on any rank) the step is skipped; if hysteresis is
  exhausted (``hysteresis`` overflows tolerated before a drop) the scale halves, never below
  ``min_loss_scale``; otherwise one unit of hysteresis is spent;
* after ``loss_scale_window`` consecutive clean steps the scale doubles (and hysteresis is
  restored); with ``consecutive_hysteresis`` every clean step restores hysteresis.

bf16 and fp32 use :class:`StaticLossScaler` with scale 1, so the engine has one code path.
"""

from __future__ import annotations

from typing import Any


class StaticLossScaler:
    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = float(scale)

    def update(self, overflow: bool) -> None:
        del overflow

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler:
    dynamic = True

    def __init__(self, initial_scale_power: int = 16, scale_window: int = 1000, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False, min_scale: float = 1.0, scale_factor: float = 2.0) -> None:
        self.scale = float(2 ** initial_scale_power)
        self.scale_window = scale_window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_scale)
        self.scale_factor = scale_factor
        self.hysteresis_left = hysteresis
        self.clean_steps = 0  # consecutive steps without overflow

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis <= 1 or self.hysteresis_left <= 1:
                self.scale = max(self.scale / self.scale_factor, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        if self.clean_steps % self.scale_window == 0:
            self.scale *= self.scale_factor
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.clean_steps = int(state["clean_steps"])


def build_loss_scaler(precision: str, fp16: Any) -> StaticLossScaler | DynamicLossScaler:
    """The scaler for a precision ('fp32' | 'bf16' | 'fp16') and the parsed ``fp16`` section."""
    if precision != "fp16":
        return StaticLossScaler(1.0)
    if fp16.loss_scale and fp16.loss_scale > 0:
        return StaticLossScaler(fp16.loss_scale)
    return DynamicLossScaler(fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis,
                             fp16.consecutive_hysteresis, fp16.min_loss_scale)
