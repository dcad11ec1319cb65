"""`initialize`, step 3: this rank's device and the process group, joined in this one place.

The device is the model's (`validate.device_of`), or for a model built on
the meta device the one it will be materialised on (`default_device`:
this rank's GPU, else the CPU). The group is the one given (a mesh's `dp`),
else the default group, started from torchrun's environment if it is not
yet (`comm/group.py`), with the config's collective timeout.

A rank whose config failed to load still joins (with the default timeouts),
so that the agreement can raise its error on every rank instead of leaving
the others waiting for it; in one process there is no one to tell, and the
error is raised at once, before any group is made.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from zeroshard.comm import Comm, CommRecorder, ensure_process_group
from zeroshard.comm.topology import declared_scope
from zeroshard.engine.load import Loaded
from zeroshard.engine.validate import check_device_matches_group, device_of
from zeroshard.stage3.materialize import default_device, on_meta


@dataclass(frozen=True)
class Joined:
    """This rank in its group."""

    comm: Comm  # the data-parallel group ZeRO runs over, with its recorder
    device: torch.device  # where this rank's model states live


def join(model: nn.Module, group: dist.ProcessGroup | None, loaded: Loaded) -> Joined:
    """Join `group` (None: the default group, made if needed) on this rank's device; `loaded.failure` in one
    process is raised here."""
    config = loaded.config
    if config is None and (dist.get_world_size(group) if group is not None or dist.is_initialized()
                           else int(os.environ.get("WORLD_SIZE", "1"))) <= 1:
        raise loaded.failure
    device = default_device() if on_meta(model) else device_of(model)
    timeout = None if config is None else timedelta(seconds=config.collective_timeout)
    group = group or ensure_process_group(device, timeout)
    if config is not None:
        check_device_matches_group(device, group)
    if device.type == "cuda":  # NCCL's object collectives run on the current device
        torch.cuda.set_device(device)
    if config is None:
        return Joined(Comm.create(group, CommRecorder()), device)
    comm = Comm.create(group, CommRecorder(), config.collective_timeout, config.rank_check_timeout,
                       scope=declared_scope(group, config.zero_optimization.ranks_per_node))
    return Joined(comm, device)
