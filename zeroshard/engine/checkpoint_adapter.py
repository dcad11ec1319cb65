"""CheckpointAdapter: the engine as the checkpoint package sees it (`checkpoint/protocol.py`'s `Checkpointable`).

The checkpoint package reads and writes the engine only through this
object, so the engine's own surface keeps none of its internals (counters
restored, resident buckets, frozen flats, the names by parameter id).
"""

from __future__ import annotations

from typing import Generator

import torch
import torch.nn as nn

from zeroshard.checkpoint import CheckpointError, Counters
from zeroshard.comm import Comm
from zeroshard.config import Config
from zeroshard.core.bucket import Bucket
from zeroshard.core.flat import FlatParams
from zeroshard.core.precision import LossScaler
from zeroshard.engine.state import TrainingState


class CheckpointAdapter:
    """The checkpoint package's `Checkpointable` over `engine` (a `zeroshard.Engine`, which owns this adapter): its
    counters, state and parts as they are at each call, and what a load restores. Part of the engine, it
    reads the engine's private parts."""

    def __init__(self, engine):
        self.engine = engine

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def lr_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        return self.engine.lr_scheduler

    @property
    def scaler(self) -> LossScaler | None:
        return self.engine.scaler

    @property
    def comm(self) -> Comm:
        return self.engine.comm

    @property
    def config(self) -> Config:
        return self.engine.config

    @property
    def buckets(self) -> list[Bucket]:
        return self.engine.buckets

    def frozen_flats(self) -> list[FlatParams]:
        return self.engine._frozen_flats

    def param_names(self) -> dict[int, str]:
        return self.engine._names

    def resident_buckets(self, write: bool) -> Generator[list[int], None, None]:
        return self.engine.offload.tiers.in_turn(write)  # the disk tier a sub-group at a time, as in the step

    def counters(self) -> Counters:
        return Counters(self.engine.global_steps, self.engine.skipped_steps)

    def restore_counters(self, counters: Counters) -> None:
        engine = self.engine
        engine.global_steps, engine.skipped_steps = counters.global_steps, counters.skipped_steps
        engine.micro_steps = engine.global_steps * engine.config.gradient_accumulation_steps

    def check_checkpoint_boundary(self, action: str) -> None:
        engine = self.engine
        engine._check_usable()  # a failed engine's ranks may be out of step: restart, then load
        accumulation = engine.config.gradient_accumulation_steps
        pending = engine.state is TrainingState.STEP_DUE
        if pending and accumulation == 1:
            raise CheckpointError(f"{action} between engine.backward() and engine.step(): the gradients of that "
                                  "backward are not part of a checkpoint. Call it after engine.step()")
        if pending or engine.micro_steps % accumulation:
            raise CheckpointError(
                f"{action} at micro-step {engine.micro_steps}, inside an accumulation window of "
                f"{accumulation}: the window's partial gradients are not part of a "
                "checkpoint. Call it after the engine.step() that ends the window "
                "(engine.is_gradient_accumulation_boundary() was true before that step)")

    def release_gathered(self) -> None:
        self.engine.release_gathered()

    def gather_params(self) -> None:
        self.engine._update.gather_params()

    def fail(self, why: str) -> None:
        self.engine._fail(why)
