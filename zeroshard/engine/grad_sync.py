"""GradSyncMethods: gradient sync driven by the caller instead of autograd hooks.

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
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from zeroshard.comm import wait_all
from zeroshard.engine.state import EngineStateError, TrainingState


class GradSyncMethods:
    """Mixed into `Engine`: sync off and on, reduce now, scale, and backward passes the caller runs."""

    _sync = True  # gradient sync by hooks during engine.backward
    _unreduced = False  # .grad holds gradients no reduction has taken yet
    _reduced_in_window = False  # a reduction ran in this window (stages 0-1 allow one)
    _tied_left = False  # the last pass was ties=False and no backward ran since: only tied targets remain
    _grad_divisor = 1.0  # engine.scale_gradients: the window's gradients are divided by it at the step

    @property
    def step_due(self) -> bool:
        """Whether a backward ran since the last engine.step(): the step comes next."""
        return self.state is TrainingState.STEP_DUE

    @property
    def gradient_sync(self) -> bool:
        """Whether backward reduces through hooks (True) or leaves gradients on `.grad` for reduce_gradients."""
        return self._sync

    def set_gradient_sync(self, enabled: bool) -> None:
        """Turn hook-driven gradient sync on or off (see the module's docstring); only between steps."""
        if self.state not in (TrainingState.IDLE,) or self._unreduced:
            raise EngineStateError("set_gradient_sync() between optimizer steps only: call it before the first "
                                   "backward of a window, after engine.step()")
        self._sync = bool(enabled)

    @contextmanager
    def pipeline_backward(self) -> Iterator[None]:
        """Run a backward pass of your own inside (a pipeline schedule's): gradients stay on `.grad`.

        Turns gradient sync off for the rest of training. Afterwards the engine
        expects `engine.step()`; more forwards and backwards may come first.
        """
        self._check_usable()
        if self.state not in (TrainingState.IDLE, TrainingState.STEP_DUE):
            raise EngineStateError(f"pipeline_backward() in state {self.state.value}: run it between forwards, "
                                   "not inside another backward or step")
        self._sync = False
        self._begin_explicit_backward()
        try:
            yield
        except BaseException as exc:
            self.fail(f"a backward failed on this rank ({type(exc).__name__}: {exc})")
            raise
        self._end_explicit_backward()

    def _begin_explicit_backward(self) -> None:
        if self._reduced_in_window and not self.switches.shard_grads:
            raise EngineStateError(f"a backward after reduce_gradients() in the same step at ZeRO stage "
                                   f"{self.config.stage}: stages 0-1 reduce a window once, so its gradients would be "
                                   "reduced twice. Reduce after the window's last backward, or use stage 2 or 3")
        self._tied_left = False
        if self.schedule is not None:
            self.schedule.begin_backward()
        self.state = TrainingState.BACKWARD
        self.comm.trace.phase = "backward"

    def _end_explicit_backward(self) -> None:
        if self.schedule is not None:
            self.schedule.end_backward()
        self._unreduced = True
        self.state = TrainingState.STEP_DUE
        self.comm.trace.phase = "step"

    def reduce_gradients(self, ties: bool = True) -> None:
        """Reduce the gradients `.grad` holds now (sync off); see the module's docstring.

        `ties=False` (stages 2-3, a pipeline's per-micro-batch pass) leaves the copies of parameters tied
        across stages on `.grad`: their sum over the stages is a collective between stages, which must not
        run in the middle of a schedule. A pass with `ties=True` (the end of step's) sums and reduces them,
        and reduces every target not yet reduced in this window or still holding a gradient.
        """
        self._check_usable()
        if self.state is not TrainingState.STEP_DUE:
            raise EngineStateError("reduce_gradients() after a backward and before engine.step() only")
        if self._sync:
            raise EngineStateError("reduce_gradients() with gradient sync on: engine.backward has reduced already. "
                                   "Turn sync off first (engine.set_gradient_sync(False)) to reduce when you choose")
        if self._reduced_in_window and not self.switches.shard_grads:
            raise EngineStateError(f"reduce_gradients() a second time in one step at ZeRO stage {self.config.stage}: "
                                   "stages 0-1 reduce the window's gradients once, at its end. Reduce per "
                                   "micro-batch at stage 2 or 3, or once per step")
        if not ties and not self.switches.shard_grads:
            raise EngineStateError("reduce_gradients(ties=False) reduces part of a window: stages 2-3 only")
        self._reduce_now(ties)

    def _reduce_now(self, ties: bool) -> None:
        try:
            self._reduce_targets(ties)
        except BaseException as exc:
            self.fail(f"a gradient reduction failed on this rank ({type(exc).__name__}: {exc})")
            raise
        self._reduced_in_window = True
        self._tied_left = not ties and bool(self.cross and self.cross.ties)
        self._unreduced = self._tied_left

    def _reduce_targets(self, ties: bool) -> None:
        tied = {id(t.param) for t in self.cross.ties} if self.cross is not None else set()
        if ties and tied:
            for tie in self.cross.ties:  # a gradient partial over tp is summed there first, in place
                self.cross.settle(tie.param)
            self.cross.reduce_ties()
        scale = 1.0 / (self.comm.world_size * self.config.gradient_accumulation_steps)
        pending = []
        for target in self.reducer.targets:
            # Right after a per-micro-batch pass only the tied targets are left: a fixed set, the same on
            # every dp rank (which targets hold a gradient can differ between ranks).
            if self._tied_left and not any(id(p) in tied for p in target.params):
                continue
            for index, param in enumerate(target.params):
                if self.cross is not None and (ties or id(param) not in tied):
                    self.cross.settle(param)
                if ties or id(param) not in tied:
                    target.take_grad(index, self.pool)
            pending.append(target.reduce_grad(self.comm, self.pool, scale))
        wait_all(pending)

    def scale_gradients(self, factor: float) -> None:
        """Divide this window's gradients by `factor` at the step (a pipeline's micro-batches with a mean loss)."""
        if not factor > 0:
            raise ValueError(f"scale_gradients({factor!r}): the factor must be positive")
        self._grad_divisor = float(factor)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times fp16's loss scale (in fp32), for a backward run outside engine.backward; else `loss`."""
        return loss.float() * self.scaler.scale if self.scaler is not None else loss

    def _end_window(self) -> None:
        self._unreduced, self._reduced_in_window, self._grad_divisor, self._tied_left = False, False, 1.0, False
