"""`initialize`, step 5: the plan of one model, what goes where, by its parameters alone.

Stages 0-2: the trained parameters in size buckets, in backward order
(`core/bucketing.py`); stage 3: the units and the parameters each one owns
(`stage3/wrapping.py`). Nothing is allocated: a model on the meta device is
planned as it is, before it is materialised (a parameter keeps its identity
when it gets memory). The sizes' rules themselves are `zeroshard.plan`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from zeroshard.config import Config
from zeroshard.core.bucketing import BucketPlan, bucket_params
from zeroshard.engine.checks import Checked
from zeroshard.stage3.wrapping import UnitPlan, plan_units, unit_modules


@dataclass(frozen=True)
class Layout:
    """Which trained parameters form each bucket (stages 0-2) or each unit (stage 3)."""

    buckets: list[BucketPlan] = field(default_factory=list)  # empty at stage 3
    units: list[UnitPlan] = field(default_factory=list)  # empty below stage 3


def make_plan(model: nn.Module, config: Config | None, checked: Checked) -> Layout:
    """The layout of `model` for the config's stage (an empty one after this rank's failure)."""
    if checked.failure is not None:
        return Layout()
    zero = config.zero_optimization
    if config.stage == 3:
        return Layout(units=plan_units(model, unit_modules(model, zero.stage3_wrap_classes,
                                                           zero.stage3_auto_wrap_min_params, zero.leaf_module)))
    return Layout(buckets=bucket_params(model, checked.groups,
                                        min(zero.reduce_bucket_size, zero.allgather_bucket_size)))
