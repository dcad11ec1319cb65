"""`zeroshard.consolidate`: one full state dict from a sharded checkpoint, in one process.

The public name of `zeroshard.checkpoint.consolidate` (see docs/checkpoints.md).
"""

from zeroshard.checkpoint.consolidate import consolidate, full_tensors

__all__ = ["consolidate", "full_tensors"]
