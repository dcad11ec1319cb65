"""zeroshard: the Zero Redundancy Optimizer (ZeRO) for PyTorch on torch.distributed."""

from zeroshard.config import Config, ConfigError
from zeroshard.engine import Engine, initialize

__all__ = ["Config", "ConfigError", "Engine", "initialize"]
__version__ = "0.1.0"
