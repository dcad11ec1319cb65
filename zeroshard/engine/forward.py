"""Forward: one training or evaluation forward of the engine's model, as ZeRO needs it run.

Floating-point inputs are cast in mixed precision (outputs come back as the
model makes them), module buffers are broadcast from rank 0, the model runs
with its `ActivationMeter`'s saved-tensor hooks around it and its activation
checkpointing current. At stage 3 a failing forward releases the units it
gathered, naming a parameter used outside its unit when that is the cause.
"""

from __future__ import annotations

import torch.nn as nn

from zeroshard.comm import CollectiveError, Comm
from zeroshard.core.activation_meter import ActivationMeter
from zeroshard.core.param_gather import PostStepGather
from zeroshard.core.precision import Precision, cast_inputs
from zeroshard.engine.backward import BackwardPasses
from zeroshard.engine.build import broadcast_buffers
from zeroshard.engine.compiled import CompiledForward
from zeroshard.offload import OffloadError
from zeroshard.parallel.activation_checkpointing import ActivationCheckpointing, running_forward
from zeroshard.stage3.schedule import GatherSchedule
from zeroshard.stage3.sharded_use import sharded_use


class Forward:
    """The engine's forward; the engine keeps the training state around it."""

    def __init__(self, comm: Comm, module: nn.Module, precision: Precision, post_step: PostStepGather,
                 compiled: CompiledForward, checkpointing: ActivationCheckpointing, activations: ActivationMeter,
                 schedule: GatherSchedule | None, passes: BackwardPasses):
        """`passes`: hooks the outputs so that a backward from them starts a pass (engine/backward.py)."""
        self.comm, self.module, self.precision, self.post_step = comm, module, precision, post_step
        self.compiled, self.checkpointing, self.activations = compiled, checkpointing, activations
        self.schedule, self.passes = schedule, passes

    def run(self, args: tuple, kwargs: dict):
        self.passes.mark_inputs((args, kwargs))
        if self.precision.mixed:
            args, kwargs = cast_inputs(args, self.precision.param_dtype), cast_inputs(kwargs, self.precision.param_dtype)
        if self.post_step.overlap and self.compiled.active:  # each waiting hook would break the compiled graph
            self.post_step.stop_overlap()
        try:
            broadcast_buffers(self.comm, self.module)
            with running_forward(self.checkpointing), self.activations.measure((args, kwargs)):
                output = self.module(*args, **kwargs)
            return self.passes.watch_outputs(output)
        except (CollectiveError, OffloadError):  # ranks out of step, or a shard unreadable: the engine fails
            raise
        except BaseException as exc:  # the model's own error (every rank's, or the stall watch says): free the units
            if self.schedule is None:
                raise
            named = sharded_use(exc, self.module, self.schedule.units) if isinstance(exc, Exception) else None
            self.schedule.release_all()  # after the look: which units were whole when it failed counts
            if named is not None:
                raise named from exc
            raise
