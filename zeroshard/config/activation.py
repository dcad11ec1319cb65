"""The `activation_checkpointing` section: DeepSpeed's block, read by the engine.

DeepSpeed reads this block only through `deepspeed.checkpointing.configure`;
zeroshard's engine reads it itself and applies it to every
`zeroshard.deepspeed.checkpointing.checkpoint` call made in its forward
(`configure` called by the script overrides it, as DeepSpeed's arguments
override its file). It changes nothing of a region checkpointed with
`torch.utils.checkpoint` directly. What each key does, and where it has no
effect and why (a line logged at start-up): docs/memory.md.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from zeroshard.config.values import FROZEN_STRICT as _FROZEN_STRICT
from zeroshard.config.values import StrictBool, optional_positive_int


class ActivationCheckpointingConfig(BaseModel):
    """The `activation_checkpointing` section (ZeRO-R's partitioned activation checkpointing, Pa and Pa+cpu)."""

    model_config = _FROZEN_STRICT

    partition_activations: StrictBool = Field(False, description=(
        "true: each tensor-parallel rank keeps 1/tp of each checkpointed input (ZeRO-R's Pa), all-gathered over "
        "tp when backward recomputes the region (recorded in comm_stats(\"tp\")); no effect without tensor "
        "parallelism (tp = 1). DeepSpeed: activation_checkpointing.partition_activations (default false)."))
    cpu_checkpointing: StrictBool = Field(False, description=(
        "true: the checkpointed inputs (their partitions, with partition_activations) are kept in host memory "
        "and copied back for the recompute (ZeRO-R's Pa+cpu); memory_stats(\"host\")[\"activations\"] counts "
        "them. No effect on a CPU device. DeepSpeed: activation_checkpointing.cpu_checkpointing (default false)."))
    contiguous_memory_optimization: StrictBool = Field(False, description=(
        "true: the kept partitions are copied into one buffer of number_checkpoints slots per input position "
        "(against fragmentation), a new buffer for each forward the engine runs; needs partition_activations "
        "and number_checkpoints. DeepSpeed: activation_checkpointing.contiguous_memory_optimization "
        "(default false)."))
    number_checkpoints: Annotated[int | None, BeforeValidator(optional_positive_int)] = Field(None, description=(
        "Checkpoints (count) per forward: the slots of contiguous_memory_optimization's buffers; no effect "
        "without it. DeepSpeed: activation_checkpointing.number_checkpoints (default null)."))
    synchronize_checkpoint_boundary: StrictBool = Field(False, description=(
        "true: torch.cuda.synchronize() before and after each checkpointed region's forward and recompute; no "
        "effect on a CPU device. DeepSpeed: activation_checkpointing.synchronize_checkpoint_boundary "
        "(default false)."))
    profile: StrictBool = Field(False, description=(
        "true: rank 0 logs the time (ms) of each checkpointed region's forward and recompute (synchronized on "
        "CUDA). DeepSpeed: activation_checkpointing.profile (default false)."))

    @model_validator(mode="after")
    def _contiguous_needs(self) -> ActivationCheckpointingConfig:
        if self.contiguous_memory_optimization and not (self.partition_activations and self.number_checkpoints):
            raise PydanticCustomError(
                "zeroshard", "activation_checkpointing.contiguous_memory_optimization needs partition_activations "
                "true and number_checkpoints (the checkpoints per forward, the buffers' slots), as DeepSpeed's "
                "does: set both, or remove contiguous_memory_optimization")
        return self
