"""What the checkpoint package needs of a trainer, and nothing more.

The engine's CheckpointAdapter implements `Checkpointable`; the checkpoint code reads and writes a
trainer only through it, so it never sees the engine's internals and the
engine can change without breaking the format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, Protocol

import torch
import torch.nn as nn

from zeroshard.comm import Comm
from zeroshard.config import Config
from zeroshard.core.bucket import Bucket
from zeroshard.core.flat import FlatParams
from zeroshard.core.precision import LossScaler


@dataclass(frozen=True)
class Counters:
    """The step counters a checkpoint carries (micro-steps follow from them)."""

    global_steps: int  # optimizer steps so far, skipped ones included
    skipped_steps: int  # optimizer steps skipped (fp16 overflow)


class Checkpointable(Protocol):
    """A trainer as a checkpoint sees it: its modules and optimizer, where its shards are, its counters."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None
    scaler: LossScaler | None  # fp16's dynamic loss scale, None otherwise
    comm: Comm
    config: Config  # the stage and training dtype go into the manifest

    @property
    def buckets(self) -> list[Bucket]:
        """Every trained flat buffer, with its master (this rank's shard, or whole at stage 0). A master and
        its optimizer state may be out of memory (offloaded to disk), empty tensors: see `resident_buckets`."""

    def frozen_flats(self) -> list[FlatParams]:
        """Stage 3's sharded frozen parameters (this rank's `shard_data`); empty below stage 3."""

    def param_names(self) -> dict[int, str]:
        """id(parameter) -> its name in the module."""

    def counters(self) -> Counters: ...

    def restore_counters(self, counters: Counters) -> None: ...

    def check_checkpoint_boundary(self, action: str) -> None:
        """Raise `CheckpointError` unless a checkpoint can be taken or loaded now (the end of a window)."""

    def release_gathered(self) -> None:
        """Stage 3: release every gathered unit, since the shards under them are about to change; stages 1-2:
        wait for the all-gathers after the step still in flight, which would write over what is loaded."""

    def resident_buckets(self, write: bool) -> Generator[list[int], None, None]:
        """Every bucket once, a group at a time: yields indices into `buckets` whose masters and optimizer
        state tensors of the master's size are in memory until the next group is asked for; in between,
        a master may be empty. Without `write` they are read only. With `write` the caller may change them
        in place or give a master new state tensors of its size (`optimizer.state[master][key]`); after
        its turn each bucket keeps them where it keeps its state, and its parameters take its master.
        Close it (`contextlib.closing`): a generator left part-way holds a group in memory."""

    def gather_params(self) -> None:
        """After a load: the parameters replicated over the ranks all-gathered from their shards (each took
        its master in its turn of `resident_buckets`), copies of the old values dropped."""

    def fail(self, why: str) -> None:
        """The trainer cannot go on (a load failed part-way): every later call raises, saying `why`."""
