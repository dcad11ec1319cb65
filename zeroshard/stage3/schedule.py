"""GatherSchedule: when each stage-3 unit is gathered, prefetched and released.

- forward: a unit is gathered in its module's forward pre-hook and released
  in its forward hook, unless the step reuses it soon (a training forward:
  its reuse distance is under `max_reuse_distance`, plan/reuse.py), in
  which case it stays whole for its backward; the unit that followed it on
  the first training step is prefetched meanwhile;
- backward: a hook on the unit's outputs gathers it again (if it was
  released) before its backward runs, prefetching the next unit backward
  needs that is not whole, and it is released once its gradients are reduced;
- recomputation under activation checkpointing happens inside backward and
  releases nothing: the unit is needed for the backward that follows.

Every rank must gather the same units in the same order. Prefetching follows
the order recorded on the first step, so ranks that run the same control flow
prefetch alike. A unit is prefetched only if it has at most
`max_prefetch_numel` elements and the gathered elements stay within
`max_live_numel` (plan/prefetch.py, the rule the estimate prices); a gather
that forward or backward needs now always proceeds.
A unit kept from its forward holds the values that forward used (qwZ's
dequantized ones): an exact gather (a state dict, `gathered_parameters`)
releases it and gathers the shards' own values; a step, a load or a delayed
update landing releases it too (`shards_changed`).

Under torch.compile the forward hooks run eagerly (`torch.compiler.disable`),
each a graph break: traced, their collectives and the swaps of parameter
storage would become graph operations that autograd's saved tensors cannot
follow. The compiled graphs between them take the parameters as inputs, whole
as the hooks left them.
"""

from __future__ import annotations

from enum import Enum
from functools import partial

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from zeroshard.plan.prefetch import following, may_prefetch, next_to_gather
from zeroshard.plan.reuse import kept_units
from zeroshard.stage3.gathers import Gathers
from zeroshard.stage3.unit import Unit, UnitState


class Pass(Enum):
    """Which pass the hooks run in: a forward pre-hook inside backward is a recomputation."""

    FORWARD = "forward"
    BACKWARD = "backward"


