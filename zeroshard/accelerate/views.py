"""What `Accelerator.prepare` returns for the optimizer and LR scheduler, and the schedule the engine steps.

The script keeps calling `optimizer.step()`, `scheduler.step()` and
`optimizer.zero_grad()` as under DDP; the engine has done all three inside
`accelerator.backward` (its step at the window's end), so the views' own
calls do nothing (`engine/stepped.py`).

The LR schedule is stepped as Accelerate steps it under DDP, so a script
trains the same on zeroshard: once per optimizer step with
`split_batches=True`, else `num_processes` times (Accelerate's
`AcceleratedScheduler`: the script sized its schedule on the dataloader
before it was sharded, whose length is `num_processes` times a rank's), and
not at all for a step skipped for inf or nan gradients. Accelerate's own
DeepSpeed path steps it once per step; DDP's count is the one that keeps a
script's results when it moves from DDP to zeroshard.
"""

from __future__ import annotations

import torch

from zeroshard.engine.stepped import SteppedByEngine


class EngineOptimizer(SteppedByEngine):
    """The script's optimizer: the engine's (its param groups, state, learning rate), whose step and
    zero_grad the engine runs; `step_was_skipped` as Accelerate's `AcceleratedOptimizer` answers it."""

    def __init__(self, engine):
        super().__init__(engine.optimizer)
        self.engine = engine

    @property
    def step_was_skipped(self) -> bool:
        """Whether the window's last step was not applied (inf or nan gradients; fp16's overflow), as
        `accelerator.optimizer_step_was_skipped` reads it after the window's last backward."""
        engine = self.engine
        return engine.micro_steps % engine.config.gradient_accumulation_steps == 0 and engine.micro_steps > 0 \
            and not engine.was_step_applied()


class AcceleratedSteps:
    """The LR scheduler as `engine.lr_scheduler`: each `step()` steps it `per_step` times (see the module
    docstring); `state_dict`, `load_state_dict` and every other attribute are the scheduler's, so the engine's
    checkpoint holds the scheduler's own state."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, per_step: int):
        self.scheduler, self.per_step = scheduler, per_step

    def step(self) -> None:
        """`per_step` scheduler steps; a OneCycleLR stops at its `total_steps`, as Accelerate's does."""
        for _ in range(self.per_step):
            total = getattr(self.scheduler, "total_steps", None)
            if total is not None and self.scheduler._step_count > total:
                return
            self.scheduler.step()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str):
        return getattr(self.scheduler, name)
