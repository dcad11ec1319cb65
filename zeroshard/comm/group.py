"""The default process group: joined from the torchrun environment when not yet set up."""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from zeroshard.errors import ZeroshardError

log = logging.getLogger(__name__)

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class LaunchError(ZeroshardError, RuntimeError):
    """The process group cannot be formed from the environment (an incomplete torchrun launch)."""


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def this_rank_gpu() -> torch.device:
    """This rank's GPU: torchrun's LOCAL_RANK, the one `ensure_process_group` makes current. Not the current
    device: asked for before the group is joined, that is cuda:0 on every rank. Without LOCAL_RANK, or with
    one beyond the GPUs this process sees (each rank given its own by CUDA_VISIBLE_DEVICES), the current
    device."""
    count = torch.cuda.device_count()
    local_rank = int(os.environ.get("LOCAL_RANK", count))
    return torch.device("cuda", local_rank if local_rank < count else torch.cuda.current_device())


def ensure_process_group(device: torch.device, timeout: timedelta | None = None) -> dist.ProcessGroup:
    """The default group, initialized from torchrun's variables if needed.

    With none of torchrun's variables set, a one-rank group is made, so a
    plain `python train.py` runs as world size 1.
    """
    if dist.is_initialized():
        return dist.group.WORLD
    backend = backend_for(device)
    present = [v for v in _TORCHRUN_VARS if v in os.environ]
    kwargs = {} if timeout is None else {"timeout": timeout}
    if not present:
        log.info("no torchrun environment: starting a one-rank %s group", backend)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    elif len(present) < len(_TORCHRUN_VARS):
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        raise LaunchError(
            f"the torchrun environment is incomplete: {', '.join(missing)} not set; "
            "launch with `torchrun --nproc-per-node N script.py` or call "
            "torch.distributed.init_process_group yourself before zeroshard.initialize"
        )
    else:
        if device.type == "cuda":
            torch.cuda.set_device(this_rank_gpu())
        dist.init_process_group(backend, **kwargs)
    return dist.group.WORLD
