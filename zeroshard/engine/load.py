"""`initialize`, step 2: the config, the optimizer and the module from what the user passes.

Nothing here runs a collective, so a config that fails on one rank only (a
typo in that rank's file) is not raised here: `Loaded.failure` carries its
`ConfigError` to the group (`join.py`) and the agreement (`agreement.py`),
which raise it on every rank, naming the rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from zeroshard.config import Config, ConfigError
from zeroshard.config.build import SchedulerArg, check_lr_scheduler, choose_optimizer, config_facts, parameter_list
from zeroshard.config.logs import show_info
from zeroshard.config.offload_merge import OffloadArg
from zeroshard.core.optim import one_optimizer
from zeroshard.engine.compiled import uncompiled


@dataclass
class Loaded:
    """What the user passed, ready for the group: the module, its optimizer and config, or why not."""

    model: nn.Module  # the module itself (inside torch.compile(model): compiled in place once built)
    compiled_call: Callable | None  # torch.compile(model)'s call, for the module once built; None if not compiled
    config: Config | None = None  # None when `failure`
    optimizer: torch.optim.Optimizer | None = None
    report: str = ""  # the config's LoadReport as rank 0 logs it ("" when it says nothing)
    failure: ConfigError | None = None  # the config or optimizer block could not be used on this rank


def load(model: nn.Module, optimizer: torch.optim.Optimizer | None, config: Config | dict | str | Path | None,
         group: dist.ProcessGroup | None, wrap: list[type[nn.Module]] | None, model_parameters: Iterable[Any] | None,
         lr_scheduler: SchedulerArg, offload: OffloadArg) -> Loaded:
    """The config with every "auto" resolved and `wrap`'s classes merged before validation, and the optimizer
    passed or the one the config's block builds; a `ConfigError` is kept in `failure`, not raised."""
    show_info()
    model, compiled_call = uncompiled(model)  # torch.compile(model) before initialize: its module
    try:
        model_parameters = parameter_list(model_parameters)
        check_lr_scheduler(lr_scheduler, optimizer)
        facts = config_facts(model, group, optimizer, lr_scheduler)
        names = tuple(cls.__name__ for cls in wrap or ())
        loaded, report = Config.load_with_report(config if config is not None else {}, facts, offload, names)
        optimizer = one_optimizer(model, choose_optimizer(model, optimizer, loaded, model_parameters))
    except ConfigError as error:  # before the group exists: the other ranks would wait for this one
        return Loaded(model, compiled_call, failure=error)
    return Loaded(model, compiled_call, loaded, optimizer, report.block())
