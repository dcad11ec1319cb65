"""The ranks' agreement on a step's units: ranks that run different units (MoE experts, a tower some batches
skip) still join every gather and reduction together.

Every gather and reduce-scatter of a unit is a collective, so every rank must
start the same ones in the same order, whatever its own forward runs. Inside
the model's forward and inside backward a unit's state changes only in a
round: each rank all-gathers a header of 1 + 2U bytes (`unit_check`, U the
units) saying whether it has finished the pass, which units it wants whole
(in use now, needed now, its prefetch, kept for backward) and, in backward,
which units have all their gradients here. From the same rows every rank then
does the same, in unit order (`Agreed`):

1. launches the reductions of the units every rank has ready (a rank that
   finished backward counts every unit as ready: it gives zeros for the
   units it never ran, so the mean is DDP's);
2. releases every gathered unit that no rank wants;
3. starts the gathers of the units some rank wants and none holds.

A rank needs a round only where its state must change: a unit it needs that
is not held, or gradients newly ready. One whose forward or backward is over
keeps taking part in rounds, wanting nothing, until every rank has finished
(`GatherSchedule.settle`); so the ranks run the same rounds, in number and
order, and the collectives the rounds start pair. Where nothing diverges a
step runs the same gathers as without the agreement, plus its rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroshard.comm import Comm, unit_check


@dataclass(frozen=True)
class Agreed:
    """What every rank does after a round, the same everywhere."""

    done: bool  # every rank has finished the pass
    wanted: frozenset[int]  # units some rank wants whole
    reduce: tuple[int, ...]  # units every rank has ready, in unit order


class UnitAgreement:
    """One round: this rank's header out, every rank's in, decoded."""

    def __init__(self, comm: Comm, units: int, device: torch.device):
        self.comm, self.units, self.device = comm, units, device

    def round(self, done: bool, want: set[int], ready: set[int]) -> Agreed:
        n = self.units
        header = torch.zeros(1 + 2 * n, dtype=torch.uint8)
        header[0] = int(done)
        header[[1 + i for i in want]] = 1
        header[[1 + n + i for i in ready]] = 1
        rows = unit_check(self.comm, header.to(self.device)).cpu()
        wanted = rows[:, 1:1 + n].amax(dim=0)
        ready_all = rows[:, 1 + n:].amin(dim=0)
        return Agreed(bool(rows[:, 0].amin()), frozenset(wanted.nonzero().flatten().tolist()),
                      tuple(ready_all.nonzero().flatten().tolist()))


class InputsDone(torch.autograd.Function):
    """Identity on a unit's inputs whose backward says that the unit's backward has produced their gradients
    (FSDP's post-backward): from then on the unit's frozen parameters are read by nothing."""

    @staticmethod
    def forward(ctx, done, *tensors):
        ctx.done = done
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.done()
        return (None, *grads)


class Use:
    """Which units this rank wants whole now, from its own forward and backward (the round's `want`)."""

    def __init__(self, units: int):
        self.units = units
        self.reset()

    def reset(self) -> None:
        self.calls = [0] * self.units  # forward: calls of each unit's forward under way
        self.backward: set[int] = set()  # backward: units whose backward began here
        self.inputs_pending = [0] * self.units  # wrapped forward calls whose inputs' gradients are still to come
        self.unhooked: set[int] = set()  # a call whose inputs take no gradient: its frozen part waits for the end
        self.prefetch: int | None = None

    def wanted(self, kept: set[int], backward_over) -> set[int]:
        want = {i for i, calls in enumerate(self.calls) if calls} | kept
        want |= {i for i in self.backward if not backward_over(i)}
        if self.prefetch is not None:
            want.add(self.prefetch)
        return want

    def frozen_over(self, i: int) -> bool:
        """Whether every forward call of unit `i` has had its inputs' gradients."""
        return i not in self.unhooked and not self.inputs_pending[i]
