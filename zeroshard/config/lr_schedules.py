"""DeepSpeed's warmup learning-rate schedules as torch LR schedulers.

The formulas follow deepspeed/runtime/lr_schedules.py (WarmupLR,
WarmupDecayLR, WarmupCosineLR). DeepSpeed counts `last_batch_iteration` from
-1 at construction and its engine steps the schedule after every optimizer
step, so optimizer step k (1-based) runs at iteration k - 2: the first step
uses the "not started" value (warmup_min_lr, or ratio 0 for the cosine
schedule) and the second step iteration 0. A torch scheduler is at
`last_epoch` 0 after construction, so iteration = last_epoch - 1 reproduces
DeepSpeed step for step.
"""

from __future__ import annotations

import abc
import math

import torch
from torch.optim.lr_scheduler import LRScheduler


def warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """How far warmup has come at `iteration` (0 at iteration 0, 1 at the end).

    `warmup_num_steps` is the value after DeepSpeed's max(2, n), so log(n) > 0.
    """
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


class _DeepSpeedSchedule(LRScheduler, abc.ABC):
    """Shared plumbing: per-group learning rate as a function of DeepSpeed's iteration."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_num_steps: int, warmup_type: str):
        self.warmup_num_steps = max(2, warmup_num_steps)  # as DeepSpeed: log warmup needs n >= 2
        self.warmup_type = warmup_type
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        iteration = self.last_epoch - 1
        return [self.lr_at(iteration, i) for i in range(len(self.optimizer.param_groups))]

    @abc.abstractmethod
    def lr_at(self, iteration: int, group: int) -> float:
        """Param group `group`'s learning rate at DeepSpeed's `iteration` (-1 before the first step)."""


class WarmupLR(_DeepSpeedSchedule):
    """warmup_min_lr -> warmup_max_lr over warmup_num_steps (log or linear), then constant."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log"):
        self.min_lr = warmup_min_lr
        # DeepSpeed: an unset warmup_max_lr is the lr of the optimizer's first param group.
        self.max_lr = optimizer.param_groups[0]["lr"] if warmup_max_lr is None else warmup_max_lr
        super().__init__(optimizer, warmup_num_steps, warmup_type)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lr_at(self, iteration: int, group: int) -> float:
        if iteration < 0:
            return self.min_lr
        return self.min_lr + (self.max_lr - self.min_lr) * self.gamma(iteration)


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_lr: float = 0.0, warmup_max_lr: float | None = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log"):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return super().gamma(iteration)
        decay_steps = max(1.0, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - iteration) / decay_steps)


class WarmupCosineLR(_DeepSpeedSchedule):
    """A ratio of each group's lr: warmup_min_ratio -> 1 over warmup, then cosine to cos_min_ratio."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001, warmup_type: str = "log"):
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio, self.cos_min_ratio = warmup_min_ratio, cos_min_ratio
        super().__init__(optimizer, warmup_num_steps, warmup_type)

    def ratio(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            rise = warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + rise * (1.0 - self.warmup_min_ratio)
        # Progress is clamped at 1, so the ratio stays at cos_min_ratio past total_num_steps.
        progress = min(1.0, (iteration - self.warmup_num_steps + 1)
                       / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, iteration: int, group: int) -> float:
        return self.base_lrs[group] * self.ratio(iteration)
