"""Engine: the training loop over ZeRO stages 0-3 and its state; forward, backward and step.

With `bf16` or `fp16` the trained parameters are 16-bit, each rank's optimizer updates an fp32 master (its shard at
stage >= 1), gradients are reduced in `communication_data_type` and summed in fp32. The engine's public methods
delegate to its parts, one file each: forward, grad_sync, optimizer_step, step_update (now or delayed), checkpoints
(over checkpoint_adapter), export and full_parameters, reports, compiled, offload_states. The state machine is in
`state.py`, construction in `build.py`; DeepSpeed's methods are in `zeroshard.deepspeed`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from zeroshard.comm import CollectiveError, OpStats
from zeroshard.comm.watch.entry import enter
from zeroshard.config import Config
from zeroshard.core.activation_meter import ActivationMeter
from zeroshard.core.grad_norm import NonFiniteError, StepCheck
from zeroshard.core.precision import LossScaler
from zeroshard.core.reducer import GradientError
from zeroshard.engine.backward import BackwardPasses
from zeroshard.engine.build import Parts
from zeroshard.engine.checkpoint_adapter import CheckpointAdapter
from zeroshard.engine.checkpoints import Checkpoints
from zeroshard.engine.compiled import CompiledForward
from zeroshard.engine.export import Exports
from zeroshard.engine.forward import Forward
from zeroshard.engine.full_parameters import iter_full_parameters
from zeroshard.engine.offload_states import OffloadStates
from zeroshard.engine.grad_sync import GradSync
from zeroshard.engine.optimizer_step import OptimizerStep
from zeroshard.engine.placement import ParamPlacement, log_placement
from zeroshard.engine.reports import Reports
from zeroshard.engine.state import EngineStateError, TrainingState, check_params_in_place
from zeroshard.engine.step_update import StepUpdate
from zeroshard.engine.user_step import route_user_step
from zeroshard.errors import ZeroshardError
from zeroshard.offload import OffloadError

log = logging.getLogger(__name__)


class Engine:
    """The training loop's handle: `loss = engine(*batch)`, `engine.backward(loss)`, `engine.step()`."""

    def __init__(self, parts: Parts, config: Config,
                 lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None):
        """`parts`: what `zeroshard.initialize` built (`build.py`); `lr_scheduler`: stepped by `step()` after
        each applied optimizer step. The engine builds nothing: it holds the parts, its components and the
        loop's state, and answers the hooks (`parts.calls`) from here on."""
        self.module, self.optimizer, self.config = parts.module, parts.optimizer, config
        self.num_params = parts.num_params  # as built; stage 3 empties them
        # backward passes, optimizer steps, and those not applied (inf or nan in the gradients) so far
        self.micro_steps, self.global_steps, self.skipped_steps = 0, 0, 0
        self.global_grad_norm: float | None = None  # of the last step's gradients; inf if they were not finite
        self.scaler = LossScaler(config.fp16) if config.fp16.enabled else None
        self.lr_scheduler = lr_scheduler  # passed in code, or from the config's block
        self.state = TrainingState.IDLE
        self._failure: str | None = None  # why the engine is FAILED
        self.mesh, self.cross = parts.mesh, parts.cross  # on a mesh: ties, tp and pp reductions (parallel/cross.py)
        self._compiled = CompiledForward(self.module, None)  # a compiled model was compiled in place by the build
        self.comm, self.precision, self.switches = parts.comm, parts.precision, parts.switches
        self._device, self._names, self.pool, self.reducer = parts.device, parts.names, parts.pool, parts.reducer
        self.buckets, self.units, self.schedule = parts.buckets, parts.units, parts.schedule
        self._frozen_flats = [f for unit in self.units for f in unit.frozen]  # stage 3's sharded frozen flats
        self.offload = parts.offload  # where masters, optimizer state and stage 3's shards live
        self.post_step = parts.post_step  # stages 1-2: the all-gathers after each step (overlap_param_gather)
        self.delayed = parts.delayed  # the CPU step in the background
        self.activations = ActivationMeter(self._owned_tensors, self._device)  # what each training forward saves
        # zeroshard.deepspeed.checkpointing.checkpoint in this engine's forward: the config's block, over tp
        self.checkpointing = parts.checkpointing
        self._init_components()
        parts.calls.on_grad, parts.calls.on_gather_failure = self._on_grad, self._fail  # the hooks reach the engine
        route_user_step(self)  # the script's optimizer.step() is engine.step()
        if self.comm.rank == 0:
            log_placement(self.placement())  # what is sharded, kept whole and frozen; the warning if nothing is
            for key, why in self.checkpointing.no_effect(self._device):
                log.info("activation_checkpointing.%s has no effect here: %s", key, why)

    def _init_components(self) -> None:
        self._passes = BackwardPasses(self)  # when a backward pass starts and ends, and what it holds
        if self.schedule is not None:
            self.schedule.on_backward = self._passes.start
        self._forward = Forward(self.comm, self.module, self.precision, self.post_step, self._compiled,
                                self.checkpointing, self.activations, self.schedule, self._passes)
        self._grad_sync = GradSync(self.reducer, self.cross, self.comm, self.pool, self.switches, self.config,
                                   self.buckets, self.schedule, self.offload)
        self._update = StepUpdate(self.offload, self.post_step, self.delayed, self.schedule,
                                  self.cross.world if self.cross else self.comm, self._device)
        self._optimizer_step = OptimizerStep(self.config, self.comm, self.cross, self.buckets, self.switches,
                                             self.offload, self._update, self._device, self.pool, self.schedule,
                                             self.scaler)
        self._states = OffloadStates(self.module, self.buckets, self.optimizer, self.pool, self._frozen_flats,
                                     self.offload, self._device, self.comm.rank)  # offload_states()
        self._reports = Reports(self.config, self.comm, self.cross, self.module, self.optimizer, self.buckets,
                                self.units, self._frozen_flats, self.pool, self.offload, self.activations,
                                self._names, self._update, self._states)
        self._adapter = CheckpointAdapter(self)  # what the checkpoint package reads and writes
        self._checkpoints, self._exports = Checkpoints(self, self._adapter), Exports(self)

    def _owned_tensors(self) -> list[torch.Tensor]:
        """The tensors whose storages hold the model itself: parameters, buffers and the flat buffers."""
        flats = [b.flat for b in self.buckets] + self._frozen_flats
        return [*self.module.parameters(), *self.module.buffers(), *(f.data for f in flats)]

    def _on_grad(self, target: int, param: int) -> None:
        if self.state is not TrainingState.BACKWARD:  # a gradient that reached a parameter first
            self._passes.start()
        self._grad_sync.on_grad(target, param)

    def __call__(self, *args, **kwargs):
        """The model's forward on this rank's micro-batch (`forward.py`): the loss, or whatever it returns."""
        self._check_usable()
        self.comm.trace.begin(self.micro_steps, self.global_steps)  # where this rank is, if a collective stalls
        resume, self.state = self.state, TrainingState.FORWARD
        try:
            return self._forward.run(args, kwargs)
        except CollectiveError as exc:  # a gather failed (stage 3's, or the post-step one): ranks are out of step
            self._fail(f"a collective failed in forward ({exc})")
            raise
        except OffloadError as exc:  # a unit's shards on disk could not be read (every rank raised it)
            self._fail(f"a parameter shard on disk could not be read in forward ({exc})")
            raise
        finally:
            if self.state is TrainingState.FORWARD:
                self.state = resume

    @property
    def device(self) -> torch.device:
        """This rank's device: where the parameters live and where inputs belong."""
        return self._device

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step is the last of its accumulation window."""
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """`loss.backward()` with fp16's loss scale applied in fp32 (engine/backward.py): `loss` is this rank's
        mean over its micro-batch, and the reduction averages the window's micro-steps; `scale_wrt_gas=False`
        (DeepSpeed's) is for a loss the loop divided by them itself. Several backwards may precede a step."""
        self._check_usable()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            what = f"a tensor of shape {tuple(loss.shape)}, requires_grad={loss.requires_grad}" \
                if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise GradientError(f"engine.backward(loss) needs a scalar loss tensor that requires grad; got {what} "
                                "(reduce it with .mean() or .sum(), and compute it outside torch.no_grad(); "
                                "for a non-scalar output call out.backward(grad) itself)")
        if not scale_wrt_gas and self._grad_sync.divide_factor is None:  # a factor replaces the window's mean
            loss = loss * self.config.gradient_accumulation_steps
        scaled = self.scale_loss(loss)
        self._passes.run(lambda: scaled.backward(retain_graph=retain_graph))

    def step(self) -> None:
        """End a micro-step; at the accumulation boundary check, unscale, clip, update and all-gather.

        If any rank's gradients hold inf or nan, the step is not applied on any rank; `NonFiniteError`
        (config `non_finite`) leaves the engine usable (`optimizer_step.py`). With `offload_optimizer.
        delayed_update` the parameters hold every update but this step's until the next boundary
        (`step_update.py`, `flush_update`).
        """
        self._check_usable()
        if self.state is not TrainingState.STEP_DUE:
            raise EngineStateError("engine.step() was called without a backward (loss.backward() or "
                                   "engine.backward(loss)) since the last step")
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self.state = TrainingState.STEP if boundary else TrainingState.IDLE
        if not boundary:
            return
        try:
            self._update.land()  # the delayed update in flight, before this step's gradients are read
            if self._grad_sync.unreduced:  # sync off: the end-of-step pass, whatever hooks did or did not see
                self._reduce_now(ties=True)
            check = self._optimizer_step.run(self.global_steps, self.micro_steps,
                                             self.loss_scale * self._grad_sync.divisor)
            self.global_grad_norm = check.norm
            if check.nonfinite_ranks:
                self._skip_step(check)
            else:
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
                self._end_step(overflow=False)
        except NonFiniteError:  # every rank raises it, after a clean skip: the ranks are still in step
            self.state = TrainingState.IDLE
            raise
        except BaseException as exc:  # a partial update, or a collective some ranks did not finish
            self._fail(f"the optimizer step failed on this rank ({type(exc).__name__}: {exc})")
            raise
        self.state = TrainingState.IDLE
        self._checkpoints.poll()  # an asynchronous save's outcome, known to every rank at this boundary

    def _end_step(self, overflow: bool) -> None:
        self._grad_sync.end_window()
        self.activations.end_window()
        self._optimizer_step.end_window(overflow, self.global_steps)
        self.global_steps += 1

    def _skip_step(self, check: StepCheck) -> None:
        """Inf or nan in some rank's gradients: drop the window's gradients, change nothing else."""
        step, old_scale = self.global_steps, self.loss_scale
        self.skipped_steps += 1
        self._end_step(overflow=True)
        self._optimizer_step.skipped(check, step, old_scale)

    def _fail(self, why: str) -> None:
        """Drop this window's partial gradients; the engine refuses to go on (ranks may be out of step)."""
        self.state, self._failure = TrainingState.FAILED, why
        self._grad_sync.abandon()

    def _check_usable(self) -> None:
        self._passes.check_ended()
        if self.state is TrainingState.FAILED:
            raise EngineStateError(f"this engine cannot continue: {self._failure}. Its collectives may be out "
                                   "of step with the other ranks; restart the job (from a checkpoint)")
        self._states.check_on_device()
        check_params_in_place(self.buckets, self._names)

    def _enter(self, call: str, error: type[ZeroshardError], checkpoint_call: bool = False,
               fix: str | None = None) -> None:
        """Meet every rank in `call` before its first collective (comm/watch/entry.py); a checkpoint call also needs
        every rank at the same step and at a window's end (`check_checkpoint_boundary`), or every rank raises."""
        problem = None
        if checkpoint_call:
            try:
                self._adapter.check_checkpoint_boundary(call)
            except ZeroshardError as exc:  # CheckpointError, or EngineStateError for a failed engine
                problem = exc
        trace = self.comm.trace
        trace.global_step, trace.micro_step, trace.phase = self.global_steps, self.micro_steps, call
        enter(self.comm, call, error=error, problem=problem, same_step=checkpoint_call, fix=fix)

    @property
    def step_due(self) -> bool:
        """Whether a backward ran since the last engine.step(): the step comes next."""
        return self.state is TrainingState.STEP_DUE

    @property
    def gradient_sync(self) -> bool:
        """Whether backward reduces through hooks (True) or leaves gradients on `.grad` for reduce_gradients."""
        return self._grad_sync.sync

    def set_gradient_sync(self, enabled: bool) -> None:
        """Turn hook-driven gradient sync on or off (`engine/grad_sync.py`); only between steps."""
        self._grad_sync.set_sync(enabled, self.state)

    def pipeline_backward(self) -> contextlib.AbstractContextManager[None]:
        """Run a backward pass of your own inside (a pipeline schedule's): gradients stay on `.grad`, and sync
        is off for the rest of training. `engine.step()` comes next; more forwards and backwards may come first."""
        return self._passes.callers()

    def reduce_gradients(self, ties: bool = True) -> None:
        """Reduce the gradients `.grad` holds now (sync off); `ties=False` (stages 2-3, a pipeline's pass per
        micro-batch) leaves the copies tied across pipeline stages for the step's pass (`GradSync.reduce`)."""
        self._check_usable()
        if self.state is not TrainingState.STEP_DUE:
            raise EngineStateError("reduce_gradients() after a backward and before engine.step() only")
        self._grad_sync.check_reduce(ties)
        self._reduce_now(ties)

    def _reduce_now(self, ties: bool) -> None:
        try:
            self._grad_sync.reduce(ties)
        except BaseException as exc:
            self._fail(f"a gradient reduction failed on this rank ({type(exc).__name__}: {exc})")
            raise

    def scale_gradients(self, factor: float) -> None:
        """Divide this window's gradients by `factor` at the step (a pipeline's micro-batches with a mean loss)."""
        self._grad_sync.scale(factor)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times fp16's loss scale (in fp32), for its own `.backward()`; else `loss` (engine/backward.py)."""
        if self.scaler is None:
            return loss
        self._passes.loss_scaled = True  # the next pass does not scale at the model's outputs
        return loss.float() * self.scaler.scale

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """The backward passes inside keep their gradients on this rank, whole, for the next reducing backward
        or the window's step to reduce with its own (DDP's; FSDP2's set_requires_gradient_sync(False))."""
        with self._passes.holding("no_sync"):
            yield

    @contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """The backward passes inside (two losses, GradCache's chunks) reduced once at the exit (DeepSpeed's)."""
        with self._passes.coalesced():
            yield

    def set_gradient_divide_factor(self, factor: float | None) -> None:
        """Divide the window's summed gradients by `factor` instead of ranks x accumulation steps (1.0: the sum,
        for a loss normalised by a global count); None: the mean again. Between steps (FSDP2's)."""
        self._grad_sync.set_divide_factor(factor, self.state)

    def save_checkpoint(self, save_dir: str | Path, tag: str | int | float | None = None,
                        client_state: dict | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False, asynchronous: bool | None = None) -> Path:
        """Write a sharded checkpoint to `save_dir/tag` (default `global_step<N>`) and point `save_dir/latest` at
        it; returns the tag's directory. Every rank calls it, at an accumulation boundary; `client_state` comes
        back from `load_checkpoint`; `asynchronous`: written in the background (`Checkpoints.save`)."""
        return self._checkpoints.save(save_dir, tag, client_state, save_latest, exclude_frozen_parameters,
                                      asynchronous)

    def load_checkpoint(self, load_dir: str | Path, tag: str | int | float | None = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Callable | None = None, *,
                        must_exist: bool = False) -> tuple[Path, dict] | tuple[None, None]:
        """Load a checkpoint written by any world size, stage or dtype; returns (its directory, client_state), or
        (None, None) when `load_dir` holds none yet. DeepSpeed's signature; every rank calls it, and on error
        every rank raises `CheckpointError` with the engine unchanged (`Checkpoints.load`)."""
        return self._checkpoints.load(load_dir, tag, load_module_strict, load_optimizer_states,
                                      load_lr_scheduler_states, load_module_only, custom_load_fn, must_exist)

    def wait_for_checkpoint(self) -> Path | None:
        """Block until the asynchronous save in flight is written by every rank and published as `latest`; its
        tag's directory (None: none in flight). Every rank calls it, before the process ends, too."""
        return self._checkpoints.wait()

    def save_pretrained(self, save_dir: str | os.PathLike, **kwargs) -> Path:
        """Write what `from_pretrained(save_dir)` loads; every rank calls it (`Exports.save_pretrained`)."""
        return self._exports.save_pretrained(save_dir, **kwargs)

    def pretrained_state(self) -> dict[str, torch.Tensor]:
        """The full state dict on rank 0 as `save_pretrained` takes it; every rank calls it (`Exports`)."""
        return self._exports.pretrained_state()

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's state dict (copies), on every rank or on rank 0 only (`Exports.full_state_dict`)."""
        return self._exports.full_state_dict(rank0_only)

    def iter_full_parameters(self, max_bytes: int | None = None, peft: str = "merged",
                             rank0_only: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The weights in batches of (name, tensor) of at most `max_bytes`, full shapes, training dtype, for a
        generator's weight sync; PEFT `peft` "merged", "adapter" or "unmerged" (`engine/full_parameters.py`)."""
        return iter_full_parameters(self, max_bytes, peft, rank0_only)

    def comm_stats(self, dim: str = "dp") -> dict[str, OpStats]:
        """Per logical collective: calls, bytes, blocked seconds, algorithms; of ZeRO's data-parallel traffic
        ("dp"), or on a mesh of `dim` "tp", "pp" or "mesh" (`Reports.comm_stats`)."""
        return self._reports.comm_stats(dim)

    def memory_stats(self, pool: str | None = None) -> dict[str, int]:
        """Bytes this rank holds of each kind, in all pools or in `pool` "device", "host" or "disk" (docs/memory.md)."""
        return self._reports.memory_stats(pool)

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False):
        """DeepSpeed's: free the device memory of the states `include` names (None: all) into host copies, until
        `reload_states()`; between steps, every rank (`OffloadStates`, docs/memory.md)."""
        self._states.check_between_steps(self.state)
        self._update.land()  # a delayed update in flight writes the parameters: landed first
        self.release_gathered()  # stage 3: only the shards are states; no gathered unit stays
        self._states.offload(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """DeepSpeed's: the offloaded states back into their own storage, bit for bit (`OffloadStates.reload`)."""
        self._states.reload(non_blocking)

    def placement(self) -> ParamPlacement:
        """Where this rank's parameters live, in elements and bytes, by unit; no collective (`Reports.placement`)."""
        return self._reports.placement()

    def compile(self, backend: str | Callable = "inductor", compile_kwargs: dict | None = None) -> None:
        """Compile the model's forward in place with `torch.compile(backend=backend, **compile_kwargs)`, as
        DeepSpeed's `engine.compile()`; compiling twice is an error (`CompiledForward.compile`)."""
        self._compiled.compile(backend, compile_kwargs)

    @property
    def is_compiled(self) -> bool:
        """Whether the model's forward runs compiled (`engine.compile()`, or `torch.compile` before `initialize`)."""
        return self._compiled.active

    def flush_update(self) -> None:
        """Apply the delayed update in flight now (`StepUpdate.land`): every rank, at the same step (exports too)."""
        self._check_usable()
        self._update.land()

    def wait_for_params(self) -> None:
        """Wait for the last step's values in the parameters (`overlap_param_gather`), to read them; no collective."""
        self.post_step.wait()

    def release_gathered(self) -> None:
        """Release stage 3's gathered units, after stages 1-2's post-step all-gathers in flight; no collective."""
        self.post_step.wait()  # stages 1-2: a gather in flight would write over what is loaded next
        if self.schedule is not None:
            self.schedule.release_all()
