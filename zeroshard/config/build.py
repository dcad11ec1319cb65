"""What `initialize` takes from the config besides the engine's switches: facts, optimizer, schedule."""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from zeroshard.config.blocks import build_optimizer, build_scheduler
from zeroshard.config.from_code import optimizer_facts
from zeroshard.config.frozen_optimizer import FrozenModelOptimizer, trains_nothing
from zeroshard.config.schema import Config, ConfigError, ConfigFacts
from zeroshard.dtypes import torch_name

LRScheduler = torch.optim.lr_scheduler.LRScheduler
SchedulerArg = LRScheduler | Callable[[torch.optim.Optimizer], LRScheduler] | None


def config_facts(model: nn.Module, group: dist.ProcessGroup | None,
                 optimizer: torch.optim.Optimizer | None = None, lr_scheduler: SchedulerArg = None) -> ConfigFacts:
    """What resolves "auto": the world size (from the group, or torchrun's WORLD_SIZE before it
    exists), the parameter dtype, the hidden size of a Hugging Face model, the code optimizer and scheduler."""
    if group is not None or dist.is_initialized():
        world_size = dist.get_world_size(group)
    else:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))  # what ensure_process_group will join
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    dtype = torch_name(dtypes.pop()) if len(dtypes) == 1 else None
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    described = None if lr_scheduler is None else getattr(lr_scheduler, "__name__", type(lr_scheduler).__name__)
    return ConfigFacts(
        world_size=world_size, param_dtype=dtype,
        hidden_size=hidden if isinstance(hidden, int) and not isinstance(hidden, bool) else None,
        optimizer=None if optimizer is None else optimizer_facts(type(optimizer).__name__, optimizer.param_groups),
        lr_scheduler=described)


def parameter_list(model_parameters: Iterable[Any] | None) -> list[Any] | None:
    """`model_parameters` as a list (a generator is read once): parameters, or param-group dicts."""
    if model_parameters is None:
        return None
    if isinstance(model_parameters, (torch.Tensor, dict)):
        model_parameters = [model_parameters]
    items = list(model_parameters)
    for item in items:
        if isinstance(item, dict) and "params" in item:
            continue
        if not isinstance(item, torch.Tensor):
            raise ConfigError(f"model_parameters must hold parameters or param-group dicts such as "
                              f"{{'params': [...], 'weight_decay': 0.0}}; got {type(item).__name__}")
    return items


def _trainable_ids(items: list[Any]) -> set[int]:
    tensors = [t for item in items for t in (item["params"] if isinstance(item, dict) else [item])]
    return {id(t) for t in tensors if getattr(t, "requires_grad", False)}


def choose_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer | None, config: Config,
                     model_parameters: list[Any] | None = None) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
    """The optimizer given (the config's block, if any, has been checked to agree with it), or the one
    the block builds over `model_parameters` (default: all of the model's; a Muon block builds a list of
    two), or for a model that trains nothing (every parameter frozen) and no block, `FrozenModelOptimizer`."""
    if optimizer is not None:
        if model_parameters is not None:
            listed = _trainable_ids(model_parameters)
            held = _trainable_ids(optimizer.param_groups)
            if listed != held:
                raise ConfigError("model_parameters and the optimizer passed to zeroshard.initialize hold "
                                  f"different trainable parameters ({len(listed)} and {len(held)}); the optimizer "
                                  "decides what is trained: drop model_parameters, or build the optimizer on them")
        return optimizer
    if config.optimizer is None and trains_nothing(model, model_parameters):
        return FrozenModelOptimizer()  # a reference or teacher model: sharded, gathered for its forwards
    if config.optimizer is None:
        raise ConfigError("zeroshard.initialize needs an optimizer: pass one (such as "
                          "torch.optim.AdamW(model.parameters(), lr=1e-3)) or add an \"optimizer\" block "
                          'to the config, such as {"type": "AdamW", "params": {"lr": 0.001}}')
    names = {id(p): name for name, p in model.named_parameters()}
    return build_optimizer(config.optimizer, model if model_parameters is None else model_parameters, names)


def check_lr_scheduler(lr_scheduler: SchedulerArg, optimizer: torch.optim.Optimizer | None) -> None:
    """A scheduler object must be on the optimizer passed in code; a function builds on the engine's."""
    if lr_scheduler is None or (callable(lr_scheduler) and not isinstance(lr_scheduler, LRScheduler)):
        return
    if not isinstance(lr_scheduler, LRScheduler):
        raise ConfigError(f"lr_scheduler must be a torch LR scheduler or a function optimizer -> scheduler; "
                          f"got {type(lr_scheduler).__name__}")
    _check_steppable(lr_scheduler)
    if optimizer is None or lr_scheduler.optimizer is not optimizer:
        members = getattr(optimizer, "optimizers", ())  # several optimizers passed as a list
        where = ("no optimizer is passed (the config's block builds it)" if optimizer is None
                 else "it is built on one optimizer of the list, and the engine steps all of them as one "
                      "(LambdaLR takes one function per param group)" if lr_scheduler.optimizer in members
                 else "it is built on another optimizer than the one passed")
        raise ConfigError(f"lr_scheduler {type(lr_scheduler).__name__} cannot drive the engine's optimizer: {where}; "
                          "pass a function instead, such as lr_scheduler=lambda opt: "
                          "torch.optim.lr_scheduler.LambdaLR(opt, ...), which zeroshard calls on engine.optimizer")


def _check_steppable(scheduler: LRScheduler) -> None:
    # engine.step() calls step() with no argument; ReduceLROnPlateau's step needs the metric.
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ConfigError("ReduceLROnPlateau steps on a metric, which engine.step() does not have: do not pass it "
                          "as lr_scheduler; call scheduler.step(metric) yourself after engine.step()")


def schedule_for(config: Config, optimizer: torch.optim.Optimizer,
                 lr_scheduler: SchedulerArg = None) -> LRScheduler | None:
    """The schedule on `optimizer` (the engine's, over shards): the one passed in code (a function is
    called on `optimizer`), else the config's block, else None."""
    if lr_scheduler is not None:
        if isinstance(lr_scheduler, LRScheduler):
            return lr_scheduler
        built = lr_scheduler(optimizer)
        if not isinstance(built, LRScheduler) or built.optimizer is not optimizer:
            raise ConfigError("the lr_scheduler function must return a torch LR scheduler built on the "
                              f"optimizer it is given; got {type(built).__name__}")
        _check_steppable(built)
        return built
    return None if config.scheduler is None else build_scheduler(config.scheduler, optimizer)
