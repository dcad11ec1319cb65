"""`from zeroshard.accelerate import Accelerator`: an Accelerate script trained by zeroshard's engine.

Accelerate's own `Accelerator` with `config=` a DeepSpeed-style dict or
JSON path: `prepare` makes the model an engine (ZeRO stages 0-3), the
script's loop, dataloaders and `accelerate launch` stay as they are, and the
`deepspeed` package is neither needed nor imitated. docs/accelerate.md.
"""

from zeroshard.accelerate.accelerator import Accelerator

__all__ = ["Accelerator"]
