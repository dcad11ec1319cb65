"""DeepSpeed's launch helpers: `init_distributed` and `add_config_arguments`.

zeroshard is launched with torchrun; `init_distributed` joins the default
process group from torchrun's environment (`comm/group.py`), or makes a
one-rank group when the script runs as a plain `python train.py`.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch
import torch.distributed as dist

from zeroshard.comm.group import LaunchError, ensure_process_group, this_rank_gpu
from zeroshard.deepspeed.unsupported import UnsupportedError


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Join the default process group from torchrun's environment, as DeepSpeed's does from its launcher's.

    Nothing happens if the group exists. `dist_backend` None: NCCL when CUDA is available, else gloo.
    `auto_mpi_discovery`, `distributed_port` (torchrun sets MASTER_PORT), `verbose` and `config` have no
    effect; `init_method`, `rank` and `world_size` are refused: launch with torchrun.
    """
    if init_method is not None or rank != -1 or world_size != -1:
        raise UnsupportedError("init_distributed(init_method=..., rank=..., world_size=...) is not supported: "
                               "launch with `torchrun --nproc-per-node N script.py`, which sets RANK, WORLD_SIZE, "
                               "MASTER_ADDR and MASTER_PORT")
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("nccl", "gloo"):
        raise LaunchError(f"dist_backend {backend!r} is not supported: use 'nccl' (CUDA) or 'gloo' (CPU)")
    if backend == "nccl" and not torch.cuda.is_available():
        raise LaunchError("dist_backend 'nccl' needs CUDA, and none is available: use 'gloo' on the CPU")
    if dist_init_required is False or dist.is_initialized():
        return
    device = this_rank_gpu() if backend == "nccl" else torch.device("cpu")
    ensure_process_group(device, timeout)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's `--deepspeed` (a flag for the script's own use) and `--deepspeed_config` (the JSON file
    `initialize(args=...)` reads) to `parser`; returns it."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (a flag for the script's own use; no effect in zeroshard)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file.")
    return parser
