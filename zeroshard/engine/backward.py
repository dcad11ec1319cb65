"""Backward passes as PyTorch runs them: `loss.backward()`, several per micro-step, `no_sync`, coalescing.

The engine need not see the loss. Its forward hooks the model's outputs
(`watch_outputs`): the first gradient to reach one of them starts a pass
(`start`), and autograd's final callback for that backward ends it, so
`loss.backward()`, `out.backward(grad)` and `torch.autograd.backward([l1,
l2])` run the same pass as `engine.backward(loss)`. A parameter's gradient
hook and stage 3's unit hooks start one too, for a gradient that reaches the
model by another way. A `torch.autograd.grad` through the model (a gradient
penalty, a pipeline's input gradients) writes no `.grad` and starts none.

A pass reduces in its hooks (engine/grad_sync.py) or holds its gradients on
this rank: inside `no_sync()`, inside `coalesce_grad_reduction()` (which
reduces what they hold once, at its exit), and with
`zero_optimization.reduce_once_per_window` in every micro-step but the
window's last. Each reducing pass reduces its own gradients, so several in one
micro-step cost the bytes of as many reductions; the window's sum is the same.

With fp16 the engine scales the loss (in fp32) when it sees it
(`engine.backward`, `engine.scale_loss`); otherwise the loss scale applies to
each gradient as it enters the model's outputs, which for a loss computed
from the outputs is the same product, rounded once more in fp16.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_unflatten

from zeroshard.engine.state import EngineStateError, TrainingState


class BackwardPasses:
    """The engine's backward passes: when one starts and ends, and whether it holds its gradients."""

    def __init__(self, engine):
        """`engine`: the `Engine` whose passes these are (its state, grad sync, scaler and failure)."""
        self.engine = engine
        self.hold: str | None = None  # "no_sync" or "coalesce_grad_reduction": the context the passes hold in
        self.loss_scaled = False  # the next pass's loss carries fp16's scale already (engine.scale_loss)
        self.running = False  # a pass this object started has not ended yet
        self.started = 0  # passes started so far, for engine.backward to know one ran

    # -- the model's outputs -------------------------------------------------

    def watch_outputs(self, output):
        """`output` with a hook on each tensor that needs a gradient; with fp16, tensors that scale it."""
        if not torch.is_grad_enabled():
            return output
        leaves, spec = tree_flatten(output)
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
            return output
        if self.engine.scaler is None:
            for t in leaves:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._on_output_grad)
            return output
        return tree_unflatten([self._scaled(t) if isinstance(t, torch.Tensor) and t.requires_grad else t
                               for t in leaves], spec)

    def _scaled(self, tensor: torch.Tensor) -> torch.Tensor:
        fed: list[BackwardPasses] = []  # the engines whose forward takes it as an input (`mark_inputs`)
        out = _ScaledEntry.apply(tensor, self, fed)
        out._zeroshard_fed = fed
        return out

    def mark_inputs(self, inputs) -> None:
        """fp16: an engine's scaled output fed to this engine's forward gets its gradient through this engine,
        scaled by this engine's scale already (`output_factor`)."""
        for t in tree_flatten(inputs)[0]:
            fed = getattr(t, "_zeroshard_fed", None)
            if fed is not None and self not in fed:
                fed.append(self)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        self.start()

    def output_factor(self, fed: list[BackwardPasses]) -> float:
        """What a gradient entering the model's outputs is multiplied by: fp16's scale over the scale it carries
        (the loss's, when the engine scaled it; the consuming engine's, for an output fed to an engine's
        forward), unless the caller's own pass (`pipeline_backward`) scales."""
        engine = self.engine
        if engine.scaler is None or not self.running:
            return 1.0
        if fed:
            return engine.scaler.scale / fed[0].engine.loss_scale
        return 1.0 if self.loss_scaled else engine.scaler.scale

    # -- a pass ----------------------------------------------------------------

    def start(self, at_output: bool = False) -> None:
        """The first gradient of a backward reached the model (`at_output`: through an output fp16 scales):
        begin its pass, unless one is running."""
        engine = self.engine
        if engine.state is TrainingState.BACKWARD:  # this backward's pass, or the caller's pipeline_backward
            return
        if engine.state not in (TrainingState.IDLE, TrainingState.STEP_DUE):
            raise EngineStateError(f"a backward reached the model in state {engine.state.value}: run backward "
                                   "after the forward has returned, not inside it or inside engine.step()")
        if not self._accumulates():  # torch.autograd.grad through the model: no parameter's .grad is written
            return
        engine._check_usable()
        if engine.scaler is not None and not (at_output or self.loss_scaled):
            why = ("with fp16 a backward the engine did not scale reached the parameters other than through the "
                   "model's outputs (a loss term on the parameters, or outputs torch's pytree cannot open), so "
                   "its gradients would miss the loss scale: call engine.backward(loss), or "
                   "engine.scale_loss(loss).backward()")
            engine._fail(why)
            raise EngineStateError(why)
        engine.post_step.wait()  # the gathers of parameters no forward used (overlap_param_gather)
        sync = engine.gradient_sync
        if sync and engine.cross is not None and engine.cross.ties:
            raise EngineStateError("parameters tied across pipeline stages are summed over the stages before "
                                   "the reduction, which hooks cannot do: turn gradient sync off "
                                   "(engine.set_gradient_sync(False), or zeroshard.parallel.PipelineStage)")
        self._begin()
        torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _begin(self) -> None:
        engine = self.engine
        boundary = engine.is_gradient_accumulation_boundary()
        per_window = engine.config.zero_optimization.reduce_once_per_window
        engine._grad_sync.begin_pass(boundary, self.hold is not None or (per_window and not boundary))
        self._enter(TrainingState.BACKWARD)
        self.running, self.started = True, self.started + 1

    def _enter(self, state: TrainingState) -> None:
        """BACKWARD or STEP_DUE; the collectives from here on are the backward's or engine.step()'s."""
        phase = "backward" if state is TrainingState.BACKWARD else "step"
        self.engine.state, self.engine.comm.trace.phase = state, phase

    def _failed(self, exc: BaseException) -> None:
        self.engine._fail(f"a backward failed on this rank ({type(exc).__name__}: {exc})")

    def _accumulates(self) -> bool:
        """Whether this backward writes some trained parameter's `.grad` (not `torch.autograd.grad`'s)."""
        return any(torch._C._will_engine_execute_node(get_gradient_edge(p).node)
                   for p in self.engine.module.parameters() if p.requires_grad)

    def _end(self) -> None:
        """Autograd's final callback of the pass's backward: the pass's last reductions, then STEP_DUE."""
        engine = self.engine
        try:
            engine._grad_sync.end_pass()
        except BaseException as exc:
            self._failed(exc)
            raise
        finally:
            self.running, self.loss_scaled = False, False
        self._enter(TrainingState.STEP_DUE)

    def check_ended(self) -> None:
        """Outside any backward, a pass still running means its backward raised: the engine fails."""
        if self.running and torch._C._current_graph_task_id() == -1:
            self.running = False
            self.engine._fail("a backward raised on this rank before its end (its error came out of that "
                              "backward call), so its reductions did not finish")

    def run(self, backward: Callable[[], None]) -> None:
        """`engine.backward`: run `backward()`; a backward that reached no parameter still runs an (empty)
        pass, so that every rank's reductions pair up."""
        started = self.started
        try:
            backward()
        except BaseException as exc:  # other ranks may be in this backward's collectives: the engine stops
            self.running = False
            self._failed(exc)
            raise
        finally:
            self.loss_scaled = False
        if self.started == started:
            self._begin()
            self._end()

    @contextmanager
    def callers(self) -> Iterator[None]:
        """`engine.pipeline_backward()`: the caller's backward passes inside, gradients left on `.grad`."""
        engine = self.engine
        engine._check_usable()
        if engine.state not in (TrainingState.IDLE, TrainingState.STEP_DUE):
            raise EngineStateError(f"pipeline_backward() in state {engine.state.value}: run it between forwards, "
                                   "not inside another backward or step")
        engine._grad_sync.begin_backward()
        self._enter(TrainingState.BACKWARD)
        try:
            yield
        except BaseException as exc:
            self._failed(exc)
            raise
        finally:
            self.loss_scaled = False
        engine._grad_sync.end_backward()
        self._enter(TrainingState.STEP_DUE)

    def drop(self) -> None:
        """`optimizer.zero_grad()` with a step due: drop the gradients of the backwards since the last step (a
        GAN's generator loss that reached the discriminator), as PyTorch's zero_grad does."""
        engine = self.engine
        if engine.micro_steps % engine.config.gradient_accumulation_steps:
            raise EngineStateError(
                f"optimizer.zero_grad() with a step due in micro-step {engine.micro_steps} of a window of "
                f"{engine.config.gradient_accumulation_steps}: the window's earlier micro-steps are summed with "
                "this one's and cannot be told apart. Call it after optimizer.step() (engine.step())")
        engine._grad_sync.drop()
        engine.state = TrainingState.IDLE

    # -- holding the gradients -------------------------------------------------

    @contextmanager
    def holding(self, why: str) -> Iterator[None]:
        """The passes inside keep their gradients on this rank (`why`: the context's name, for messages)."""
        if self.hold is not None:
            raise EngineStateError(f"{why}() entered inside {self.hold}(); re-entry is not supported: "
                                   "leave the first one before entering another")
        if self.engine.state is TrainingState.BACKWARD:
            raise EngineStateError(f"{why}() inside a backward: enter it before the backward passes it covers")
        self.hold = why
        try:
            yield
        finally:
            self.hold = None

    @contextmanager
    def coalesced(self) -> Iterator[None]:
        """The passes inside hold; at the exit their sum is reduced once, if this micro-step reduces."""
        with self.holding("coalesce_grad_reduction"):
            yield
        engine, sync = self.engine, self.engine._grad_sync
        if engine.state is TrainingState.STEP_DUE and sync.unreduced and \
                sync.reduces_in(engine.is_gradient_accumulation_boundary()):
            engine._reduce_now(ties=True)


class _ScaledEntry(torch.autograd.Function):
    """fp16: an output of the model, the same values; its gradient starts the pass and takes the loss scale."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, passes: BackwardPasses, fed: list[BackwardPasses]) -> torch.Tensor:
        ctx.passes, ctx.fed = passes, fed
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.passes.start(at_output=True)
        factor = ctx.passes.output_factor(ctx.fed)
        return (grad * factor if factor != 1.0 else grad), None, None
