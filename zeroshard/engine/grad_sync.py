"""GradSync: gradient sync driven by the caller instead of autograd hooks.

With sync on (the default) each parameter's post-accumulate-grad hook hands
its gradient to the reducer during `engine.backward`. A pipeline schedule
cannot work that way: it runs backward itself, micro-batch by micro-batch,
and the zero-bubble schedules assign weight gradients by hand, so hooks
fire for only some parameters. With sync off:

- gradients stay on `.grad` and accumulate there across backward passes
  (`engine.backward(loss)`, or any backward run inside
  `engine.pipeline_backward()`); the hooks do nothing;
- `engine.reduce_gradients()` reduces whatever `.grad` holds now, for every
  parameter, hook or no hook: the cross-parallel sums (partial `tp`
  gradients, ties across stages), then the `dp` reduction (all-reduce at
  stage 0, reduce-scatter at stages 1-3) into each bucket's gradient, and
  frees `.grad`. Stages 2-3 may call it once per micro-batch (least memory);
  stages 0-1 once per step;
- `engine.step()` first reduces what is still unreduced: the end-of-step
  pass that does not depend on any hook having fired;
- `engine.scale_gradients(f)` divides the window's gradients by `f` in the
  step's one multiply (a pipeline schedule's micro-batch count).

Whether sync is on is the caller's setting, kept across windows; what the
window's gradients hold is one state, `Window`, reset at every boundary.

With sync on, a backward pass (`begin_pass`, `end_pass`; engine/backward.py
starts and ends them) either reduces in its hooks or holds: at stages 0-1
its hooks add the gradients into the buckets as in any micro-step before the
window's last; at stages 2-3 the gradients stay on `.grad`, whole, until a
reduction takes them (the next reducing pass's hooks, `reduce`, or the
step's pass). A pass at stages 0-1 after the window's reduction sets the
reduced gradients aside (`Bucket.set_aside`): its own are reduced again and
added to them.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from zeroshard.comm import CollectiveError, Comm, wait_all
from zeroshard.config import Config
from zeroshard.core.bucket import Bucket
from zeroshard.core.switches import StageSwitches
from zeroshard.core.reducer import GradReducer
from zeroshard.core.staging import StagingPool
from zeroshard.engine.offload import Offload
from zeroshard.engine.state import EngineStateError, TrainingState
from zeroshard.stage3.schedule import GatherSchedule

if TYPE_CHECKING:  # imported by the engine only with a mesh: `import zeroshard` stays free of DTensor
    from zeroshard.parallel.cross import CrossParallel


class Window(Enum):
    """What this accumulation window's gradients hold: in the buckets or on `.grad`, reduced or not."""

    CLEAN = "clean"  # no backward and no reduction yet in this window
    UNREDUCED = "unreduced"  # the buckets or .grad hold gradients no reduction has taken yet
    REDUCED = "reduced"  # a reduction ran in this window and took everything
    TIED_LEFT = "tied left"  # a ties=False pass ran, no backward since: only the tied copies remain on .grad


class Pass(Enum):
    """What the hooks of the backward pass running do with each gradient."""

    REDUCE = "reduce"  # take it into its bucket; launch reductions as buckets fill
    ACCUMULATE = "accumulate"  # stages 0-1, a micro-step that does not reduce: take it into its bucket only
    HOLD = "hold"  # stages 2-3: leave it on .grad, whole, for a later reduction
    OFF = "off"  # sync off: leave it on .grad for the caller's reduce_gradients()


