"""GatherSchedule: when each stage-3 unit is gathered, prefetched and released.

- forward: a unit is gathered in its module's forward pre-hook and released
  in its forward hook, unless the step reuses it soon (a training forward:
  its reuse distance is under `max_reuse_distance`, plan/reuse.py), in
  which case it stays whole for its backward; the unit that followed it on
  the first training step is prefetched meanwhile;
- backward: a hook on the unit's outputs gathers it again (if it was
  released) before its backward runs, prefetching the next unit backward
  needs that is not whole, and it is released once its gradients are reduced
  and, for a unit holding frozen parameters, once its inputs' gradients are
  made (`InputsDone`);
- recomputation under activation checkpointing happens inside backward and
  releases nothing: the unit is needed for the backward that follows.

Inside the model's forward and inside backward the ranks may run different
units: every gather, release and reduction there is decided in the ranks'
rounds (agreement.py), so the collectives pair whatever each rank ran; a
unit whose forward is over is hidden (its parameters read as empty) until
the round that frees it. A unit called outside the model's forward is
gathered and released at once, as before: every rank must call it alike.
Prefetching follows the order recorded on the first step (each rank its own).
A unit is prefetched only if it has at most
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
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from zeroshard.core.reducer import GradReducer
from zeroshard.plan.prefetch import following, may_prefetch, next_to_gather
from zeroshard.plan.reuse import kept_units
from zeroshard.stage3.agreement import InputsDone, UnitAgreement, Use
from zeroshard.stage3.gathers import Gathers
from zeroshard.stage3.unit import Unit, UnitState


class Pass(Enum):
    """Which pass the hooks run in: a forward pre-hook inside backward is a recomputation."""

    FORWARD = "forward"
    BACKWARD = "backward"


class GatherSchedule:
    def __init__(self, units: list[Unit], gathers: Gathers, max_live_numel: int, max_prefetch_numel: int,
                 max_reuse_distance: int = 0, device: torch.device | None = None):
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
        self.agreement = UnitAgreement(self.comm, len(units), device or torch.device("cpu"))
        self.use = Use(len(units))
        self.agreeing = False  # inside the model's forward or a backward: a unit's state changes in rounds
        self._model_calls = 0
        self._reducing = False  # this backward's hooks reduce (sync on)
        self._reduced: set[int] = set()  # units whose reduction was launched in this backward
        self._posted_ready: set[int] = set()
        self.reducer: GradReducer | None = None
        self._target: dict[int, int] = {}  # unit -> its index among the reducer's targets
        self.on_backward: Callable[[], None] = lambda: None  # a backward reached a unit: the engine's pass starts

    def attach(self, reducer: GradReducer, units_reduced: list[int]) -> None:
        """The reducer whose targets are `units_reduced` (unit indices, in its order)."""
        self.reducer, self._target = reducer, {u: k for k, u in enumerate(units_reduced)}

    def install(self, model: nn.Module) -> None:
        model.register_forward_pre_hook(_eager(self._before_model_forward), prepend=True)
        for i, unit in enumerate(self.units):
            unit.module.register_forward_pre_hook(_eager(partial(self._pre_forward, i)), with_kwargs=True)
            unit.module.register_forward_hook(_eager(partial(self._post_forward, i)))
        # After every unit's own hook: the ranks settle the forward's units.
        model.register_forward_hook(_eager(self._after_model_forward))

    # -- hooks ---------------------------------------------------------------

    def _before_model_forward(self, module, args) -> None:
        if self.phase is Pass.FORWARD:
            self._model_calls += 1
            self.agreeing = True

    def _after_model_forward(self, module, args, output) -> None:
        if self.phase is Pass.FORWARD:
            self._model_calls -= 1
            if not self._model_calls:
                self.settle()
                self.agreeing = False

    def _pre_forward(self, i: int, module, args, kwargs):
        if self.phase is Pass.BACKWARD:  # recomputation (activation checkpointing)
            self.use.backward.add(i)
            self.need(i, exact=False)
            self._note_backward(i)
            return None
        self.kept.discard(i)  # in use again (a module called twice, the next micro-batch): its forward's own
        if self._next_forward is None:
            self._forward_seen.append(i)
        self.use.calls[i] += 1
        self.need(i, exact=False, after=self._next_forward)
        if self.units[i].frozen and torch.is_grad_enabled():
            return self._hook_inputs(i, args, kwargs)
        return None

    def _hook_inputs(self, i: int, args, kwargs):
        """A unit with frozen parameters: learn when its backward has produced its inputs' gradients."""
        flat, spec = tree_flatten((args, kwargs))
        at = [k for k, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not at:
            self.use.unhooked.add(i)
            return None
        self.use.inputs_pending[i] += 1
        for k, t in zip(at, InputsDone.apply(partial(self._inputs_done, i), *(flat[k] for k in at))):
            flat[k] = t
        return tree_unflatten(flat, spec)

    def _inputs_done(self, i: int) -> None:
        self.use.inputs_pending[i] = max(0, self.use.inputs_pending[i] - 1)

    def _post_forward(self, i: int, module, args, output) -> None:
        if self.phase is Pass.BACKWARD:
            return
        self.use.calls[i] = max(0, self.use.calls[i] - 1)
        if self._next_backward is None and i not in self._forward_done:
            self._forward_done.append(i)
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(partial(self._pre_backward, i))
            if i in self._reused:  # its backward comes soon: keep it rather than gather it again
                self.kept.add(i)
                return
        if not self.agreeing:  # a unit called outside the model's forward: as every rank does, at once
            self.release(i)
        elif not self.use.calls[i]:
            self.units[i].hide(True)

    def _pre_backward(self, i: int, grad: torch.Tensor) -> None:
        self.on_backward()
        if i not in self._reduced:
            self.use.backward.add(i)
            self.need(i, exact=False)
            self._note_backward(i)

    def _note_backward(self, i: int) -> None:
        if self._next_backward is None and i not in self._backward_seen:
            self._backward_seen.append(i)
        if not self.agreeing:
            self._prefetch_after(i, self._next_backward)

    # -- gathering -----------------------------------------------------------

    def need(self, i: int, exact: bool = True, after: dict[int, int] | None = None) -> None:
        """Make unit `i`'s parameters whole now: wait for its gather, starting it if needed.

        `exact` (outside training: state dicts, gathered_parameters): the shards' own values, never
        ZeRO++'s quantized or node-local gathers. A unit whole already is used as it is, except one kept
        from a forward, which an exact need gathers anew. Inside a training pass (`agreeing`) the gather
        is agreed in a round (module docstring of agreement.py); `after`: the order to prefetch from.
        """
        unit = self.units[i]
        if self.agreeing and not exact:
            after = self._next_backward if self.phase is Pass.BACKWARD else after
            fresh = None  # a new prefetch: chosen once the last one is used, wanted until it is
            if self.use.prefetch in (None, i):
                self.use.prefetch = fresh = self._prefetch_target(i, after, 0 if unit.held else unit.gathered_numel)
            # a round where this rank's state must change: the unit, a prefetch, gradients newly ready
            if not unit.held or fresh is not None or self._ready_here() != self._posted_ready:
                self._round(done=False, now=i)
            unit.wait_gather()
            unit.hide(False)
            return
        if exact and (i in self.kept or unit.hidden):
            self.release(i)
        if not unit.whole:
            if unit.state is not UnitState.GATHERING:
                unit.start_gather(self.gathers, exact)
            unit.wait_gather()
        if not exact and after is not None:
            self._prefetch_after(i, after)

    def _prefetch_target(self, i: int, after: dict[int, int] | None, beside: int = 0) -> int | None:
        """The unit to gather meanwhile: the next one the first step ran after `i` that is not held (`beside`:
        elements about to be gathered with it)."""
        j = None if after is None else next_to_gather(i, after, lambda u: self.units[u].held)
        if j is None or self.units[j].held or j in self._reduced:
            return None
        fits = may_prefetch(self.units[j].gathered_numel, self.live_numel() + beside, self.max_prefetch_numel,
                            self.max_live_numel)
        return j if fits else None

    def _prefetch_after(self, i: int, after: dict[int, int] | None) -> None:
        """Outside the agreement (a unit called outside the model's forward): prefetch at once."""
        j = self._prefetch_target(i, after)
        if j is not None:
            self.units[j].start_gather(self.gathers, exact=False)
            if j in after:  # shards on disk: read the unit after it meanwhile
                self.units[after[j]].read_shards()

    # -- the agreement's rounds ------------------------------------------------

    def _round(self, done: bool, now: int | None = None) -> bool:
        """One round (agreement.py); returns whether every rank has finished the pass."""
        ready = self._ready_here(every=done)
        want = set(self.kept) if done else self.use.wanted(self.kept, self._backward_over) | {now}
        agreed = self.agreement.round(done, want, ready)
        self._posted_ready = ready
        for i in agreed.reduce:
            self.reducer.launch(self._target[i])
        for i, unit in enumerate(self.units):
            if unit.held and i not in agreed.wanted:
                unit.release()
        for i in sorted(agreed.wanted):
            if not self.units[i].held:
                self.units[i].start_gather(self.gathers, exact=False)
        return agreed.done

    def settle(self) -> None:
        """The end of a pass: rounds, wanting only what is kept for backward, until every rank has finished."""
        while not self._round(done=True):
            pass
        self.use.prefetch = None

    def _ready_here(self, every: bool = False) -> set[int]:
        """Units whose reduction this rank can launch: all gradients here (`every`: backward is over)."""
        if not (self._reducing and self.phase is Pass.BACKWARD):
            return set()
        pending = self.reducer.complete if not every else lambda k: not self.reducer.launched(k)
        return {i for i, k in self._target.items() if pending(k)}

    def _backward_over(self, i: int) -> bool:
        """Whether unit `i`'s backward no longer reads its parameters on this rank."""
        k = self._target.get(i)
        grads = k is None or (self._reducing and (self.reducer.complete(k) or self.reducer.launched(k)))
        return grads and (not self.units[i].frozen or self.use.frozen_over(i))

    def in_use(self, i: int) -> bool:
        """Whether unit `i` is whole for a forward, a backward or an outer block (not only kept for a backward,
        which an exact need replaces with the shards' own values and lets go after it)."""
        return self.units[i].whole and i not in self.kept

    def live_numel(self) -> int:
        """Elements of the units gathered or being gathered now."""
        return sum(u.gathered_numel for u in self.units if u.held)

    def release(self, i: int) -> None:
        self.units[i].release()  # a prefetch never used lands first
        self.kept.discard(i)

    def release_all(self, keep: set[int] = frozenset()) -> None:
        """Release every unit but those in `keep`; a pass cut short (an error) ends here."""
        for i, unit in enumerate(self.units):
            if i not in keep and unit.held:
                unit.release()
        self.kept &= set(keep)
        self.agreeing, self._model_calls = False, 0
        self.use.reset()

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
        self.agreeing, self._model_calls = False, 0
        self.use.reset()

    # -- backward bookkeeping --------------------------------------------------

    def begin_backward(self, reducing: bool = True) -> None:
        """`reducing`: the hooks reduce in this backward (sync on); else gradients stay on `.grad`."""
        self.phase, self.agreeing, self._reducing = Pass.BACKWARD, True, reducing
        self.use.backward = set(self.kept)  # wanted until their backward is over
        self.kept.clear()
        self._reduced.clear()
        self._posted_ready = set()

    def on_reduced(self, i: int) -> None:
        """Unit `i`'s gradients are on their way: a second gradient for it in this backward is an error."""
        self._reduced.add(i)

    def finish_backward(self) -> None:
        """After autograd's backward: rounds until every rank has finished, which launch every reduction."""
        self.settle()

    def end_backward(self) -> None:
        """After every backward (or a failed one): release what is left; after the first, fix the prefetch order."""
        self.phase = Pass.FORWARD
        self.release_all()
        self._reducing = False
        self._reduced.clear()
        if self._next_backward is None and self._backward_seen:
            self._next_forward = following(self._forward_seen)
            self._next_backward = following(self._backward_seen)
            self._reused = kept_units(self._forward_done, self._backward_seen,
                                      [u.gathered_numel for u in self.units], self.max_reuse_distance,
                                      self.max_live_numel)


def _eager(hook):
    """`hook`, run outside torch.compile's graphs: see the module's note on compiled forwards."""
    return torch.compiler.disable(hook, reason="zeroshard stage 3: gathers and releases run eagerly")
