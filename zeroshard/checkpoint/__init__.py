"""Sharded checkpoints: save and load through the `Trainer` protocol, reshard, consolidate (safetensors)."""

from zeroshard.checkpoint.files import CheckpointError
from zeroshard.checkpoint.loading import load
from zeroshard.checkpoint.protocol import Counters, Trainer
from zeroshard.checkpoint.saving import save

__all__ = ["CheckpointError", "Counters", "Trainer", "load", "save"]
