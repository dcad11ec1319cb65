"""ZeroshardPrecision: Lightning's backward and optimizer step, run by the engine.

Lightning's automatic loop calls the strategy's precision plugin for the
backward of each micro-batch and, because the strategy handles gradient
accumulation, for the optimizer step of each micro-batch too; the engine
decides when the window ends, reduces, clips and updates there. Mixed
precision is the engine's (its bf16 or fp16 block): the plugin keeps only
the flag's name, and casting, loss scaling and clipping happen inside the
engine.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException


class ZeroshardPrecision(Precision):
    """Lightning's precision flag (`Trainer(precision=...)`), carried out by the engine's config."""

    def __init__(self, precision: str = "32-true"):
        self.precision = precision

    def backward(self, tensor: torch.Tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        """The engine's backward. Lightning has divided the loss by `accumulate_grad_batches` and the engine
        divides by its accumulation steps (the same number) again, so the loss it gets is multiplied back:
        the window's gradient is the mean over its micro-batches, as under DDP."""
        engine = model.trainer.strategy.engine
        engine.backward(tensor * engine.gradient_accumulation_steps)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """The closure (training_step and backward), then `engine.step()`: an update at the window's end only."""
        result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            raise MisconfigurationException(
                "training_step returned None (skip this batch), which ZeroshardStrategy cannot do: every rank must "
                "run every micro-batch's backward for the window's reductions; return a loss (0 * loss to skip)")
        model.trainer.strategy.engine.step()
        return result

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        """The engine clips at its step, over all shards, by the config's `gradient_clipping`."""
