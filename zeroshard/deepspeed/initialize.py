"""`deepspeed.initialize` on zeroshard: DeepSpeed's arguments and 4-tuple over `zeroshard.initialize`.

The config comes from `config`, `config_params` or `args.deepspeed_config`,
exactly one of them, as DeepSpeed requires. The model moves to this rank's
GPU when the group runs on CUDA (DeepSpeed's engine moves it too). The
optimizer and LR scheduler may be objects or callables, as DeepSpeed takes
them; `training_data` becomes a DataLoader over this rank's share.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from zeroshard.comm.group import LaunchError, this_rank_gpu
from zeroshard.config import ConfigError
from zeroshard.deepspeed.engine import DeepSpeedEngine
from zeroshard.deepspeed.unsupported import UnsupportedError
from zeroshard.engine import initialize as zeroshard_initialize
from zeroshard.errors import ModelError


def initialize(args=None, model: nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data: Dataset | None = None, lr_scheduler=None, distributed_port: int = 29500, mpu=None,
               dist_init_required: bool | None = None, collate_fn=None, config=None, mesh_param=None,
               config_params=None) -> tuple[DeepSpeedEngine, torch.optim.Optimizer, DataLoader | None, object]:
    """DeepSpeed's `initialize`: returns (engine, engine.optimizer, a DataLoader or None, engine.lr_scheduler), the
    engine a `DeepSpeedEngine`.

    `distributed_port` has no effect (torchrun sets MASTER_PORT); `mpu` and `mesh_param` raise
    `UnsupportedError` (a mesh goes to `zeroshard.initialize(..., mesh=)`). `dist_init_required=False` with no process group is a
    `LaunchError`; otherwise the group is joined from torchrun's environment if it is not yet.
    """
    if model is None:
        raise ModelError("deepspeed.initialize needs a model: initialize(model=model, ...)")
    if mpu is not None or mesh_param is not None:
        raise UnsupportedError("initialize(mpu=...) and initialize(mesh_param=...) are not read: zeroshard's tensor "
                               "and pipeline parallelism come from a DeviceMesh passed as "
                               "zeroshard.initialize(..., mesh=) (docs/parallel.md); leave them out here")
    config = _config_from(args, config, config_params)
    if dist_init_required is False and not dist.is_initialized():
        raise LaunchError("dist_init_required=False, but no process group exists: call "
                          "torch.distributed.init_process_group (or deepspeed.init_distributed()) first, "
                          "or leave dist_init_required out")
    _to_this_rank_gpu(model)
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model.parameters() if model_parameters is None else model_parameters)
        model_parameters = None  # consumed by the callable (a generator cannot be read twice)
    engine = zeroshard_initialize(model, optimizer, config, model_parameters=model_parameters,
                                  lr_scheduler=lr_scheduler, engine_class=DeepSpeedEngine)
    loader = None if training_data is None else _dataloader(engine, training_data, collate_fn)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _config_from(args, config, config_params):
    """The one config given: `config`, `config_params`, or the file `args.deepspeed_config` names."""
    if config is not None and config_params is not None:
        raise ConfigError("initialize got both config and config_params; pass the config once (config=...)")
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is not None and config is not None:
        raise ConfigError(f"initialize got a config and args.deepspeed_config ({from_args}); give one of them, "
                          "as DeepSpeed requires")
    config = config if config is not None else from_args
    if config is None:
        raise ConfigError("initialize needs a config: config=dict or path, or --deepspeed_config FILE in args "
                          "(deepspeed.add_config_arguments(parser) adds the flag)")
    return Path(config) if isinstance(config, str) else config


def _to_this_rank_gpu(model: nn.Module) -> None:
    """As DeepSpeed's engine: a CPU model goes to this rank's GPU when the group runs on CUDA (NCCL)."""
    nccl = dist.get_backend() == "nccl" if dist.is_initialized() else torch.cuda.is_available()
    on_cpu = [p for p in model.parameters() if p.device.type == "cpu"]
    if nccl and on_cpu:
        model.to(this_rank_gpu())


def _dataloader(engine: DeepSpeedEngine, dataset: Dataset, collate_fn) -> DataLoader:
    """DeepSpeed's: this rank's share of `dataset` (a DistributedSampler, shuffled with seed 0 as torch's default),
    in micro-batches of `train_micro_batch_size_per_gpu`; the last incomplete one dropped when the config's
    `dataloader_drop_last` is true."""
    micro = engine.train_micro_batch_size_per_gpu()
    if micro is None:
        raise ConfigError("initialize(training_data=...) needs the micro-batch size: set "
                          "train_micro_batch_size_per_gpu (or train_batch_size) in the config")
    sampler = DistributedSampler(dataset, num_replicas=engine.world_size, rank=engine.global_rank)
    return DataLoader(dataset, batch_size=micro, sampler=sampler, collate_fn=collate_fn,
                      drop_last=engine.config.dataloader_drop_last)
