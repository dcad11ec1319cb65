"""Engine: wraps the model and optimizer; forward, backward and step for ZeRO stages 0-3.

Precision follows the config. In fp32 the parameters are their own master
copy. With `bf16` or `fp16` enabled, the parameters the optimizer trains are
cast to 16 bits (frozen parameters and floating-point buffers too, as
DeepSpeed does), floating-point inputs are cast to that dtype (outputs are
returned as the model produces them), and each rank's optimizer updates an
fp32 master (its shard at stage >= 1) created from the model's original
values. Gradients are reduced in `communication_data_type` and summed over
micro-steps in fp32. A step is: the step check (one all-gather of each
rank's gradient squares, non-finite flag and counters, `core/grad_norm.py`),
unscale and clip in one multiply, optimizer step on the fp32 master, cast to
16 bits, all-gather (stages 1-2). With swap files (offload to disk), the
ranks agree after the optimizer step that every rank's reads and writes
succeeded (`core/faults.py`) before that all-gather: a damaged swap file on
one rank raises `OffloadError` on every rank and leaves the engine FAILED.

A step whose gradients hold inf or nan on any rank is not applied on any
rank (weights, masters, optimizer state and LR scheduler untouched, the
window's gradients dropped, `global_steps` and `skipped_steps` advance,
`global_grad_norm` is inf). fp16 then lowers the loss scale as DeepSpeed's
dynamic scaler does; fp32 and bf16 follow the config's `non_finite` section:
skip and log (`NonFiniteError` after `max_consecutive_skips` in a row), or
raise `NonFiniteError` at once. Either error leaves the engine usable.

The engine implements the checkpoint package's `Trainer` protocol; the
state machine of one micro-step is in `state.py`, construction in `build.py`.
"""

from __future__ import annotations

import logging

import torch

from zeroshard.checkpoint.async_save import AsyncSave
from zeroshard.comm import CollectiveError
from zeroshard.comm.entry import enter
from zeroshard.config import Config
from zeroshard.core.grad_norm import NonFiniteError, NonFiniteSkips, StepCheck, check_step, clip_coefficient
from zeroshard.core.local import local
from zeroshard.core.activation_meter import ActivationMeter
from zeroshard.core.precision import LossScaler, cast_inputs
from zeroshard.core.reducer import GradientError
from zeroshard.engine.build import Parts, broadcast_buffers
from zeroshard.engine.checkpoint_methods import CheckpointMethods
from zeroshard.engine.compiled import CompileMethods
from zeroshard.engine.delayed_update import DelayedUpdateMethods
from zeroshard.engine.deepspeed_api import DeepSpeedMethods
from zeroshard.engine.export import ExportMethods
from zeroshard.engine.grad_sync import GradSyncMethods
from zeroshard.engine.placement import log_placement
from zeroshard.engine.reports import ReportMethods
from zeroshard.engine.state import EngineStateError, TrainingState
from zeroshard.errors import ZeroshardError
from zeroshard.offload import OffloadError
from zeroshard.parallel.activation_checkpointing import running_forward
from zeroshard.stage3.sharded_use import sharded_use

log = logging.getLogger(__name__)


