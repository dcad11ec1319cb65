"""The training loop (forward / backward / step) and its construction."""

from zeroshard.engine.engine import Engine
from zeroshard.engine.initialize import initialize
from zeroshard.engine.placement import ParamPlacement, ParamShare, UnitPlacement
from zeroshard.engine.state import EngineStateError, TrainingState

__all__ = ["Engine", "EngineStateError", "ParamPlacement", "ParamShare", "TrainingState", "UnitPlacement", "initialize"]
