"""GradReducer: launches gradient reductions as backward frees them.

A target is what is reduced as one: a bucket (stages 0-2), or a stage-3 unit
(all its buckets). Every rank must issue the same collectives in the same
order. At stages 0-2 backward finishes buckets in an order that can differ
between ranks (a parameter unused on one rank only), so a target is launched
only once it and every target before it in the fixed list are ready; a late
one delays its successors but never swaps places with them. At stage 3
(`ordered=False`) the ranks may run different units, so the reducer only
tracks readiness: the ranks agree which units every rank has ready, and the
schedule launches those (`launch`, stage3/agreement.py). Targets never
reached (unused parameters) are launched at the end of backward, in list
order, with zero gradients for what was missing. At most `MAX_IN_FLIGHT` reductions are in flight (plan/staging.py:
the estimate's staging counts the blocks they hold).
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol

import torch.nn as nn

from zeroshard.comm import Comm, Pending, wait_all
from zeroshard.core.switches import StageSwitches
from zeroshard.core.staging import StagingPool
from zeroshard.errors import ZeroshardError
from zeroshard.plan.staging import MAX_IN_FLIGHT

log = logging.getLogger(__name__)


class GradientError(ZeroshardError, RuntimeError):
    """A gradient that arrives when it can no longer be reduced (after its bucket or unit was launched)."""


class Target(Protocol):
    """What the reducer drives: a `Bucket`, or a stage-3 `Unit` (its buckets as one)."""

    params: list[nn.Parameter]  # trainable, in the order the hooks index them
    switches: StageSwitches

    def attach_grads(self) -> None: ...

    def take_grad(self, index: int, pool: StagingPool) -> None: ...

    def reduce_grad(self, comm: Comm, pool: StagingPool, scale: float) -> Pending: ...


class GradReducer:
    """Per-backward bookkeeping: which targets are ready, launched, in flight."""

    def __init__(self, targets: list[Target], comm: Comm, pool: StagingPool, overlap: bool,
                 names: dict[int, str], ordered: bool = True, on_launch: Callable[[int], None] | None = None):
        self.targets = targets
        self.ordered = ordered
        self.on_launch = on_launch  # called with a target's index once its reduction is launched
        self.names = names  # id(parameter) -> its name in the model, for messages
        self.comm = comm
        self.pool = pool
        self.overlap = overlap
        self._missing = [0] * len(targets)
        self._seen: set[tuple[int, int]] = set()
        self._launched = [False] * len(targets)
        self._in_flight: list[Pending] = []
        self._reduce = False
        self._scale = 1.0
        self._warned_unused: set[tuple[int, int]] = set()

    def begin(self, reduce: bool, scale: float) -> None:
        """Start one backward; `reduce` says whether this micro-step communicates."""
        self._reduce, self._scale = reduce, scale
        self._launched = [False] * len(self.targets)
        self._missing = [len(u.params) for u in self.targets]
        self._seen.clear()
        for target in self.targets:
            target.attach_grads()

    def on_grad(self, target_index: int, param_index: int) -> None:
        """A parameter's gradient for this backward is complete (autograd hook)."""
        target = self.targets[target_index]
        if (target_index, param_index) in self._seen and self._launched[target_index]:
            raise GradientError(
                f"parameter '{self.names[id(target.params[param_index])]}' received a second gradient in one backward "
                "after its bucket was already reduced (reentrant activation checkpointing does this); use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
            )
        target.take_grad(param_index, self.pool)
        if (target_index, param_index) not in self._seen:
            self._seen.add((target_index, param_index))
            self._missing[target_index] -= 1
        if self._reduce:
            self._launch_ready(target_index)

    def finish(self) -> None:
        """After backward: launch what is left, in order, and wait for everything."""
        try:
            if self._reduce:
                self._warn_unused()
                for index, launched in enumerate(self._launched):
                    if not launched:
                        self.launch(index)
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Let launched reductions land, then forget this backward (also after a failed one)."""
        try:
            wait_all(self._in_flight)
        finally:
            self._in_flight.clear()

    def _warn_unused(self) -> None:
        unused = [(ui, pi) for ui, u in enumerate(self.targets) for pi in range(len(u.params))
                  if (ui, pi) not in self._seen and (ui, pi) not in self._warned_unused and not _held(u, pi)]
        if unused:
            self._warned_unused.update(unused)
            listed = ", ".join(self.names[id(self.targets[ui].params[pi])] for ui, pi in unused)
            # Where other ranks ran them (an MoE expert this rank routed nothing to) their mean is not zero.
            log.warning("parameters received no gradient on this rank in this backward: it reduces zeros for "
                        "them (where no rank gave one, the optimizer still applies weight decay and momentum "
                        "to them): %s", listed)

    def complete(self, index: int) -> bool:
        """Whether every gradient of target `index` arrived in this backward and it is not launched yet."""
        return self._missing[index] <= 0 and not self._launched[index]

    def launched(self, index: int) -> bool:
        return self._launched[index]

    def _launch_ready(self, target_index: int) -> None:
        if not self.ordered:  # stage 3: the schedule launches what every rank has ready
            return
        index = self._launched.index(False) if not all(self._launched) else len(self.targets)
        while index < len(self.targets) and self._missing[index] <= 0:
            self.launch(index)
            index += 1

    def launch(self, index: int) -> None:
        """Launch target `index`'s reduction now (every rank launches the same targets in the same order)."""
        self._launched[index] = True
        while len(self._in_flight) >= MAX_IN_FLIGHT:  # frees its buffers before taking new ones
            self._in_flight.pop(0).wait()
        target = self.targets[index]
        for k in range(len(target.params)):  # a gradient an earlier pass held on .grad, none in this one
            if (index, k) not in self._seen:
                target.take_grad(k, self.pool)
        pending = target.reduce_grad(self.comm, self.pool, self._scale)
        if self.overlap:
            self._in_flight.append(pending)
        else:
            pending.wait()
        if self.on_launch is not None:
            self.on_launch(index)


def _held(target: Target, index: int) -> bool:
    """Stages 2-3: a gradient an earlier backward pass left on `.grad` (engine/grad_sync.py), reduced with this one's."""
    return target.switches.shard_grads and target.params[index].grad is not None
