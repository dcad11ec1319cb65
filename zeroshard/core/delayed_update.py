"""DelayedUpdate: ZeRO-Offload's one-step delayed parameter update (DPU), the CPU step on a thread of its own.

ZeRO-Offload (Ren et al., 2021, section 5.2): once the optimizer step runs
on the CPU it can overlap the device's work. The CPU step of step k runs on
a background thread while step k+1's forward and backward run with the
parameters of step k-1; at step k+1's boundary the engine waits for it,
casts the updated masters into the parameters (and all-gathers them at
stages 1-2), then starts step k+1's CPU step. Every gradient is applied
exactly once, one step late: the update of step k is computed from the
gradient of parameters that lack update k-1. The first `warmup` steps run
without the delay (the paper's warm-up, while gradients change fast; the
authors' code delays from the 21st step on). At step `warmup` nothing is in
flight yet, so no update lands there: the paper's "skipped" step.

What the thread touches, and why it is safe:
- only the masters, the optimizer state (and their swap files on disk) and
  the gradient copies it was given; the parameters, the gradient shards the
  next backward sums into, and every collective stay with the main thread,
  which runs them in the same order on every rank;
- the optimizer's settings as they were at the step: an LR scheduler that
  changes the live param groups meanwhile acts on the next step (`_frozen`).

This module knows no collective; the engine orders the work
(`engine/delayed_update.py`).
"""

from __future__ import annotations

import threading

import torch

from zeroshard.core.optimizer_tiers import OptimizerTiers
from zeroshard.core.optimizers import Optimizers


def _frozen(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer with its param groups' settings copied as they are now; the same masters, the same
    state (its step updates the real one).

    An instance of the same class sharing the optimizer's attributes, param groups as copies: the
    class's `step` reads `self.param_groups`. The instance attribute `step` an LR scheduler puts on
    the optimizer (a wrapper bound to the original) is left out, so the class's runs.
    """
    frozen = object.__new__(type(optimizer))
    frozen.__dict__.update({k: v for k, v in vars(optimizer).items() if k != "step"})
    if isinstance(optimizer, Optimizers):  # each member steps with its groups' copies
        frozen.optimizers = [_frozen(member) for member in optimizer.optimizers]
        frozen.param_groups = [group for member in frozen.optimizers for group in member.param_groups]
    else:
        frozen.param_groups = [dict(group) for group in optimizer.param_groups]
    return frozen


class DelayedUpdate:
    """The CPU step in flight, at most one: `start` it at a step, `land` it at the next."""

    def __init__(self, tiers: OptimizerTiers, warmup: int):
        self.tiers = tiers
        self.warmup = warmup  # steps taken without the delay
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._unlanded = False  # a step started whose masters the parameters have not taken yet

    def delays(self, step: int) -> bool:
        """Whether optimizer step `step` (from 0) runs in the background."""
        return step >= self.warmup

    @property
    def unlanded(self) -> bool:
        return self._unlanded

    def start(self, grads: list[torch.Tensor]) -> None:
        """Step the masters over `grads` (unscaled and clipped already) on a thread of its own. The caller
        keeps `grads` unchanged until `land`, and lands the step before it first."""
        if self._unlanded:
            raise RuntimeError("a delayed update is started while the one before it has not landed: land it first")
        optimizer = _frozen(self.tiers.optimizer)
        # torch's LR scheduler checks this flag, which its wrapper of optimizer.step() sets, to warn of a
        # scheduler step before any optimizer step: the step is taken, on the other thread.
        self.tiers.optimizer._opt_called = True
        self._error, self._unlanded = None, True
        self._mark(True)
        self._thread = threading.Thread(target=self._run, args=(grads, optimizer), name="zeroshard-delayed-update")
        self._thread.start()

    def _run(self, grads: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        try:
            self.tiers.step(grads, optimizer=optimizer, cast=False)
        except BaseException as exc:  # raised on the main thread, by `wait`
            self._error = exc

    def wait(self) -> None:
        """Block until the step in flight is in the masters and the optimizer state (if one is); raise its
        error, if it failed (the masters may then be partly updated)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error, self._unlanded = self._error, None, False
            self._mark(False)
            raise error

    def land(self) -> bool:
        """`wait`, then hand over the step: True if one was started since the last `land` (the caller casts
        the masters into the parameters now)."""
        self.wait()
        landed, self._unlanded = self._unlanded, False
        self._mark(False)
        return landed

    def _mark(self, stepping: bool) -> None:
        """Tell the buckets whose masters the thread updates (an edit of their parameters then raises)."""
        for bucket in self.tiers.buckets:
            bucket.stepping = stepping
