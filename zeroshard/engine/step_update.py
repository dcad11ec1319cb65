"""StepUpdate: a step's update of the masters and parameters, now or delayed (`core/delayed_update.py`).

Without `offload_optimizer.delayed_update` the boundary's update runs at
once: the optimizer steps the masters wherever they live (`OptimizerTiers`),
casts them into the parameters, and the post-step all-gathers start
(stages 1-2). With it, engine.step() at an accumulation boundary is:

1. `land`: wait for the previous step's CPU step (if one is in
   flight), cast its masters into the parameters and all-gather them
   (stages 1-2): on this thread, so every collective keeps one order on
   every rank;
2. the step check, unscale and clip of this step's gradients, as always;
3. `apply`: start their CPU step on the background thread and return
   (from step `delayed_update_warmup` on; before it, the step runs here and
   the parameters take it at once).

The next forward and backward then run with the parameters of the step
before; a skipped step (inf or nan) starts nothing. The optimizer step
reads its own copy of the gradient shard (`Bucket.copy_grad_for_step`), so
the next backward's reductions never write under it. Whatever writes the
model out or replaces the state (checkpoint save and load, save_pretrained,
save_16bit_model) lands the update first (`engine.flush_update`), so a resume
continues exactly as the run that saved; `memory_stats` waits for it.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from zeroshard.comm import Comm
from zeroshard.config import Config
from zeroshard.core.bucket import Bucket
from zeroshard.core.delayed_update import DelayedUpdate
from zeroshard.core.faults import agreed
from zeroshard.core.optimizer_tiers import OptimizerTiers
from zeroshard.core.param_gather import PostStepGather
from zeroshard.engine.offload import Offload
from zeroshard.stage3.schedule import GatherSchedule


def delayed_update(config: Config, tiers: OptimizerTiers, buckets: list[Bucket]) -> DelayedUpdate | None:
    """The delayed update the config asks for (None without `offload_optimizer.delayed_update`)."""
    offload = config.zero_optimization.offload_optimizer
    if not offload.delayed_update:
        return None
    for bucket in buckets:
        bucket.copy_grad_for_step()
    return DelayedUpdate(tiers, offload.delayed_update_warmup)


T = TypeVar("T")


class StepUpdate:
    """The engine's order of a step's update: land the one in flight, apply this one, gather the parameters."""

    def __init__(self, offload: Offload, post_step: PostStepGather, delayed: DelayedUpdate | None,
                 schedule: GatherSchedule | None, group: Comm, device: torch.device):
        """`group`: the ranks that hear of a failed swap-file read or write (the whole mesh on one)."""
        self.offload, self.post_step, self.delayed, self.schedule = offload, post_step, delayed, schedule
        self.group, self.device = group, device

    def land(self) -> None:
        """Apply the delayed update in flight now (`offload_optimizer.delayed_update`): wait for its CPU step,
        cast the masters into the parameters and, at stages 1-2, all-gather them. The next forward then runs
        with every update computed so far. Every rank must call it, at the same step (a collective at stages
        1-2); without a delayed update in flight it does nothing. Checkpoints and exports call it themselves."""
        self.post_step.wait()  # the last step's gathers in flight (overlap_param_gather), first
        if self.delayed is not None and self.on_every_rank(self.delayed.land, "the delayed update"):
            self.offload.tiers.cast_to_params()
            self.gather_params()

    def gather_params(self) -> None:
        """The parameters replicated over the ranks all-gathered from their masters' shards."""
        if self.schedule is not None:  # kept units and hpZ's secondary shards are stale after a step or a load
            self.schedule.shards_changed()
        self.post_step.start(wait=True)

    def apply(self, grads: list[torch.Tensor], coef: float, step: int) -> None:
        """Optimizer step `step`'s update of the masters (`grads` unscaled and clipped; those on disk take `coef`
        as they are read), and of the parameters: now, or (a delayed update) in the background, landing at the
        next boundary."""
        if self.delayed is not None and self.delayed.delays(step):
            self.delayed.start(grads)
            return
        # The optimizer sees gradients only during its step, so the user's optimizer.zero_grad()
        # between micro-steps cannot touch the window's accumulating gradients. The tiers step it over
        # the masters wherever they live and cast each into its parameters.
        self.on_every_rank(lambda: self.offload.tiers.step(grads, coef), f"optimizer step {step}")
        self.post_step.start()  # stages 1-2; waited in the next forward with overlap_param_gather

    def on_every_rank(self, work: Callable[[], T], whose: str) -> T:
        """`work()`; with swap files, which may fail on one rank alone, or a delayed update (its CPU step may
        fail on one rank alone too), every rank hears of a failure first."""
        if not self.offload.swaps and self.delayed is None:
            return work()
        return agreed(self.group, work, f"the swap-file reads and writes of {whose}", self.device)

    def wait(self) -> None:
        """Wait for the delayed update in flight to be in the masters (the parameters take it at the next
        boundary): before reading the optimizer's state."""
        if self.delayed is not None:
            self.delayed.wait()
