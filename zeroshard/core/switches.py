"""The switches a ZeRO stage is made of: what it shards (DESIGN.md section 3)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageSwitches:
    """Stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also the parameters."""

    shard_optimizer: bool
    shard_grads: bool
    shard_params: bool = False

    @classmethod
    def for_stage(cls, stage: int) -> StageSwitches:
        return cls(stage >= 1, stage >= 2, stage >= 3)
