"""OptimizerStep: the step at an accumulation boundary, from reduced gradients to updated masters.

A step is: the step check (one all-gather of each rank's gradient squares,
non-finite flag and counters, `core/grad_norm.py`), unscale and clip in one
multiply, optimizer step on the fp32 master, cast to 16 bits, all-gather
(stages 1-2; `StepUpdate`). With swap files (offload to disk), the ranks
agree after the optimizer step that every rank's reads and writes succeeded
(`core/faults.py`) before that all-gather: a damaged swap file on one rank
raises `OffloadError` on every rank and leaves the engine FAILED.

A step whose gradients hold inf or nan on any rank is not applied on any
rank (weights, masters, optimizer state and LR scheduler untouched, the
window's gradients dropped, `global_steps` and `skipped_steps` advance,
`global_grad_norm` is inf). fp16 then lowers the loss scale as DeepSpeed's
dynamic scaler does; fp32 and bf16 follow the config's `non_finite` section:
skip and log (`NonFiniteError` after `max_consecutive_skips` in a row), or
raise `NonFiniteError` at once. Either error leaves the engine usable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import logging

import torch

from zeroshard.comm import Comm
from zeroshard.config import Config
from zeroshard.core.bucket import Bucket
from zeroshard.core.switches import StageSwitches
from zeroshard.core.grad_norm import NonFiniteSkips, StepCheck, check_step, clip_coefficient
from zeroshard.core.precision import LossScaler
from zeroshard.core.staging import StagingPool
from zeroshard.engine.offload import Offload
from zeroshard.engine.step_update import StepUpdate
from zeroshard.stage3.schedule import GatherSchedule

if TYPE_CHECKING:  # imported by the engine only with a mesh: `import zeroshard` stays free of DTensor
    from zeroshard.parallel.cross import CrossParallel

log = logging.getLogger(__name__)


class OptimizerStep:
    """The boundary's step check and update; the count of non-finite steps skipped in a row."""

    def __init__(self, config: Config, comm: Comm, cross: CrossParallel | None, buckets: list[Bucket],
                 switches: StageSwitches, offload: Offload, update: StepUpdate, device: torch.device,
                 pool: StagingPool, schedule: GatherSchedule | None, scaler: LossScaler | None):
        self.config, self.comm, self.cross, self.buckets, self.switches = config, comm, cross, buckets, switches
        self.offload, self.update, self.device = offload, update, device
        self.pool, self.schedule, self.scaler = pool, schedule, scaler
        self.skips = NonFiniteSkips(config.non_finite)  # fp32 and bf16: skipped steps in a row

    def run(self, global_steps: int, micro_steps: int, divisor: float) -> StepCheck:
        """Check this window's reduced gradients on every rank and, if every rank's are finite, update with them
        divided by `divisor` (the loss scale times `engine.scale_gradients`' factor) and clipped."""
        # fp32 gradients for the optimizer: new tensors, freed after the step, when gradients are 16-bit.
        tiers = self.offload.tiers  # a swap-file error backward met on some rank is raised on every rank
        grads = (self.update.on_every_rank(tiers.gradients, f"the gradient shards of optimizer step {global_steps}")
                 if tiers.grad_swaps else tiers.gradients())
        check = check_step(self._grad_norms(grads), self.cross.world if self.cross else self.comm, global_steps,
                           micro_steps, divisor, self.device, self.comm, self.cross.dp_groups() if self.cross else None)
        if not check.nonfinite_ranks:
            coef = 1.0 / divisor  # unscale, scale and clip in one multiply
            if self.config.gradient_clipping > 0:
                coef *= clip_coefficient(check.norm, self.config.gradient_clipping)
            if coef != 1.0:
                torch._foreach_mul_(grads, coef)
            self.update.apply(grads, coef, global_steps)  # now, or started in the background (a delayed update)
            self.skips.applied()
        return check

    def end_window(self, overflow: bool, step: int) -> None:
        """After optimizer step `step`, applied or skipped: the window's gradients dropped, the loss scale moved."""
        for bucket in self.buckets:
            bucket.zero_grad(self.pool)
        if self.schedule is not None:  # kept units and hpZ's secondary shards live for one step, applied or skipped
            self.schedule.shards_changed()
        if self.scaler is not None:
            before = self.scaler.scale
            self.scaler.update(overflow, step)
            if self.scaler.scale != before:  # error feedback holds loss-scaled residuals: now in the new scale's units
                for bucket in self.buckets:
                    if bucket.feedback is not None:
                        bucket.feedback.rescale(self.scaler.scale / before)

    def skipped(self, check: StepCheck, step: int, old_scale: float) -> None:
        """Step `step` was skipped (inf or nan): fp16 logs its new loss scale; fp32 and bf16 count the skips in
        a row (config `non_finite`: `NonFiniteError` on every rank) and log them."""
        if self.scaler is not None:
            if self.comm.rank == 0:
                log.warning("fp16 gradients overflowed at step %d: step skipped, loss scale %g -> %g",
                            step, old_scale, self.scaler.scale)
            return
        in_a_row = self.skips.skipped(step, check.nonfinite_ranks)  # or NonFiniteError, on every rank
        if self.comm.rank == 0:
            log.warning("gradients hold inf or nan at step %d (reduced gradients of rank(s) %s): step skipped "
                        "on every rank (%d in a row, at most %d)", step, ", ".join(map(str, check.nonfinite_ranks)),
                        in_a_row, self.config.non_finite.max_consecutive_skips)

    def _grad_norms(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The L2 norm of each part of the gradients this rank counts; a gradient shard on disk gives the
        norm its bucket took before writing it (the step reads it back only later, sub-group by sub-group)."""
        norms = list(torch._foreach_norm(self._owned(grads)))
        if self.cross is None:  # one part per bucket (gradients on disk exist only then)
            norms = [n if b.on_disk is None else torch.tensor(b.on_disk.norm) for b, n in zip(self.buckets, norms)]
        return norms

    def _owned(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's disjoint part of the gradients for the norm: at stage 0, its shard's slice of the
        replicated gradient; on a mesh, only what it counts (a copy replicated over tp or pp counts once)."""
        owned = grads if self.switches.shard_optimizer else [b.flat.shard(g) for b, g in zip(self.buckets, grads)]
        if self.cross is None:
            return owned
        return [part for b, g in zip(self.buckets, owned) for part in self.cross.counted(b.flat, g)]
