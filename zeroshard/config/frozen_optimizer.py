"""The optimizer of a model that trains nothing: a reference or teacher model held sharded for its forwards.

DPO's and GRPO's reference model, a distillation teacher: every parameter is
frozen, so there is nothing to update and no optimizer state to shard, but
at stage 3 the weights are still sharded and gathered unit by unit for each
forward (as DeepSpeed's ZeRO-3 engine built without an optimizer holds them).
`initialize` gives such a model this optimizer when none is passed.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import torch


class FrozenModelOptimizer(torch.optim.Optimizer):
    """No param groups, no state; `step` does nothing (there is no gradient to apply)."""

    def __init__(self):
        self.__setstate__({"defaults": {}, "state": defaultdict(dict), "param_groups": []})

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing holds a gradient."""

    def __repr__(self) -> str:
        return "FrozenModelOptimizer()"


def trains_nothing(model: torch.nn.Module, model_parameters: list | None) -> bool:
    """Whether no parameter of `model` (or of `model_parameters`, when given) takes a gradient."""
    items = list(model.parameters()) if model_parameters is None else model_parameters
    tensors = [t for item in items for t in (item["params"] if isinstance(item, dict) else [item])]
    return not any(getattr(t, "requires_grad", False) for t in tensors)


def frozen_model_config(config: dict) -> dict:
    """A copy of a training config for an engine over a model that trains nothing: without the optimizer,
    scheduler and optimizer offload, which would build or reserve what it never uses."""
    config = copy.deepcopy(config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    config.get("zero_optimization", {}).pop("offload_optimizer", None)
    return config
