"""`zeroshard.lightning`: Lightning's Trainer on zeroshard, `L.Trainer(strategy=ZeroshardStrategy(stage=3))`.

Importing it also registers the strategy names "zeroshard" and
"zeroshard_stage_1" to "zeroshard_stage_3" (`L.Trainer(strategy="zeroshard_stage_3")`).
See docs/lightning.md.
"""

from lightning.pytorch.strategies import StrategyRegistry

from zeroshard.lightning.precision import ZeroshardPrecision
from zeroshard.lightning.strategy import ZeroshardStrategy

if "zeroshard" not in StrategyRegistry:
    ZeroshardStrategy.register_strategies(StrategyRegistry)

__all__ = ["ZeroshardPrecision", "ZeroshardStrategy"]
