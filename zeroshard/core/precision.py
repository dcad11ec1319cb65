"""Mixed precision: the dtype of each tensor role, and fp16's dynamic loss scaler.

With bf16 or fp16 enabled, parameters and gradients in forward and backward
are 16-bit (2 bytes per element each), while the optimizer updates fp32
master weights (4 bytes) with fp32 moments (8 bytes for Adam): the ZeRO
paper's 2 + 2 + 12 bytes per parameter. Gradients are reduced in the
communication dtype and accumulated across micro-steps in fp32.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from zeroshard.config.schema import Config, Fp16Config
from zeroshard.dtypes import DTYPES, MASTER_DTYPE
from zeroshard.errors import ZeroshardError

log = logging.getLogger(__name__)

# DTYPES is zeroshard.dtypes' table, named here too for the code that imported it from this module.
__all__ = ["DTYPES", "LossScaleError", "LossScaler", "Precision", "cast_inputs"]


@dataclass(frozen=True)
class Precision:
    """Which dtype each tensor role has."""

    param_dtype: torch.dtype  # parameters, activations and gradients in forward/backward
    reduce_dtype: torch.dtype  # gradients on the wire
    master_dtype: torch.dtype = MASTER_DTYPE  # what the optimizer updates, and its state

    @classmethod
    def from_config(cls, config: Config) -> "Precision":
        param = DTYPES[config.training_dtype]
        wire = config.communication_data_type
        return cls(param, DTYPES[wire] if wire is not None else param)

    @property
    def mixed(self) -> bool:
        """Whether parameters are kept apart from a master copy of another dtype."""
        return self.param_dtype != self.master_dtype

    def reduce_factors(self, world_size: int, scale: float) -> tuple[float, float]:
        """Multipliers (before, after) around a sum over `world_size` ranks that should yield `scale` x sum.

        In fp16 both are 1/sqrt(N) (times `scale` after): a sum of N fp16
        gradients can overflow where their mean would not.
        """
        if self.reduce_dtype == torch.float16 and world_size > 1:
            before = 1.0 / math.sqrt(world_size)
            return before, scale / before
        return 1.0, scale


def cast_inputs(value, dtype: torch.dtype):
    """`value` with every floating-point tensor in it (nested in tuples, lists, dicts) cast to `dtype`."""
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        cast = [cast_inputs(v, dtype) for v in value]
        return type(value)(*cast) if hasattr(value, "_fields") else type(value)(cast)  # namedtuples too
    if isinstance(value, dict):
        return type(value)((k, cast_inputs(v, dtype)) for k, v in value.items())
    return value


class LossScaleError(ZeroshardError, RuntimeError):
    """fp16 gradients overflow even at the minimum loss scale."""


class LossScaler:
    """fp16's loss scale, with DeepSpeed's semantics (its `DynamicLossScaler`) and key names.

    Dynamic (`loss_scale` 0): the scale starts at 2^initial_scale_power; an
    overflow uses up one unit of hysteresis, and when none is left the scale
    halves (not below `min_loss_scale`); after `loss_scale_window` steps
    without overflow it doubles, which also restores the hysteresis (after
    every good step with `consecutive_hysteresis`). Static: the scale never
    changes; overflowing steps are still skipped.
    """

    def __init__(self, cfg: Fp16Config):
        self.dynamic = cfg.loss_scale == 0
        self.scale = 2.0 ** cfg.initial_scale_power if self.dynamic else cfg.loss_scale
        self.cfg = cfg
        self._hysteresis_left = cfg.hysteresis
        self._iteration = 0  # updates so far
        self._last_overflow = -1  # iteration of the last overflow

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the scale and where the dynamic rules stand."""
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left,
                "iteration": self._iteration, "last_overflow": self._last_overflow}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self._hysteresis_left = state["hysteresis_left"]
        self._iteration = state["iteration"]
        self._last_overflow = state["last_overflow"]

    def update(self, overflow: bool, step: int) -> None:
        """Account for optimizer step `step` (counted from 0) having overflowed or not."""
        if self.dynamic and overflow:
            self._on_overflow(step)
        elif self.dynamic:
            if self.cfg.consecutive_hysteresis:
                self._hysteresis_left = self.cfg.hysteresis
            if (self._iteration - self._last_overflow) % self.cfg.loss_scale_window == 0:
                self._hysteresis_left = self.cfg.hysteresis
                self.scale *= 2.0
        self._iteration += 1

    def _on_overflow(self, step: int) -> None:
        self._last_overflow = self._iteration
        if self._hysteresis_left > 1:
            self._hysteresis_left -= 1
            return
        if self.scale <= self.cfg.min_loss_scale:
            raise LossScaleError(
                f"fp16 gradients overflowed (inf or nan) at step {step} with the loss scale already at "
                f"min_loss_scale={self.cfg.min_loss_scale:g}: they exceed fp16's range (max 65504) even "
                "unscaled, so every step would be skipped. Train in bf16 (\"bf16\": {\"enabled\": true}, "
                "fp32's range) where the hardware supports it, or look for the source of inf/nan "
                "(learning rate too high, a loss that is inf or nan)")
        self.scale = max(self.scale / 2.0, self.cfg.min_loss_scale)
