"""Offload at construction: which buckets' optimizer state and which stage-3 shards leave the device.

From the config's `offload_optimizer` (stages 1-3) and `offload_param` (stage 3):

- `offload_choice` says, bucket by bucket in build order, whether its master
  and optimizer state are offloaded (`ratio` < 1: the first buckets, until
  their elements reach that share of the trained elements);
- `OffloadBuild` opens the swap directories before stage 3's units are
  built; as each unit is built (`unit_built`), its buckets' disk-tier masters
  and its parameter shards leave memory at once (`core/swapped.py`; the
  first `max_in_cpu` elements of shards stay on the host), so construction
  never holds the whole rank's share of them in memory, only the unit being
  built; `finish` then makes the optimizer's tiers (`core/optimizer_tiers.py`)
  over every bucket, moving out what no unit moved (stages 1-2).

Every rank builds the same tiers (the choice depends only on the model and
the config); a rank that cannot open or fill its swap files raises, and the
construction's agreement (`core/faults.py`) makes every rank raise with it.
Every swap file is allocated here, at its full size (`SwapDir.file`
fallocates it): a step never needs new space on the disk.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from zeroshard.comm import Comm
from zeroshard.config import Config
from zeroshard.core.bucket import Bucket
from zeroshard.core.optimizer_tiers import OptimizerTiers, Tier, kept_shards, swap_grad
from zeroshard.core.swapped import BufferPool, Swapped, WriteBehind
from zeroshard.offload import ALIGN, Poison, SwapDir
from zeroshard.offload.memory import MMAP_THRESHOLD, return_freed_blocks
from zeroshard.stage3.unit import Unit

log = logging.getLogger(__name__)


@dataclass
class Offload:
    """What offload built: the optimizer's tiers, the tier of stage 3's shards, the swap directories."""

    tiers: OptimizerTiers
    param_tier: Tier = Tier.DEVICE
    swaps: dict[str, SwapDir] = field(default_factory=dict)  # nvme_path -> this rank's swap directory
    pool: BufferPool = field(default_factory=BufferPool)

    def buffers(self) -> list[torch.Tensor]:
        """Host memory offload holds for transfers: the aligned buffers and the I/O threads' bounce buffers."""
        return self.pool.tensors() + [b for swap in self.swaps.values() for b in swap.buffers()]

    def close(self) -> None:
        for swap in self.swaps.values():
            swap.close()

    def largest_shard(self, units: list[Unit] | None) -> int:
        """Elements of the largest piece the disk moves whole: a disk bucket's shard, or a unit's parameter shards
        on disk (`estimate.offload_pool_bytes`'s `largest_shard`)."""
        disk = [self.tiers.buckets[i].flat.shard_numel for i in self.tiers.swaps]
        disk += [sum(f.shard_numel for f in u.gathered_flats if f.shard_swap is not None) for u in units or ()]
        return max(disk, default=0)

    def buffer_overhead(self) -> int:
        """Host bytes of `buffers()` beyond the values they hold, which the pool formula leaves out: each aligned
        buffer's rounding up to ALIGN and its ALIGN of slack, and the I/O threads' bounce buffers."""
        bounces = [b for swap in self.swaps.values() for b in swap.buffers()]
        return 2 * ALIGN * len(self.pool.tensors()) + sum(b.untyped_storage().nbytes() for b in bounces)


def _choose_heap(host_short: bool, log_it: bool) -> None:
    """Host memory bounded by what is held (freed blocks back to the system at once), or glibc's heap left to
    keep them for reuse, where memory is plentiful."""
    if host_short:
        handed_back = return_freed_blocks()
        if log_it:
            log.info("offload to disk with host memory short: %s", (
                f"freed blocks of {MMAP_THRESHOLD} bytes and more go back to the OS at once (glibc "
                "M_MMAP_THRESHOLD)" if handed_back else "the C library is not glibc, so freed blocks stay in "
                "its heap as it decides (host memory may grow beyond what offload holds)"))
    elif log_it:
        log.info("offload to disk: host memory has room for twice what the disk tier holds, so freed blocks stay "
                 "in the C library's heap for reuse (no page faults for the next step's tensors)")


def _say_where_params_went(units: list[Unit], zero, in_cpu: int | None) -> None:
    """offload_param that moves nothing (or nothing to disk) says so, with the key that decided it."""
    shards = sum(flat.shard_numel for unit in units for flat in unit.gathered_flats)
    if shards == 0:
        log.warning("offload_param: no parameter is offloaded: every one is under "
                    "stage3_param_persistence_threshold (%d elements), so it stays whole on every rank; lower it "
                    "(0 offloads every parameter)", zero.stage3_param_persistence_threshold)
    elif in_cpu is not None and in_cpu >= shards:
        log.warning("offload_param nvme: this rank's %d parameter-shard elements all fit in max_in_cpu (%d), so "
                    "they stay in host memory and none goes to disk; set max_in_cpu lower (0: every shard on "
                    "disk)", shards, zero.offload_param.max_in_cpu)


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


