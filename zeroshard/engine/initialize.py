"""`zeroshard.initialize`: the config and optimizer from what the user passes, then the engine."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from zeroshard.config import Config, ConfigError
from zeroshard.config.build import (
    SchedulerArg,
    check_lr_scheduler,
    choose_optimizer,
    config_facts,
    parameter_list,
    schedule_for,
)
from zeroshard.config.logs import show_info
from zeroshard.config.offload_merge import OffloadArg
from zeroshard.engine.agreement import error_everywhere
from zeroshard.engine.engine import Engine
from zeroshard.engine.validate import check_arguments, check_mesh_arguments
from zeroshard.parallel.mesh import Mesh

log = logging.getLogger("zeroshard.config")


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    config: Config | dict | str | Path | None = None,
    group: dist.ProcessGroup | None = None,
    wrap: list[type[nn.Module]] | None = None,
    init: Callable[[nn.Module], None] | None = None,
    *,
    model_parameters: Iterable[Any] | None = None,
    lr_scheduler: SchedulerArg = None,
    mesh: Mesh | None = None, tied: dict[str, str] | None = None,
    offload: OffloadArg = None, engine_class: type[Engine] = Engine,
) -> Engine:
    """Wrap `model` and `optimizer` for ZeRO training on `group` (default: the world).

    The default process group is initialized from torchrun's environment if it is not yet. Rank 0's parameter
    values are broadcast to every rank. `wrap` (stage 3): module classes whose instances each form a unit, as
    the config key `zero_optimization.stage3_wrap_classes`.
    `init` (stage 3, a model built under `torch.device("meta")`): `init(module)` initialises the parameters a
    module holds directly; the model is materialised unit by unit on this rank's device, keeping only shards.
    Without `optimizer`, the config's "optimizer" block builds one, over `model_parameters` when given
    (parameters or param-group dicts, as DeepSpeed's; a trainable parameter left out of them is an error naming
    it: freeze it with requires_grad_(False) or list it). With `optimizer`, an "optimizer" block must agree with
    it ("auto" takes its values), and `model_parameters`, if given, must hold the same trainable parameters.
    `mesh`, `tied`: ZeRO over the mesh's `dp`, the model being this rank's part (its pipeline stage, over
    `tp`); tie name -> this stage's copy (docs/parallel.md).
    `lr_scheduler`: a torch LR scheduler built on `optimizer`, or a function optimizer -> scheduler (called on
    `engine.optimizer`; needed when the block builds the optimizer); else the config's "scheduler" block.
    Either becomes `engine.lr_scheduler`, stepped by `engine.step()` after each applied optimizer step, as
    DeepSpeed does.
    `offload`: the config's offload blocks from code: "cpu" or "nvme" (the optimizer state's device,
    `zero_optimization.offload_optimizer.device`), or a dict with any of "optimizer" and "param" (devices
    "none", "cpu", "nvme"), "nvme_path" (for each block on "nvme") and "ratio" (of the optimizer state), such
    as {"optimizer": "nvme", "param": "cpu", "nvme_path": "/local_nvme"}. It fills the keys the config leaves
    out; a key the config sets to another value is a `ConfigError` (docs/deepspeed-config.md).
    `engine_class`: what is built, `Engine` or a subclass (zeroshard.deepspeed.initialize's `DeepSpeedEngine`).

    Rank 0 logs one block: every "auto" resolved, every batch key derived, every DeepSpeed key with no effect
    (zeroshard.config.logs makes it visible). A config that fails on one rank only (a typo in that rank's
    file) raises `ConfigError` on every rank, naming the rank, instead of leaving the others waiting for it.
    """
    check_arguments(model, optimizer, group, wrap, init)
    check_mesh_arguments(mesh, group, tied)
    group = mesh.group("dp") if mesh is not None else group
    show_info()
    try:
        model_parameters = parameter_list(model_parameters)
        check_lr_scheduler(lr_scheduler, optimizer)
        facts = config_facts(model, group, optimizer, lr_scheduler)
        config, report = Config.load_with_report(config if config is not None else {}, facts, offload)
        if wrap:
            config = _with_wrap_classes(config, wrap)
        optimizer = choose_optimizer(model, optimizer, config, model_parameters)
    except ConfigError as error:  # before the group exists: the other ranks would wait for this one
        error_everywhere(error, model, group)
    engine = engine_class(model, optimizer, config, None if mesh else group, init, mesh=mesh, tied=tied)
    engine.lr_scheduler = schedule_for(config, engine.optimizer, lr_scheduler)
    if engine.comm.rank == 0 and (block := report.block()):
        log.info("%s", block)
    return engine


def _with_wrap_classes(config: Config, wrap: list[type[nn.Module]]) -> Config:
    zero = config.zero_optimization
    names = tuple(cls.__name__ for cls in wrap)
    if zero.stage != 3:  # one script for every stage, as DeepSpeed's zero.Init does nothing below stage 3
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.info("wrap=%s has no effect at stage %d: it chooses stage 3's units", list(names), zero.stage)
        return config
    if zero.stage3_wrap_classes and zero.stage3_wrap_classes != names:
        raise ConfigError(f"wrap={list(names)} and zero_optimization.stage3_wrap_classes="
                          f"{list(zero.stage3_wrap_classes)} disagree; give the units in one place")
    return config.model_copy(update={"zero_optimization": zero.model_copy(update={"stage3_wrap_classes": names})})