class Engine(GradSyncMethods, CheckpointMethods, DeepSpeedMethods, ExportMethods, CompileMethods,
             DelayedUpdateMethods, ReportMethods):
    """The training loop's handle: `loss = engine(*batch)`, `engine.backward(loss)`, `engine.step()`."""

    def __init__(self, parts: Parts, config: Config,
                 lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None):
        """`parts`: what `zeroshard.initialize` built (`build.py`); `lr_scheduler`: stepped by `step()` after
        each applied optimizer step. The engine builds nothing: it holds the parts and the loop's state, and
        answers the hooks (`parts.calls`) from here on."""
        self.module, self.optimizer, self.config = parts.module, parts.optimizer, config
        self.num_params = parts.num_params  # as built; stage 3 empties them
        self.micro_steps = 0  # backward passes so far
        self.global_steps = 0  # optimizer steps so far
        self.global_grad_norm: float | None = None  # of the last step's gradients; inf if they were not finite
        self.skipped_steps = 0  # optimizer steps not applied: inf or nan in the gradients
        self._skips = NonFiniteSkips(config.non_finite)  # fp32 and bf16: skipped steps in a row
        self.scaler = LossScaler(config.fp16) if config.fp16.enabled else None
        self.lr_scheduler = lr_scheduler  # passed in code, or from the config's block
        self.state = TrainingState.IDLE
        self._failure: str | None = None  # why the engine is FAILED
        self._async_save: AsyncSave | None = None  # an asynchronous checkpoint in flight (checkpoint_methods.py)
        self.mesh, self.cross = parts.mesh, parts.cross  # on a mesh: ties, tp and pp reductions (parallel/cross.py)
        self.comm, self.precision, self.switches = parts.comm, parts.precision, parts.switches
        self._device, self._names, self.pool, self.reducer = parts.device, parts.names, parts.pool, parts.reducer
        self.buckets, self.units, self.schedule = parts.buckets, parts.units, parts.schedule
        self.offload = parts.offload  # where masters, optimizer state and stage 3's shards live
        self.post_step = parts.post_step  # stages 1-2: the all-gathers after each step (overlap_param_gather)
        self.delayed = parts.delayed  # the CPU step in the background
        self.activations = ActivationMeter(self._owned_tensors, self._device)  # what each training forward saves
        # zeroshard.deepspeed.checkpointing.checkpoint in this engine's forward: the config's block, over tp
        self.checkpointing = parts.checkpointing
        parts.calls.on_grad, parts.calls.on_gather_failure = self._on_grad, self.fail  # the hooks reach the engine
        if self.comm.rank == 0:
            log_placement(self.placement())  # what is sharded, kept whole and frozen; the warning if nothing is
            for key, why in self.checkpointing.no_effect(self._device):
                log.info("activation_checkpointing.%s has no effect here: %s", key, why)

    def _owned_tensors(self) -> list[torch.Tensor]:
        """The tensors whose storages hold the model itself: parameters, buffers and the flat buffers."""
        flats = [b.flat for b in self.buckets] + self.frozen_flats()
        return [*self.module.parameters(), *self.module.buffers(), *(f.data for f in flats)]

    def _on_grad(self, target: int, param: int) -> None:
        if not self._sync:  # gradients stay on .grad for reduce_gradients()
            return
        if self.state is not TrainingState.BACKWARD:
            raise EngineStateError(
                "a gradient was accumulated outside engine.backward(loss); call "
                "engine.backward(loss) instead of loss.backward() so zeroshard can reduce it"
            )
        if self.cross is not None:
            self.cross.settle(self.reducer.targets[target].params[param])
        self.reducer.on_grad(target, param)

    # -- training loop ------------------------------------------------------

    def __call__(self, *args, **kwargs):
        self._check_usable()
        self.comm.trace.begin(self.micro_steps, self.global_steps)  # where this rank is, if a collective stalls
        if self.precision.mixed:
            args, kwargs = cast_inputs(args, self.precision.param_dtype), cast_inputs(kwargs, self.precision.param_dtype)
        if self.post_step.overlap and self.is_compiled:  # each waiting hook would break the compiled graph
            self.post_step.stop_overlap()
        resume, self.state = self.state, TrainingState.FORWARD
        try:
            broadcast_buffers(self.comm, self.module)
            with running_forward(self.checkpointing), self.activations.measure((args, kwargs)):
                return self.module(*args, **kwargs)
        except CollectiveError as exc:  # a gather failed (stage 3's, or the post-step one): ranks are out of step
            self.fail(f"a collective failed in forward ({exc})")
            raise
        except OffloadError as exc:  # a unit's shards on disk could not be read (every rank raised it)
            self.fail(f"a parameter shard on disk could not be read in forward ({exc})")
            raise
        except BaseException as exc:  # the model's own error (every rank's, or the stall watch says): free the units
            if self.schedule is None:
                raise
            named = sharded_use(exc, self.module, self.schedule.units) if isinstance(exc, Exception) else None
            self.schedule.release_all()  # after the look: which units were whole when it failed counts
            if named is not None:
                raise named from exc
            raise
        finally:
            if self.state is TrainingState.FORWARD:
                self.state = resume

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step is the last of its accumulation window."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss` (this rank's mean over its micro-batch) and reduce as the stage says.

        Stages 0 and 1 communicate only in the last micro-step of the window;
        stage 2 reduce-scatters in every micro-step, so full gradients never
        outlive one backward. With fp16 the loss is multiplied by the loss
        scale first (in fp32).
        """
        self._check_usable()
        if self.state is TrainingState.STEP_DUE:
            raise EngineStateError("engine.backward() was called twice without engine.step() in between; "
                                   "call engine.step() after every backward, as DeepSpeed does")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            what = f"a tensor of shape {tuple(loss.shape)}, requires_grad={loss.requires_grad}" \
                if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise GradientError(f"engine.backward(loss) needs a scalar loss tensor that requires grad; got {what} "
                                "(reduce it with .mean() or .sum(), and compute it outside torch.no_grad())")
        self.check_no_sync()  # a window's last backward reduces: not inside engine.no_sync()
        self.post_step.wait()  # the gathers of parameters no forward used (overlap_param_gather)
        if not self._sync:
            with self.pipeline_backward():
                self.scale_loss(loss).backward()
            return
        if self.cross is not None and self.cross.ties:
            raise EngineStateError("parameters tied across pipeline stages are summed over the stages before "
                                   "the reduction, which hooks cannot do: turn gradient sync off "
                                   "(engine.set_gradient_sync(False), or zeroshard.parallel.PipelineStage)")
        reduce_now = self.is_gradient_accumulation_boundary() or self.switches.shard_grads
        if self.is_gradient_accumulation_boundary():
            self.offload.tiers.hold_grads()  # the step's first gradient shards on disk stay in memory for it
        self.reducer.begin(reduce_now, 1.0 / (self.comm.world_size * self.gradient_accumulation_steps))
        if self.schedule is not None:
            self.schedule.begin_backward()
        if self.scaler is not None:
            loss = loss.float() * self.scaler.scale
        self.state = TrainingState.BACKWARD
        self.comm.trace.phase = "backward"
        try:
            loss.backward()
            self.reducer.finish()
            if self.schedule is not None:
                self.schedule.end_backward()  # waits for prefetches still in flight
            if not reduce_now:
                for bucket in self.buckets:
                    bucket.accumulate_micro_step()
        except BaseException as exc:
            self.fail(f"a backward failed on this rank ({type(exc).__name__}: {exc})")
            raise
        self.state = TrainingState.STEP_DUE
        self.comm.trace.phase = "step"  # the collectives until the next forward are engine.step()'s

    def fail(self, why: str) -> None:
        """Drop this window's partial gradients; the engine refuses to go on (ranks may be out of step)."""
        self.state, self._failure = TrainingState.FAILED, why
        try:
            self.reducer.abandon()
        except CollectiveError:  # the stuck collective itself: nothing more to learn from it
            pass
        for bucket in self.buckets:
            bucket.zero_grad(self.pool)
        if self.schedule is not None:
            self.schedule.forget()

    def _check_usable(self) -> None:
        if self.state is TrainingState.FAILED:
            raise EngineStateError(f"this engine cannot continue: {self._failure}. Its collectives may be out "
                                   "of step with the other ranks; restart the job (from a checkpoint)")
        for bucket in self.buckets:
            if bucket.switches.shard_params:  # its parameters are empty between uses
                continue
            if local(bucket.params[0]).data_ptr() != bucket.flat.data.data_ptr():
                raise EngineStateError(
                    f"parameter '{self._names[id(bucket.params[0])]}' no longer lives in zeroshard's flat "
                    "buffer (model.to(), .half() or .cuda() after initialize replaces parameters); move and "
                    "cast the model before zeroshard.initialize")

    def step(self) -> None:
        """End a micro-step; at the accumulation boundary check, unscale, clip, update and all-gather.

        If any rank's gradients hold inf or nan, the step is not applied on any rank (see the module's
        docstring); `NonFiniteError` (config `non_finite`) leaves the engine usable.

        With `offload_optimizer.delayed_update` (after its warm-up) the boundary first lands the previous
        step's update (waits for its CPU step, casts, all-gathers), then checks and clips this step's
        gradients, starts their CPU step on a background thread and returns: the parameters hold every
        update but this step's until the next boundary (`engine/delayed_update.py`, `flush_update`).
        """
        self._check_usable()
        if self.state is not TrainingState.STEP_DUE:
            raise EngineStateError("engine.step() was called without engine.backward(loss) since the last step")
        boundary, self._step_applied = self.is_gradient_accumulation_boundary(), False
        self.micro_steps += 1
        self.state = TrainingState.STEP if boundary else TrainingState.IDLE
        if not boundary:
            return
        try:
            self._land_update()  # the delayed update in flight, before this step's gradients are read
            if self._unreduced:  # sync off: the end-of-step pass, whatever hooks did or did not see
                self._reduce_now(ties=True)
            # fp32 gradients for the optimizer: new tensors, freed after the step, when gradients are 16-bit.
            tiers = self.offload.tiers  # a swap-file error backward met on some rank is raised on every rank
            grads = (self._on_every_rank(tiers.gradients, f"the gradient shards of optimizer step {self.global_steps}")
                     if tiers.grad_swaps else tiers.gradients())
            check = check_step(self._grad_norms(grads), self.cross.world if self.cross else self.comm,
                               self.global_steps, self.micro_steps, self.loss_scale * self._grad_divisor,
                               self._device, self.comm, self.cross.dp_groups() if self.cross else None)
            self.global_grad_norm = check.norm
            if check.nonfinite_ranks:
                self._skip_step(check)
            else:
                self._optimizer_step(grads, check.norm)
        except NonFiniteError:  # every rank raises it, after a clean skip: the ranks are still in step
            self.state = TrainingState.IDLE
            raise
        except BaseException as exc:  # a partial update, or a collective some ranks did not finish
            self.fail(f"the optimizer step failed on this rank ({type(exc).__name__}: {exc})")
            raise
        self.state = TrainingState.IDLE
        self._poll_checkpoint()  # an asynchronous save's outcome, known to every rank at this boundary

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

    def _optimizer_step(self, grads: list[torch.Tensor], norm: float) -> None:
        coef = 1.0 / (self.loss_scale * self._grad_divisor)  # unscale, scale and clip in one multiply
        if self.config.gradient_clipping > 0:
            coef *= clip_coefficient(norm, self.config.gradient_clipping)
        if coef != 1.0:
            torch._foreach_mul_(grads, coef)
        self._update(grads, coef)  # now, or started in the background (a delayed update)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self._skips.applied()
        self._step_applied = True
        self._end_step(overflow=False)

    def _end_step(self, overflow: bool) -> None:
        self._end_window()
        self.activations.end_window()
        for bucket in self.buckets:
            bucket.zero_grad(self.pool)
        if self.schedule is not None:  # kept units and hpZ's secondary shards live for one step, applied or skipped
            self.schedule.shards_changed()
        step = self.global_steps
        self.global_steps += 1
        if self.scaler is not None:
            before = self.scaler.scale
            self.scaler.update(overflow, step)
            if self.scaler.scale != before:  # error feedback holds loss-scaled residuals: now in the new scale's units
                for bucket in self.buckets:
                    if bucket.feedback is not None:
                        bucket.feedback.rescale(self.scaler.scale / before)

    def _skip_step(self, check: StepCheck) -> None:
        """Inf or nan in some rank's gradients: drop the window's gradients, change nothing else. Then fp16:
        the loss scaler's rules (`LossScaleError`); fp32 and bf16: config `non_finite`, agreed on every rank."""
        step, old_scale = self.global_steps, self.loss_scale
        self.skipped_steps += 1
        self._end_step(overflow=True)
        if self.scaler is not None:
            if self.comm.rank == 0:
                log.warning("fp16 gradients overflowed at step %d: step skipped, loss scale %g -> %g",
                            step, old_scale, self.loss_scale)
            return
        in_a_row = self._skips.skipped(step, check.nonfinite_ranks)  # or NonFiniteError, on every rank
        if self.comm.rank == 0:
            log.warning("gradients hold inf or nan at step %d (reduced gradients of rank(s) %s): step skipped "
                        "on every rank (%d in a row, at most %d)", step, ", ".join(map(str, check.nonfinite_ranks)),
                        in_a_row, self.config.non_finite.max_consecutive_skips)

    def _enter(self, call: str, error: type[ZeroshardError], checkpoint_call: bool = False) -> None:
        """Meet every rank in `call` before its first collective (comm/entry.py): a call made on some
        ranks only raises on them instead of hanging. A checkpoint call also needs every rank at the
        same step and at a window's end (`check_checkpoint_boundary`): a rank that is not makes every
        rank raise."""
        problem = None
        if checkpoint_call:
            try:
                self.check_checkpoint_boundary(call)
            except ZeroshardError as exc:  # CheckpointError, or EngineStateError for a failed engine
                problem = exc
        trace = self.comm.trace
        trace.global_step, trace.micro_step, trace.phase = self.global_steps, self.micro_steps, call
        enter(self.comm, call, error=error, problem=problem, same_step=checkpoint_call)

    def release_gathered(self) -> None:
        self.post_step.wait()  # stages 1-2: a gather in flight would write over what is loaded next
        if self.schedule is not None:
            self.schedule.release_all()

    def gather_params(self) -> None:
        if self.schedule is not None:  # kept units and hpZ's secondary shards are stale after a step or a load
            self.schedule.shards_changed()
        self.post_step.start(wait=True)

    def wait_for_params(self) -> None:
        """Wait until the parameters hold the last step's values: with `overlap_param_gather` (stages 1-2) the
        step leaves their all-gather in flight, waited for by the next forward at each module's first use. Call
        it before reading parameters yourself between `engine.step()` and the next forward (`model.weight`);
        the engine's own methods wait themselves. Waits only on this rank (no collective)."""
        self.post_step.wait()
