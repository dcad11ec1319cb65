"""PipelineStage: torch's pipeline stage with zeroshard as its data-parallel layer.

`torch.distributed.pipelining` syncs gradients itself only for FSDP and DDP;
any other module gets a plain backward. This stage hands the engine the
parts of a schedule step that concern gradients:

- every forward runs through the engine (input casts, stage-3 gathers);
- every backward the schedule runs (full, input-only or weight-only, the
  zero-bubble schedules assigning weight gradients by hand) runs inside
  `engine.pipeline_backward()`: gradients stay on `.grad`, no reduction
  happens on micro-batches that do not need one;
- the schedule's gradient scaling becomes one factor of the step's multiply
  (`engine.scale_gradients`);
- gradients are reduced once, by `engine.step()` after the schedule
  (default: least communication, one reduction per bucket), or with
  `reduce_per_micro_batch=True` (stages 2-3) also after each micro-batch's
  weight gradients are complete (least memory: full gradients live for one
  micro-batch). Either way `engine.step()` reduces whatever is left (the
  copies of tied parameters, summed over the stages first): the explicit
  pass that needs no hook to have fired.

The caller then runs `engine.step()` after `schedule.step(...)`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage as TorchPipelineStage

from zeroshard.errors import ZeroshardError
from zeroshard.parallel.mesh import Mesh


class PipelineError(ZeroshardError, ValueError):
    """A pipeline stage that cannot be built on this engine."""


class PipelineTrainer(Protocol):
    """What the stage needs of an engine (zeroshard.Engine implements it)."""

    module: nn.Module
    mesh: Mesh | None
    config: Any  # zeroshard.Config: the ZeRO stage

    def __call__(self, *args, **kwargs) -> Any: ...

    def pipeline_backward(self) -> AbstractContextManager[None]: ...

    def reduce_gradients(self, ties: bool = True) -> None: ...

    def scale_gradients(self, factor: float) -> None: ...

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor: ...

    def release_gathered(self) -> None: ...

    @property
    def step_due(self) -> bool: ...

    def step(self) -> None: ...

    @property
    def device(self) -> torch.device: ...


_NOT_SUPPORTED = {
    "stage_index": "zeroshard runs one pipeline stage per rank, its pp coordinate (one engine, whose step checks "
                   "and clips the gradients of the whole mesh); looped and V schedules with several stages per "
                   "rank are not supported yet: use Schedule1F1B, ScheduleGPipe or ScheduleInterleavedZeroBubble",
    "dw_builder": "its weight-gradient runner runs outside the engine's view of backward; zero-bubble schedules "
                  "split the weight pass without it (ScheduleInterleavedZeroBubble)",
}
_NOT_SUPPORTED["num_stages"] = _NOT_SUPPORTED["stage_index"]
_ZERO_BUBBLE_AT_STAGE_3 = ("a zero-bubble schedule (split input and weight backward) at ZeRO stage 3 is not supported "
                           "yet: its weight pass runs after the unit's parameters were released. Use stage 2 with "
                           "it, or Schedule1F1B / ScheduleGPipe at stage 3")


class PipelineStage(TorchPipelineStage):
    """One pipeline stage of `engine.module`, over the mesh's `pp` group; pass it to any torch schedule."""

    def __init__(self, engine: PipelineTrainer, *, reduce_per_micro_batch: bool = False, **stage_kwargs):
        """One stage per rank: this rank's `pp` coordinate of the mesh's `pp` stages. `stage_kwargs` go to
        torch's PipelineStage (input_args, output_args, ...)."""
        mesh = engine.mesh
        if mesh is None:
            raise PipelineError("the engine has no mesh: build it with zeroshard.initialize(..., "
                                "mesh=zeroshard.parallel.build_mesh(pp=...))")
        shard_grads = engine.config.zero_optimization.stage >= 2
        if reduce_per_micro_batch and not shard_grads:
            raise PipelineError(f"reduce_per_micro_batch=True needs ZeRO stage 2 or 3 (sharded gradients); at "
                                f"stage {engine.config.zero_optimization.stage} gradients are reduced once a step")
        for given in ("stage_index", "num_stages", "dw_builder"):
            if given in stage_kwargs:
                raise PipelineError(f"{given}= is not supported: {_NOT_SUPPORTED[given]}")
        super().__init__(engine.module, mesh.rank("pp"), mesh.pp, engine.device, group=mesh.group("pp"),
                         **stage_kwargs)
        self.engine = engine
        self.reduce_per_micro_batch = reduce_per_micro_batch

    def clear_runtime_states(self) -> None:
        # Every schedule's step() starts here, on every stage, before any send or receive.
        if self.has_backward and self.engine.step_due:  # a new schedule step on the last one's gradients
            raise PipelineError("schedule.step() again without engine.step() after the last one: its gradients "
                                "would be added to this step's. Call engine.step() after every schedule.step() "
                                "(or use stage.train_step(schedule, inputs, target))")
        super().clear_runtime_states()

    def forward_maybe_with_nosync(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def _compute_outputs(self, *args, module: nn.Module, **kwargs):  # metadata inference's forward
        return self.engine(*args, **kwargs)

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        self.engine.release_gathered()  # stage 3: units the inference gathered

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        with self.engine.pipeline_backward():
            result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if self.reduce_per_micro_batch and backward_type in ("full", "weight"):
            self.engine.reduce_gradients(ties=False)  # this micro-batch's weight gradients are complete
        return result

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        if not full_backward and self.engine.config.zero_optimization.stage == 3:
            raise PipelineError(_ZERO_BUBBLE_AT_STAGE_3)  # train_step says so on every rank before any action
        if loss is not None:  # the last stage: fp16's loss scale, as engine.backward applies it
            loss = self.engine.scale_loss(loss)
        return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)

    def scale_grads(self, grad_scale_factor: int) -> None:
        self.engine.scale_gradients(grad_scale_factor)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        # The reduction itself waits for engine.step(): after schedule.step() has finished every send and
        # receive, the stages may meet in the ties' collective without waiting on each other's schedule.
        self.engine.scale_gradients(grad_scale_factor)

    def train_step(self, schedule, inputs: torch.Tensor | None = None, target: torch.Tensor | None = None
                   ) -> float | None:
        """One optimizer step: `schedule.step` with what this stage takes (`inputs` on the first stage,
        `target` on the last), then `engine.step()`. Returns the last stage's mean loss over the
        micro-batches, None on the other stages. Every rank calls it."""
        if self.engine.config.zero_optimization.stage == 3 and _splits_backward(schedule):
            raise PipelineError(_ZERO_BUBBLE_AT_STAGE_3)
        losses: list[torch.Tensor] = []
        if self.is_first and self.is_last:
            schedule.step(inputs, target=target, losses=losses)
        elif self.is_first:
            schedule.step(inputs)
        elif self.is_last:
            schedule.step(target=target, losses=losses)
        else:
            schedule.step()
        self.engine.step()
        return sum(loss.item() for loss in losses) / len(losses) if self.is_last else None


def _splits_backward(schedule) -> bool:
    """Whether the schedule runs input and weight backward apart (the zero-bubble ones), from its actions."""
    order = getattr(schedule, "pipeline_order", None) or {}
    return any(action is not None and action.computation_type.name in ("BACKWARD_INPUT", "BACKWARD_WEIGHT")
               for actions in order.values() for action in actions)
