"""zeroshard: the Zero Redundancy Optimizer (ZeRO) for PyTorch on torch.distributed."""

from zeroshard import consolidate
from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint.pretrained import pretrained
from zeroshard.comm import CollectiveError
from zeroshard.comm.group import LaunchError
from zeroshard.comm.topology import TopologyError
from zeroshard.config import Config, ConfigError
from zeroshard.core.grad_norm import NonFiniteError
from zeroshard.core.optim import OptimizerError
from zeroshard.core.optimizers import Optimizers
from zeroshard.core.precision import LossScaleError
from zeroshard.core.reducer import GradientError
from zeroshard.engine import Engine, EngineStateError, initialize
from zeroshard.engine.agreement import RankMismatchError
from zeroshard.errors import ModelError, OutOfMemoryError, StatesOffloadedError, ZeroshardError
from zeroshard.stage3.gathered import gathered_parameters
from zeroshard.stage3.generation import GenerationError
from zeroshard.stage3.meta_block import meta_init
from zeroshard.version import __version__

__all__ = [
    "CheckpointError", "CollectiveError", "Config", "ConfigError", "Engine", "EngineStateError", "GenerationError",
    "GradientError",
    "LaunchError", "LossScaleError", "ModelError", "NonFiniteError", "OptimizerError", "Optimizers", "OutOfMemoryError", "RankMismatchError",
    "StatesOffloadedError", "TopologyError", "ZeroshardError", "__version__", "consolidate", "gathered_parameters", "initialize", "meta_init", "pretrained",
]
