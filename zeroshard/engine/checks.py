"""`initialize`, step 4: every check of this rank's model, optimizer and config, before anything is made.

Nothing here allocates a tensor or runs a collective; the model and the
optimizer are left as they were. A check that the other ranks pass too
raises here at once (they raise the same); a check that may fail on one
rank alone (a meta parameter edited on that rank) keeps its `ModelError`
in `Checked.failure`, for the agreement (`agreement.py`) to raise on every
rank. What the checks need from the group's answer (ranks that differ, the
memory of a node) is the agreement's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from zeroshard.config import Config, ConfigError
from zeroshard.core.local import is_dtensor
from zeroshard.core.optim import OptimizerError
from zeroshard.core.precision import Precision
from zeroshard.engine.load import Loaded
from zeroshard.engine.validate import check_mesh_config, check_model, trainable_groups, whole_groups
from zeroshard.errors import ModelError
from zeroshard.parallel.mesh import Mesh
from zeroshard.stage3.materialize import check_materializable, on_meta
from zeroshard.stage3.meta import recorded_init


@dataclass
class Checked:
    """What the checks found: the model's trained param groups and its init, or this rank's own failure."""

    precision: Precision | None = None
    init: Callable[[nn.Module], None] | None = None  # a meta model's: init= or what meta_init recorded
    groups: list[list[nn.Parameter]] = field(default_factory=list)  # the optimizer's trained param groups
    whole: list[bool] = field(default_factory=list)  # per group: its optimizer needs tensors whole
    failure: ConfigError | ModelError | None = None  # this rank's alone, raised on every rank by the agreement


def check(loaded: Loaded, init: Callable[[nn.Module], None] | None, mesh: Mesh | None) -> Checked:
    """Check the inputs `load` made usable; `init` and `mesh` as given to `initialize`."""
    if loaded.failure is not None:
        return Checked(failure=loaded.failure)
    model, config = loaded.model, loaded.config
    check_mesh_config(mesh, config, init, model)
    if init is None and on_meta(model):
        init = recorded_init(model)  # zero.Init + from_pretrained: the files' weights
    precision = Precision.from_config(config)
    try:  # this rank's own checks: a failure here reaches every rank (one rank's edit)
        check_materializable(model, init)
        check_model(model, precision.param_dtype)
    except ModelError as error:
        return Checked(precision, init, failure=error)
    groups = trainable_groups(model, loaded.optimizer)  # before any change: a failure leaves all as it was
    whole = whole_groups(loaded.optimizer)
    check_whole(config, groups, whole)
    check_low_rank(config, precision)
    return Checked(precision, init, groups, whole)


def check_whole(config: Config, groups: list[list[nn.Parameter]], whole: list[bool]) -> None:
    """What an optimizer that needs tensors whole (`plan/owners.py`) does not run with yet."""
    whole_params = [p for g, needs in zip(groups, whole) if needs for p in g]
    if not whole_params:
        return
    if any(is_dtensor(p) for p in whole_params):
        raise OptimizerError("an optimizer that needs tensors whole (Muon, Adafactor, LAMB, ...) is given a matrix "
                             "split by tensor parallelism, whose pieces no rank holds together; give the tp-split "
                             "matrices to an element-wise optimizer (AdamW), or train without tp")
    if config.zero_optimization.offload_optimizer.device == "nvme":
        raise ConfigError("zero_optimization.offload_optimizer.device \"nvme\" is not supported with an optimizer "
                          "that needs tensors whole (Muon, Adafactor, LAMB, ...): its state is laid out by tensor, "
                          "not by flat shard; use offload_optimizer.device \"cpu\" (offload_param may stay on nvme)")
    if config.communication_compression.gradients.codec == "powersgd":
        raise ConfigError("communication_compression.gradients.codec \"powersgd\" is not supported with an "
                          "optimizer that needs tensors whole (Muon, Adafactor, LAMB, ...); use another codec")


def check_low_rank(config: Config, precision: Precision) -> None:
    """PowerSGD (stages 0-1; the config refuses it at 2-3) needs a loss that keeps its scale."""
    if config.communication_compression.gradients.codec == "powersgd" and precision.param_dtype == torch.float16:
        raise ConfigError("communication_compression.gradients.codec \"powersgd\" cannot run with fp16.enabled: "
                          "its error feedback carries each step's loss-scaled gradients into the next, whose loss "
                          "scale may differ, so what it adds back would be off by their ratio. Train in bf16 "
                          "(\"bf16\": {\"enabled\": true}) or fp32 with powersgd, or use another codec")
