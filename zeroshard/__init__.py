"""zeroshard: the Zero Redundancy Optimizer (ZeRO) for PyTorch on torch.distributed."""

from zeroshard.checkpoint_files import CheckpointError
from zeroshard.config import Config, ConfigError
from zeroshard.engine import Engine, initialize
from zeroshard.gathered import gathered_parameters

__all__ = ["CheckpointError", "Config", "ConfigError", "Engine", "gathered_parameters", "initialize"]
__version__ = "0.1.0"
