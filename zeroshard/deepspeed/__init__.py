"""`import zeroshard.deepspeed as deepspeed`: a DeepSpeed training script on zeroshard, unchanged.

`initialize` takes DeepSpeed's arguments and returns its 4-tuple (engine,
optimizer, dataloader, lr_scheduler); its engine is a `DeepSpeedEngine`, the
native `zeroshard.Engine` with DeepSpeed's methods (`engine.py`).
`init_distributed` and `add_config_arguments` serve the launch; `zero.Init` and `zero.GatheredParameters` serve stage 3;
`checkpointing` is DeepSpeed's activation checkpointing API; `utils` has
stage 3's leaf modules (`set_z3_leaf_modules`). `OffloadStateTypeEnum` and
`OffloadDeviceEnum` (DeepSpeed's `deepspeed.runtime.zero.offload_config`)
name what `engine.offload_states()` moves.
A DeepSpeed name not provided here raises `MissingAPIError`, saying what to
do instead; docs/migrate-from-deepspeed.md has the whole table.
"""

from zeroshard.deepspeed import checkpointing, utils, zero
from zeroshard.deepspeed.engine import DeepSpeedEngine
from zeroshard.deepspeed.initialize import initialize
from zeroshard.deepspeed.launch import add_config_arguments, init_distributed
from zeroshard.engine.offload_states import OffloadDeviceEnum, OffloadStateTypeEnum
from zeroshard.deepspeed.unsupported import (
    NOT_PROVIDED,
    MissingAPIError,
    UnsupportedError,
    missing,
)

__all__ = ["DeepSpeedEngine", "MissingAPIError", "OffloadDeviceEnum", "OffloadStateTypeEnum", "UnsupportedError",
           "add_config_arguments", "checkpointing", "init_distributed", "initialize", "utils", "zero"]


def __getattr__(name: str):
    raise missing("zeroshard.deepspeed", name, NOT_PROVIDED)
