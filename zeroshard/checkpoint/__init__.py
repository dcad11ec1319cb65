"""Sharded checkpoints: save and load through the `Checkpointable` protocol, reshard, consolidate (safetensors)."""

from zeroshard.checkpoint.files import CheckpointError
from zeroshard.checkpoint.loading import load
from zeroshard.checkpoint.protocol import Counters, Checkpointable
from zeroshard.checkpoint.saving import save

__all__ = ["CheckpointError", "Counters", "Checkpointable", "load", "save"]