class OffloadBuild:
    """Offload set up around construction: the swap directories first, then each unit as it is built.

    Every rank makes the same calls in the same order (the choice depends only
    on the model and the config). A rank whose swap files cannot be made
    raises; the caller makes every rank raise with it (`engine/build.py`).
    """

    def __init__(self, config: Config, comm: Comm, optimizer: torch.optim.Optimizer, grads_on_disk: bool = True,
                 host_short: bool = True):
        """`grads_on_disk`: stages 2-3 with the optimizer on disk keep the gradient shards there too (not on a
        tp/pp mesh, whose step check reads parts of them). `host_short`: host memory could not hold the disk
        tier's states with room to spare (`engine/memory_fit.py`): freed blocks go back to the system at once."""
        zero = config.zero_optimization
        opt, param = zero.offload_optimizer, zero.offload_param
        self.config = config
        self.pool = BufferPool(pin=(opt.pin_memory or param.pin_memory) and torch.cuda.is_available())
        poison = Poison.from_env()
        self.swaps: dict[str, SwapDir] = {}
        self.opt_swap = _swap_dir(opt.nvme_path, comm, config, poison, self.swaps) if opt.device == "nvme" else None
        self.param_tier = {"none": Tier.DEVICE, "cpu": Tier.HOST, "nvme": Tier.DISK}[param.device]
        self.param_swap = (_swap_dir(param.nvme_path, comm, config, poison, self.swaps)
                           if param.device == "nvme" else None)
        self.max_in_cpu = param.max_in_cpu if self.param_swap else None
        # Host memory short: every parameter shard's write is waited for at the step's end, none kept.
        self.kept_numel = 0 if host_short else param.buffer_count * param.buffer_size
        self.log_it = comm.rank == 0
        if self.swaps:
            _choose_heap(host_short, self.log_it)
        self.masters: dict[int, Swapped] = {}  # bucket index -> its master's swap file, written out already
        self.grads: dict[int, Swapped] = {}  # bucket index -> its gradient shard's swap file
        self.grads_on_disk = grads_on_disk and self.opt_swap is not None
        self.write_behind = WriteBehind(opt.buffer_count)
        # An optimizer that makes its state in its constructor (Adagrad) needs the masters' sizes in memory
        # when it is pointed at them: its masters go out in `finish`, with their state.
        self._stream_masters = self.opt_swap is not None and not optimizer.state
        self._units = self._buckets = self._in_cpu = 0  # units and buckets seen; shard elements kept on the host

    def close(self) -> None:
        """Delete the swap files and release the directories: construction failed (here or on another rank).
        At once, not when the exception's frames are collected: a retry in this process on the same
        nvme_path would find them in use."""
        for swap in self.swaps.values():
            swap.close()

    @contextmanager
    def closed_on_error(self) -> Iterator[None]:
        """`close()` if the block raises."""
        try:
            yield
        except BaseException:
            self.close()
            raise

    @property
    def streams(self) -> bool:
        """Whether `unit_built` moves anything (else the caller need not call it, nor agree on it)."""
        return self._stream_masters or self.grads_on_disk or self.param_tier is not Tier.DEVICE

    def unit_built(self, unit: Unit) -> None:
        """Move the unit just built out of memory: its disk-tier masters, and its parameter shards."""
        for bucket in unit.buckets:
            index, self._buckets = self._buckets, self._buckets + 1
            if self._stream_masters and bucket.offload:
                master = bucket.master
                swapped = Swapped(self.opt_swap, f"bucket{index}.master", master.numel(), master.dtype, self.pool,
                                  master)
                swapped.swap_out()
                self.masters[index] = swapped
            if self.grads_on_disk and bucket.offload and bucket.switches.shard_grads:
                self.grads[index] = swap_grad(self.opt_swap, index, bucket, self.pool, self.write_behind)
        if self.param_tier is not Tier.DEVICE:
            self._in_cpu = _offload_shards(self._units, unit, self.param_swap, self.pool, self.max_in_cpu,
                                           self._in_cpu)
        self._units += 1

    def finish(self, optimizer: torch.optim.Optimizer, buckets: list[Bucket], units: list[Unit]) -> Offload:
        """The optimizer's tiers over every bucket (after `shard_optimizer`), and the units not yet moved."""
        for unit in units[self._units:]:
            self.unit_built(unit)
        zero = self.config.zero_optimization
        if self.param_tier is not Tier.DEVICE and self.log_it:
            _say_where_params_went(units, zero, self._in_cpu if self.param_swap else None)
        disk = self.opt_swap is not None
        tiers = [Tier.DEVICE if not b.offload else Tier.DISK if disk else Tier.HOST for b in buckets]
        optimizer_tiers = OptimizerTiers(optimizer, buckets, tiers, self.opt_swap, self.pool, zero.sub_group_size,
                                         zero.offload_optimizer.buffer_count, masters=self.masters,
                                         grads_on_disk=self.grads_on_disk, grads=self.grads,
                                         write_behind=self.write_behind,
                                         shards_kept=kept_shards(buckets, self.kept_numel))
        kept = optimizer_tiers.shards_kept
        if kept and self.log_it:
            log.info("offload_param nvme: %d of the disk's parameter-shard elements stay in host memory from each "
                     "step to the next forward (offload_param.buffer_count x buffer_size, %d)",
                     sum(buckets[i].flat.shard_numel for i in kept), self.kept_numel)
        return Offload(optimizer_tiers, self.param_tier, self.swaps, self.pool)


def _swap_dir(path: str, comm: Comm, config: Config, poison: Poison | None, swaps: dict[str, SwapDir]) -> SwapDir:
    if path in swaps:  # optimizer and parameters under one nvme_path share one directory
        return swaps[path]
    swap = SwapDir(path, comm.rank, threads=config.aio.thread_count + 1, block_size=config.aio.block_size,
                   poison=poison)
    swaps[path] = swap
    if comm.rank == 0:
        log.info("offload to %s: %s I/O", path, "direct (O_DIRECT)" if swap.direct else "buffered")
    return swap


def _offload_shards(u: int, unit: Unit, swap: SwapDir | None, pool: BufferPool, max_in_cpu: int | None,
                    in_cpu: int) -> int:
    """Unit `u`'s sharded flats' `shard_data` to the host; with `swap`, to disk past the first `max_in_cpu`
    elements of all units (`in_cpu` of them kept so far). Returns the elements kept on the host now."""
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
    return in_cpu