class GradSync:
    """The engine's gradient sync: hooks or the caller's passes, the window's state and its divisor."""

    def __init__(self, reducer: GradReducer, cross: CrossParallel | None, comm: Comm, pool: StagingPool,
                 switches: StageSwitches, config: Config, buckets: list[Bucket], schedule: GatherSchedule | None,
                 offload: Offload):
        """`cross`: on a mesh, tp's partial sums and the ties across pp stages."""
        self.reducer, self.cross, self.comm, self.pool, self.switches = reducer, cross, comm, pool, switches
        self.config, self.buckets, self.schedule, self.offload = config, buckets, schedule, offload
        self.sync = True  # the caller's setting: hooks reduce during engine.backward
        self.window = Window.CLEAN
        self.divisor = 1.0  # engine.scale_gradients: the window's gradients are divided by it at the step
        self.divide_factor = config.gradient_divide_factor  # the reduction's divisor; None: the mean's
        self.passing: Pass | None = None  # what the hooks of the backward pass running do

    @property
    def unreduced(self) -> bool:
        """Whether the step must first reduce what `.grad` still holds (the end-of-step pass)."""
        return self.window in (Window.UNREDUCED, Window.TIED_LEFT)

    def _scale(self) -> float:
        """The reduction's factor: 1 / the divide factor, or with none the mean over the window's micro-steps
        and (`gradient_allreduce_op` "mean") the ranks."""
        if self.divide_factor is not None:
            return 1.0 / self.divide_factor
        ranks = self.comm.world_size if self.config.gradient_allreduce_op == "mean" else 1
        return 1.0 / (ranks * self.config.gradient_accumulation_steps)

    def set_divide_factor(self, factor: float | None, state: TrainingState) -> None:
        if state is not TrainingState.IDLE or self.window is not Window.CLEAN:
            raise EngineStateError("set_gradient_divide_factor() between optimizer steps only: call it before "
                                   "the first backward of a window, after engine.step()")
        if factor is not None and not (isinstance(factor, (int, float)) and 0 < factor < float("inf")):
            raise ValueError(f"set_gradient_divide_factor({factor!r}): a positive finite number, or None")
        self.divide_factor = None if factor is None else float(factor)

    # -- sync on: the hooks reduce during engine.backward -------------------------

    def on_grad(self, target: int, param: int) -> None:
        """A parameter's post-accumulate-grad hook, inside a pass: its gradient to the reducer (sync on)."""
        if self.passing not in (Pass.REDUCE, Pass.ACCUMULATE):  # gradients stay on .grad for a later reduction
            return
        if self.cross is not None:
            self.cross.match_placements(self.reducer.targets[target].params[param])
        self.reducer.on_grad(target, param)

    def begin_pass(self, boundary: bool, hold: bool) -> None:
        """A backward pass starts: with sync off the caller's; else its hooks reduce if this micro-step does
        (every one at stages 2-3, the window's last at stages 0-1) and the pass does not `hold`."""
        if not self.sync:
            self.begin_backward()
            self.passing = Pass.OFF
            return
        self._set_aside_reduced()
        if hold:
            self.passing = Pass.HOLD if self.switches.shard_grads else Pass.ACCUMULATE
        else:
            self.passing = Pass.REDUCE if self.reduces_in(boundary) else Pass.ACCUMULATE
        reducing = self.passing is Pass.REDUCE
        if reducing:
            self.offload.tiers.hold_grads()  # the step's first gradient shards on disk stay in memory for it
        if self.passing is not Pass.HOLD:
            self.reducer.begin(reducing, self._scale())
        if self.schedule is not None:
            self.schedule.begin_backward(reducing=reducing)

    def reduces_in(self, boundary: bool) -> bool:
        """Whether a micro-step's gradients are reduced in it: every one at stages 2-3, the window's last at 0-1."""
        return boundary or self.switches.shard_grads

    def end_pass(self) -> None:
        """After the pass: what the hooks did not reach reduced, or the pass's gradients summed."""
        passing, self.passing = self.passing, None
        if passing is Pass.OFF:
            self.end_backward()
            return
        if self.schedule is not None:
            self.schedule.finish_backward()  # the ranks' last rounds launch every unit's reduction
        if passing is not Pass.HOLD:
            self.reducer.finish()
        if self.schedule is not None:
            self.schedule.end_backward()  # waits for prefetches still in flight
        if passing is Pass.ACCUMULATE:
            for bucket in self.buckets:
                bucket.accumulate_micro_step()
        self.window = Window.REDUCED if passing is Pass.REDUCE else Window.UNREDUCED

    def _set_aside_reduced(self) -> None:
        """Stages 0-1 reduce a buffer in place: a pass after this window's reduction sets its result aside."""
        if self.window is Window.REDUCED and not self.switches.shard_grads:
            for bucket in self.buckets:
                bucket.set_aside()
            self.window = Window.CLEAN

    def drop(self) -> None:
        """Forget this window's gradients (the caller's zero_grad at a window's first micro-step, a failure)."""
        for bucket in self.buckets:
            bucket.zero_grad(self.pool)
        if self.switches.shard_grads:  # what passes held on .grad
            for target in self.reducer.targets:
                for param in target.params:
                    param.grad = None
        self.end_window()

    def abandon(self) -> None:
        """The engine failed: drop this window's partial gradients and whatever is in flight."""
        try:
            self.reducer.abandon()
        except CollectiveError:  # the stuck collective itself: nothing more to learn from it
            pass
        self.drop()
        if self.schedule is not None:
            self.schedule.forget()
        self.passing = None

    # -- sync off: the caller's backward passes and reductions --------------------

    def set_sync(self, enabled: bool, state: TrainingState) -> None:
        if state is not TrainingState.IDLE or self.unreduced:
            raise EngineStateError("set_gradient_sync() between optimizer steps only: call it before the first "
                                   "backward of a window, after engine.step()")
        self.sync = bool(enabled)

    def begin_backward(self) -> None:
        """A backward of the caller's is about to run: sync is off from now on."""
        self.sync = False
        if self._reduced_once():
            raise EngineStateError(f"a backward after reduce_gradients() in the same step at ZeRO stage "
                                   f"{self.config.stage}: stages 0-1 reduce a window once, so its gradients would be "
                                   "reduced twice. Reduce after the window's last backward, or use stage 2 or 3")
        if self.schedule is not None:
            self.schedule.begin_backward(reducing=False)

    def end_backward(self) -> None:
        if self.schedule is not None:
            self.schedule.finish_backward()
            self.schedule.end_backward()
        self.window = Window.UNREDUCED

    def check_reduce(self, ties: bool) -> None:
        """The caller's `reduce_gradients(ties)` is allowed now (the engine checked the training state)."""
        if self.sync:
            raise EngineStateError("reduce_gradients() with gradient sync on: engine.backward has reduced already. "
                                   "Turn sync off first (engine.set_gradient_sync(False)) to reduce when you choose")
        if self._reduced_once():
            raise EngineStateError(f"reduce_gradients() a second time in one step at ZeRO stage {self.config.stage}: "
                                   "stages 0-1 reduce the window's gradients once, at its end. Reduce per "
                                   "micro-batch at stage 2 or 3, or once per step")
        if not ties and not self.switches.shard_grads:
            raise EngineStateError("reduce_gradients(ties=False) reduces part of a window: stages 2-3 only")

    def _reduced_once(self) -> bool:
        """Stages 0-1 reduce a window once: has it been?"""
        return self.window in (Window.REDUCED, Window.TIED_LEFT) and not self.switches.shard_grads

    def reduce(self, ties: bool) -> None:
        """Reduce what `.grad` holds now into each target (see the module's docstring).

        `ties=False` (stages 2-3, a pipeline's per-micro-batch pass) leaves the copies of parameters tied
        across stages on `.grad`: their sum over the stages is a collective between stages, which must not
        run in the middle of a schedule. A pass with `ties=True` (the end of step's) sums and reduces them,
        and reduces every target not yet reduced in this window or still holding a gradient.
        """
        tied = {id(t.param) for t in self.cross.ties} if self.cross is not None else set()
        if ties and tied:
            for tie in self.cross.ties:  # a gradient partial over tp is summed there first, in place
                self.cross.match_placements(tie.param)
            self.cross.reduce_ties()
        scale = self._scale()
        pending = []
        for target in self.reducer.targets:
            # Right after a per-micro-batch pass only the tied targets are left: a fixed set, the same on
            # every dp rank (which targets hold a gradient can differ between ranks).
            if self.window is Window.TIED_LEFT and not any(id(p) in tied for p in target.params):
                continue
            for index, param in enumerate(target.params):
                if self.cross is not None and (ties or id(param) not in tied):
                    self.cross.match_placements(param)
                if ties or id(param) not in tied:
                    target.take_grad(index, self.pool)
            pending.append(target.reduce_grad(self.comm, self.pool, scale))
        wait_all(pending)
        self.window = Window.TIED_LEFT if not ties and tied else Window.REDUCED

    def scale(self, factor: float) -> None:
        if not factor > 0:
            raise ValueError(f"scale_gradients({factor!r}): the factor must be positive")
        self.divisor = float(factor)

    def end_window(self) -> None:
        self.window, self.divisor = Window.CLEAN, 1.0
