"""The engine's training state: where one micro-step stands, as an explicit state machine.

    IDLE --engine(...)--> FORWARD --> back to where it was (IDLE or STEP_DUE)
    IDLE --engine.backward--> BACKWARD --> STEP_DUE --engine.step--> IDLE         (inside a window)
                                           STEP_DUE --engine.step--> STEP --> IDLE (at its boundary)
    BACKWARD or STEP --an exception--> FAILED; FORWARD --a failed collective--> FAILED
    FAILED is final: ranks may be out of step, so the job restarts (from a checkpoint).

A forward may run in STEP_DUE too (evaluating between backward and step).
"""

from __future__ import annotations

from enum import Enum

from zeroshard.core.bucket import Bucket
from zeroshard.core.local import local
from zeroshard.errors import ZeroshardError


class TrainingState(Enum):
    IDLE = "idle"  # between micro-steps
    FORWARD = "forward"  # inside engine(...)
    BACKWARD = "backward"  # inside engine.backward(loss)
    STEP_DUE = "step due"  # a backward has run: engine.step() comes next
    STEP = "step"  # inside engine.step() at an accumulation boundary
    FAILED = "failed"  # ranks may be out of step; the engine refuses to continue


class EngineStateError(ZeroshardError, RuntimeError):
    """A call that the training state does not allow: backward twice, step without backward, a gradient
    outside engine.backward, any call on a failed engine, or parameters replaced after initialize."""


def check_params_in_place(buckets: list[Bucket], names: dict[int, str]) -> None:
    """`EngineStateError` if a parameter no longer lives in its flat buffer (replaced after initialize)."""
    for bucket in buckets:
        if bucket.switches.shard_params:  # its parameters are empty between uses
            continue
        flat = bucket.flat
        if local(bucket.params[0]).data_ptr() != flat.data.data_ptr() + flat.offsets[0] * flat.data.element_size():
            raise EngineStateError(
                f"parameter '{names[id(bucket.params[0])]}' no longer lives in zeroshard's flat "
                "buffer (model.to(), .half() or .cuda() after initialize replaces parameters); move and "
                "cast the model before zeroshard.initialize")