class GatherSchedule:
    def __init__(self, units: list[Unit], gathers: Gathers, max_live_numel: int, max_prefetch_numel: int,
                 max_reuse_distance: int = 0):
        self.units, self.gathers, self.comm = units, gathers, gathers.comm
        self.max_live_numel = max_live_numel
        self.max_prefetch_numel = max_prefetch_numel
        self.max_reuse_distance = max_reuse_distance
        self.phase = Pass.FORWARD
        self._next_forward: dict[int, int] | None = None  # from the first step: unit -> the unit after it
        self._next_backward: dict[int, int] | None = None
        self._forward_seen: list[int] = []
        self._forward_done: list[int] = []  # the first step's units in the order their forwards ended
        self._backward_seen: list[int] = []
        self._reused: set[int] = set()  # from the first step: the units kept whole from forward to backward
        self.kept: set[int] = set()  # those kept now, from a training forward, until backward or the step

    def install(self, model: nn.Module) -> None:
        for i, unit in enumerate(self.units):
            unit.module.register_forward_pre_hook(_eager(partial(self._pre_forward, i)))
            unit.module.register_forward_hook(_eager(partial(self._post_forward, i)))
        # After every unit's own hook: a forward's prefetches that were never used are let go.
        model.register_forward_hook(_eager(self._after_model_forward))

    # -- hooks ---------------------------------------------------------------

    def _pre_forward(self, i: int, module, args) -> None:
        self.need(i, exact=False)
        if self.phase is Pass.BACKWARD:  # recomputation (activation checkpointing)
            self._note_backward(i)
            return
        self.kept.discard(i)  # in use again (a module called twice, the next micro-batch): its forward's own
        if self._next_forward is None:
            self._forward_seen.append(i)
        self._prefetch_after(i, self._next_forward)

    def _post_forward(self, i: int, module, args, output) -> None:
        if self.phase is Pass.BACKWARD:
            return
        if self._next_backward is None and i not in self._forward_done:
            self._forward_done.append(i)
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(partial(self._pre_backward, i))
            if i in self._reused:  # its backward comes soon: keep it rather than gather it again
                self.kept.add(i)
                return
        self.release(i)

    def _pre_backward(self, i: int, grad: torch.Tensor) -> None:
        if self.units[i].state is not UnitState.REDUCED:
            self.need(i, exact=False)
            self._note_backward(i)

    def _after_model_forward(self, module, args, output) -> None:
        if self.phase is Pass.FORWARD:
            self.release_all(keep=self.kept)

    def _note_backward(self, i: int) -> None:
        if self._next_backward is None and i not in self._backward_seen:
            self._backward_seen.append(i)
        self._prefetch_after(i, self._next_backward)

    # -- gathering -----------------------------------------------------------

    def need(self, i: int, exact: bool = True) -> None:
        """Make unit `i`'s parameters whole now: wait for its gather, starting it if needed.

        `exact` (outside training: state dicts, gathered_parameters): the shards' own values, never
        ZeRO++'s quantized or node-local gathers. A unit whole already is used as it is, except one kept
        from a forward, which an exact need gathers anew.
        """
        unit = self.units[i]
        if exact and i in self.kept:
            self.release(i)
        if unit.whole:
            return
        if unit.state is not UnitState.GATHERING:
            unit.start_gather(self.gathers, exact)
        unit.wait_gather()

    def _prefetch_after(self, i: int, after: dict[int, int] | None) -> None:
        # past the units whole already (kept from the forward): the next one to gather
        j = None if after is None else next_to_gather(i, after, lambda u: self.units[u].whole)
        if j is None or self.units[j].state is not UnitState.SHARDED:
            return
        if may_prefetch(self.units[j].gathered_numel, self.live_numel(), self.max_prefetch_numel,
                        self.max_live_numel):
            self.units[j].start_gather(self.gathers, exact=False)
            if j in after:  # shards on disk: read the unit after it meanwhile
                self.units[after[j]].read_shards()

    def in_use(self, i: int) -> bool:
        """Whether unit `i` is whole for a forward, a backward or an outer block (not only kept for a backward,
        which an exact need replaces with the shards' own values and lets go after it)."""
        return self.units[i].whole and i not in self.kept

    def live_numel(self) -> int:
        """Elements of the units gathered or being gathered now."""
        return sum(u.gathered_numel for u in self.units if u.whole or u.state is UnitState.GATHERING)

    def release(self, i: int) -> None:
        self.units[i].release()  # a prefetch never used lands first
        self.kept.discard(i)

    def release_all(self, keep: set[int] = frozenset()) -> None:
        """Release every unit but those in `keep`."""
        for i, unit in enumerate(self.units):
            if i not in keep and unit.state is not UnitState.SHARDED:
                unit.release()
        self.kept &= set(keep)


    def shards_changed(self) -> None:
        """After a step, a load or a delayed update landing: what a forward kept for a backward that never came
        is stale, and so are hpZ's secondary shards (the next gather goes over the whole group)."""
        for i in sorted(self.kept):
            self.release(i)
        for unit in self.units:
            unit.drop_secondaries()

    def forget(self) -> None:
        """After a failure: drop every gather, landed or not, without waiting for the other ranks."""
        for unit in self.units:
            unit.forget()
        self.kept.clear()
        self.phase = Pass.FORWARD

    # -- backward bookkeeping --------------------------------------------------

    def begin_backward(self) -> None:
        self.phase = Pass.BACKWARD
        self.kept.clear()  # backward's own now: each is released once reduced

    def on_reduced(self, i: int) -> None:
        """Unit `i`'s gradients are on their way: its backward is over, its parameters can go.

        Every op that used a trainable parameter has produced its gradient by
        now; a frozen parameter may still be needed by an op whose input
        gradient is pending, so a unit holding frozen ones waits for the end.
        """
        self.units[i].mark_reduced()

    def end_backward(self) -> None:
        """After every backward (or a failed one): release what is left; after the first, fix the prefetch order."""
        self.phase = Pass.FORWARD
        self.release_all()
        if self._next_backward is None and self._backward_seen:
            self._next_forward = following(self._forward_seen)
            self._next_backward = following(self._backward_seen)
            self._reused = kept_units(self._forward_done, self._backward_seen,
                                      [u.gathered_numel for u in self.units], self.max_reuse_distance,
                                      self.max_live_numel)


def _eager(hook):
    """`hook`, run outside torch.compile's graphs: see the module's note on compiled forwards."""
    return torch.compiler.disable(hook, reason="zeroshard stage 3: gathers and releases run eagerly")
