"""The precision sections of the config: `bf16`, `fp16` (with its loss scaling) and `non_finite`."""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field

from zeroshard.config.values import FROZEN_STRICT as _FROZEN_STRICT
from zeroshard.config.values import NonNegativeInt, PositiveInt, StrictBool, finite_number
from zeroshard.config.values import invalid as _invalid


def _number(minimum: float, inclusive: bool, note: str = ""):
    """A validator for a finite JSON number above `minimum` (or equal to it, if `inclusive`)."""
    return partial(finite_number, minimum=minimum, inclusive=inclusive, meaning=note)


def _non_finite_action(value: Any) -> str:
    if not isinstance(value, str) or value not in ("skip", "error"):
        raise _invalid('must be "skip" or "error"', value)
    return value


class Bf16Config(BaseModel):
    """The `bf16` section: train with bfloat16 parameters and fp32 master weights."""

    model_config = _FROZEN_STRICT

    enabled: StrictBool = Field(False, description=(
        "true: parameters and gradients in forward/backward are bfloat16; the optimizer updates "
        "fp32 master weights. DeepSpeed: bf16.enabled (default false)."))


class Fp16Config(BaseModel):
    """The `fp16` section: float16 parameters, fp32 master weights, loss scaling.

    The defaults hold whichever keys are given (DeepSpeed switches to an
    initial scale of 2^32 and hysteresis 1 when only `enabled` is given).
    """

    model_config = _FROZEN_STRICT

    enabled: StrictBool = Field(False, description=(
        "true: parameters and gradients in forward/backward are float16; the optimizer updates "
        "fp32 master weights. DeepSpeed: fp16.enabled (default false)."))
    loss_scale: Annotated[float, BeforeValidator(_number(0, True, " (0 = dynamic loss scaling)"))] = Field(
        0.0, description=("Static loss scale (a multiplier); 0 = dynamic loss scaling. "
                          "DeepSpeed: fp16.loss_scale (default 0)."))
    initial_scale_power: NonNegativeInt = Field(16, description=(
        "Dynamic scaling starts at a loss scale of 2^initial_scale_power. "
        "DeepSpeed: fp16.initial_scale_power (default 16)."))
    loss_scale_window: PositiveInt = Field(1000, description=(
        "Optimizer steps without overflow before the dynamic loss scale doubles. "
        "DeepSpeed: fp16.loss_scale_window (default 1000)."))
    hysteresis: PositiveInt = Field(2, description=(
        "Overflows (count) tolerated before the dynamic loss scale halves. "
        "DeepSpeed: fp16.hysteresis (default 2)."))
    consecutive_hysteresis: StrictBool = Field(False, description=(
        "true: a step without overflow restores the full hysteresis; false: it is restored only "
        "when the scale doubles. DeepSpeed: fp16.consecutive_hysteresis (default false)."))
    min_loss_scale: Annotated[float, BeforeValidator(_number(0, False))] = Field(1.0, description=(
        "The dynamic loss scale never goes below this; an overflow there stops training. "
        "DeepSpeed: fp16.min_loss_scale (default 1)."))


class NonFiniteConfig(BaseModel):
    """The `non_finite` section: what an optimizer step does when a gradient element is inf or nan.

    Applies in fp32 and bf16. With fp16 such a step is the loss scaler's
    business (skipped, the scale lowered, `LossScaleError` at `min_loss_scale`).
    """

    model_config = _FROZEN_STRICT

    action: Annotated[Literal["skip", "error"], BeforeValidator(_non_finite_action)] = Field("skip", description=(
        "\"skip\": the step is skipped on every rank (weights, optimizer state and LR schedule unchanged, "
        "the window's gradients dropped, counted in engine.skipped_steps and logged) and training goes on; "
        "\"error\": every rank raises NonFiniteError instead (the engine stays usable). fp32 and bf16 only "
        "(fp16's loss scaler skips such steps itself). DeepSpeed: none (it skips them only with fp16)."))
    # 10: a bad batch or two is survivable; ten in a row is a diverging run, and each skip wastes a step.
    max_consecutive_skips: PositiveInt = Field(10, description=(
        "Consecutive skipped steps (count) allowed: the next one raises NonFiniteError on every rank; "
        "a step that is applied resets the count. fp32 and bf16 only (fp16: min_loss_scale). "
        "DeepSpeed: none."))
