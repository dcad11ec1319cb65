"""Offload at construction: which buckets' optimizer state and which stage-3 shards leave the device.

From the config's `offload_optimizer` (stages 1-3) and `offload_param` (stage 3):

- `offload_choice` says, bucket by bucket in build order, whether its master
  and optimizer state are offloaded (`ratio` < 1: the first buckets, until
  their elements reach that share of the trained elements);
- `build_offload` then opens the swap directories, moves the disk tier's
  masters and state out (`core/optimizer_tiers.py`), and puts each sharded
  unit's parameter shard on the host or on disk (`core/swapped.py`), the first
  `max_in_cpu` elements staying on the host.

Every rank builds the same tiers (the choice depends only on the model and
the config); a rank that cannot open or fill its swap files raises, and the
construction's agreement makes every rank raise with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from zeroshard.comm import Comm
from zeroshard.config import Config
from zeroshard.core.bucket import Bucket
from zeroshard.core.optimizer_tiers import OptimizerTiers, Tier
from zeroshard.core.swapped import BufferPool, Swapped
from zeroshard.offload import Poison, SwapDir
from zeroshard.stage3.unit import Unit

log = logging.getLogger(__name__)


@dataclass
class Offload:
    """What offload built: the optimizer's tiers, the tier of stage 3's shards, the swap directories."""

    tiers: OptimizerTiers
    param_tier: Tier = Tier.DEVICE
    swaps: dict[str, SwapDir] = field(default_factory=dict)  # nvme_path -> this rank's swap directory
    pool: BufferPool = field(default_factory=BufferPool)

    def close(self) -> None:
        for swap in self.swaps.values():
            swap.close()


def offload_choice(config: Config, trained_numel: int) -> Callable[[int], bool]:
    """`choose(numel)` for each bucket in build order: whether its optimizer state is offloaded."""
    opt = config.zero_optimization.offload_optimizer
    if opt.device == "none":
        return lambda numel: False
    taken = [0]

    def choose(numel: int) -> bool:
        if taken[0] >= opt.ratio * trained_numel:
            return False
        taken[0] += numel
        return True

    return choose


def build_offload(config: Config, comm: Comm, optimizer: torch.optim.Optimizer, buckets: list[Bucket],
                  units: list[Unit]) -> Offload:
    """Tiers for the optimizer and, at stage 3, the parameter shards (see the module's docstring)."""
    zero = config.zero_optimization
    opt, param = zero.offload_optimizer, zero.offload_param
    pool = BufferPool(pin=(opt.pin_memory or param.pin_memory) and torch.cuda.is_available())
    poison = Poison.from_env()
    swaps: dict[str, SwapDir] = {}
    disk = opt.device == "nvme"
    tiers = [Tier.DEVICE if not b.offload else Tier.DISK if disk else Tier.HOST for b in buckets]
    swap = _swap_dir(opt.nvme_path, comm, config, poison, swaps) if disk else None
    optimizer_tiers = OptimizerTiers(optimizer, buckets, tiers, swap, pool, zero.sub_group_size,
                                     opt.buffer_count)
    offload = Offload(optimizer_tiers, Tier.DEVICE, swaps, pool)
    if param.device != "none":
        offload.param_tier = Tier.DISK if param.device == "nvme" else Tier.HOST
        param_swap = _swap_dir(param.nvme_path, comm, config, poison, swaps) if param.device == "nvme" else None
        _offload_shards(units, param_swap, pool, param.max_in_cpu if param_swap else None)
    return offload


def _swap_dir(path: str, comm: Comm, config: Config, poison: Poison | None, swaps: dict[str, SwapDir]) -> SwapDir:
    if path in swaps:  # optimizer and parameters under one nvme_path share one directory
        return swaps[path]
    swap = SwapDir(path, comm.rank, threads=config.aio.thread_count + 1, block_size=config.aio.block_size,
                   poison=poison)
    swaps[path] = swap
    if comm.rank == 0:
        log.info("offload to %s: %s I/O", path, "direct (O_DIRECT)" if swap.direct else "buffered")
    return swap


def _offload_shards(units: list[Unit], swap: SwapDir | None, pool: BufferPool, max_in_cpu: int | None) -> None:
    """Each sharded flat's `shard_data` to the host; with `swap`, to disk past the first `max_in_cpu` elements."""
    in_cpu = 0
    for u, unit in enumerate(units):
        for k, flat in enumerate(unit.gathered_flats):
            if flat.shard_data.device.type != "cpu":
                flat.shard_data = flat.shard_data.to("cpu", copy=True)
                if pool.pin:
                    flat.shard_data = flat.shard_data.pin_memory()
            frozen = flat in unit.frozen  # stays on the host: checkpoints read its shard as it is
            if swap is None or frozen or in_cpu + flat.shard_numel <= max_in_cpu:
                in_cpu += flat.shard_numel
                continue
            shard = flat.shard_data
            flat.shard_swap = Swapped(swap, f"unit{u}.flat{k}.shard", shard.numel(), shard.dtype, pool, shard)
            flat.shard_swap.swap_out()
