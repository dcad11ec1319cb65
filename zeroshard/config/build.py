"""What `initialize` takes from the config besides the engine's switches: facts, optimizer, schedule."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn

from zeroshard.config.blocks import build_optimizer, build_scheduler
from zeroshard.config.schema import Config, ConfigError, ConfigFacts
from zeroshard.dtypes import torch_name


def config_facts(model: nn.Module, group: dist.ProcessGroup | None) -> ConfigFacts:
    """The world size (from the group, or torchrun's WORLD_SIZE before it exists) and parameter dtype."""
    if group is not None or dist.is_initialized():
        world_size = dist.get_world_size(group)
    else:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))  # what ensure_process_group will join
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    dtype = torch_name(dtypes.pop()) if len(dtypes) == 1 else None
    return ConfigFacts(world_size=world_size, param_dtype=dtype)


def choose_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                     config: Config) -> torch.optim.Optimizer:
    """The optimizer given, or the one the config's block builds; never both, never neither."""
    if optimizer is not None and config.optimizer is not None:
        # DeepSpeed would use the given one and ignore the block; Accelerate refuses, and so do we.
        raise ConfigError(f"an optimizer was given both to zeroshard.initialize ({type(optimizer).__name__}) "
                          f'and in the config\'s "optimizer" block (type {config.optimizer.type}); keep one: '
                          "remove the block from the config, or pass optimizer=None")
    if optimizer is not None:
        return optimizer
    if config.optimizer is None:
        raise ConfigError("zeroshard.initialize needs an optimizer: pass one (such as "
                          "torch.optim.AdamW(model.parameters(), lr=1e-3)) or add an \"optimizer\" block "
                          'to the config, such as {"type": "AdamW", "params": {"lr": 0.001}}')
    return build_optimizer(config.optimizer, model)


def schedule_for(config: Config, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The config's schedule on `optimizer` (the engine's, over shards), or None without a block."""
    return None if config.scheduler is None else build_scheduler(config.scheduler, optimizer)
