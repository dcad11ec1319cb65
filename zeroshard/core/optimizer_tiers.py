"""Where each bucket's master and optimizer state live, and the optimizer step over them (ZeRO-Offload,
ZeRO-Infinity).

Three tiers: `DEVICE` (beside the parameters, as without offload), `HOST`
(host memory: the step runs on the CPU with the user's torch optimizer, fused
where it has a fused kernel) and `DISK` (swap files under `nvme_path`: the
step runs sub-group by sub-group, reading the next sub-groups' masters and
state while this one steps, and writing each one back behind, so the I/O
overlaps the CPU step). A partial offload (`ratio` < 1) keeps the last buckets
on the device.

The disk tier's staging buffers (`buffer_count` sub-groups) stay allocated
between steps, so they also serve as a cache: the last sub-groups of a pass
stay in memory (their writes landing meanwhile, during the next forward), and
each step visits the sub-groups in the opposite order of the step before, so
those come first and are not read again. A tier of at most `buffer_count`
sub-groups is then read once, at the first step, and only written after.

The optimizer is stepped once per sub-group with only that sub-group's
masters holding a gradient: torch's optimizers skip a parameter without one,
and each master's own step counter advances once per step, so the update is
the same as one step over all of them.
"""

from __future__ import annotations

from collections import deque
from contextlib import closing
from enum import Enum
from typing import Generator, Iterator

import torch

from zeroshard.core.bucket import Bucket
from zeroshard.core.optim import hyperparams, member_of, set_step_grads
from zeroshard.core.swapped import BufferPool, Swapped, SwapState, WriteBehind
from zeroshard.offload import SwapDir


class Tier(Enum):
    """Where a tensor lives: memory pools as `memory_stats(pool=...)` names them."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


def swapped_state_keys(optimizer: torch.optim.Optimizer, group: dict) -> list[str]:
    """The optimizer's state tensors of a master's size (Adam: exp_avg, exp_avg_sq), from one probe step."""
    probe = torch.zeros(4, requires_grad=True)
    optimizer = member_of(optimizer, group)
    hp = {k: v for k, v in hyperparams(optimizer, group).items() if k not in ("fused", "capturable", "foreach")}
    opt = type(optimizer)([probe], **hp)
    probe.grad = torch.zeros(4)
    opt.step()
    return sorted(k for k, v in opt.state[probe].items() if torch.is_tensor(v) and v.shape == probe.shape)


class OptimizerTiers:
    """The tier of every bucket's master and optimizer state, and the step that runs over them."""

    def __init__(self, optimizer: torch.optim.Optimizer, buckets: list[Bucket], tiers: list[Tier],
                 swap: SwapDir | None = None, pool: BufferPool | None = None, sub_group_numel: int = 0,
                 buffer_count: int = 4, masters: dict[int, Swapped] | None = None, grads_on_disk: bool = False,
                 grads: dict[int, Swapped] | None = None, write_behind: WriteBehind | None = None,
                 shards_kept: frozenset[int] = frozenset()):
        """`masters`, `grads`: disk buckets' masters and gradient shards already sent to their swap files (by
        bucket index), as construction moves them out unit by unit; the others' files are made here.
        `grads_on_disk`: stages 2-3, a disk bucket's gradient shard lives on disk too (`swap_grad`).
        `shards_kept`: buckets whose parameter shards (on disk) stay in memory after the step, their writes
        landing during the next forward, whose gather then takes them from memory (`kept_shards`)."""
        self.optimizer, self.buckets, self.tiers = optimizer, buckets, tiers
        self.pool = pool
        self.ahead = max(1, buffer_count - 2)  # sub-groups read ahead; one steps, one writes behind
        self.swaps: dict[int, dict[str, Swapped]] = {}  # bucket index -> "master" and each state key
        self.write_behind = write_behind or WriteBehind(buffer_count)  # gradient shards written as reduced
        self.grad_swaps: dict[int, Swapped] = dict(grads or {})  # bucket index -> its gradient shard's file
        self.shards_kept = shards_kept
        on_disk = [i for i, t in enumerate(tiers) if t is Tier.DISK]
        for i in on_disk:
            self.swaps[i] = self._create_swaps(i, swap, (masters or {}).get(i))
        if grads_on_disk:
            for i in on_disk:
                if i not in self.grad_swaps and buckets[i].switches.shard_grads:
                    self.grad_swaps[i] = swap_grad(swap, i, buckets[i], pool, self.write_behind)
        self.sub_groups = _sub_groups(on_disk, [b.flat.shard_numel for b in buckets], sub_group_numel)
        self.budget = self.ahead + 2  # disk sub-groups in memory at once: read ahead, stepping, written behind
        self._order = list(self.sub_groups)  # this step's order: reversed after each step's pass
        self._kept: list[list[int]] = []  # sub-groups left in memory by the last pass, their writes in flight
        self.adopt()

    def _create_swaps(self, i: int, swap: SwapDir, master: Swapped | None) -> dict[str, Swapped]:
        bucket = self.buckets[i]
        if master is None:
            master = Swapped(swap, f"bucket{i}.master", bucket.master.numel(), bucket.master.dtype, self.pool,
                             bucket.master)
        keys = swapped_state_keys(self.optimizer, self.optimizer.param_groups[bucket.param_group])
        swaps = {"master": master}
        for key in keys:  # the master's size: a master already out is an empty tensor in memory
            swaps[key] = Swapped(swap, f"bucket{i}.{key}", master.numel, master.dtype, self.pool)
        return swaps

    @property
    def order(self) -> list[list[int]]:
        """The disk sub-groups in the order the next pass visits them (the first ones may be in memory)."""
        return list(self._order)

    def tier_of(self, index: int) -> Tier:
        return self.tiers[index]

    @property
    def on_disk(self) -> bool:
        return bool(self.swaps)

    # -- the step --------------------------------------------------------------

    def hold_grads(self) -> None:
        """The window's last micro-step begins: the gradient shards of the sub-groups the step takes first
        (with the state kept in memory, `budget` of them) stay in memory for it instead of going to disk and
        back."""
        for group in self._order[: self.budget]:
            for i in group:
                if i in self.grad_swaps:
                    self.buckets[i].on_disk.held = True

    def gradients(self) -> list[torch.Tensor]:
        """Every bucket's gradient for the optimizer (`master_grad`); those on disk with every write landed
        (none in flight), and a swap-file error any of them met in backward raised here."""
        grads = [bucket.master_grad() for bucket in self.buckets]
        self.write_behind.drain()
        for i in self.grad_swaps:
            self.buckets[i].on_disk.raise_fault()
        return grads

    def step(self, grads: list[torch.Tensor], coef: float = 1.0, optimizer: torch.optim.Optimizer | None = None,
             cast: bool = True) -> None:
        """One optimizer step: device and host buckets in one call, disk buckets sub-group by sub-group;
        every bucket's parameters take its updated master (`cast_master_to_params`). `coef`: the unscale and
        clip factor the caller applied to `grads` in memory, applied here to the gradients read from disk.

        `cast` False (the delayed update, on a thread of its own while the next forward runs): the masters
        and the optimizer state only, stepped by `optimizer` (a copy of the groups' settings as they were,
        `core/delayed_update.py`); nothing a forward reads is touched, and `cast_to_params` follows later.
        """
        optimizer = optimizer or self.optimizer
        with closing(self.in_turn(write=True, grads=True, cast=cast)) as turns:
            for group in turns:
                # Read in this turn; a held shard was in memory when the caller applied `coef`.
                on_disk = [grads[i] for i in group if i in self.grad_swaps and not self.buckets[i].on_disk.held]
                if coef != 1.0 and on_disk:
                    torch._foreach_mul_(on_disk, coef)
                self._step_buckets(group, grads, optimizer)
        self._order.reverse()  # the sub-groups kept in memory come first in the next step

    def _step_buckets(self, indices: list[int], grads: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        for i in indices:
            set_step_grads(self.buckets[i], grads[i])
        try:
            optimizer.step()
        finally:
            for i in indices:
                set_step_grads(self.buckets[i], None)

    def cast_to_params(self) -> None:
        """Every bucket's parameters from its master (a delayed update landing), the disk ones a sub-group at
        a time."""
        with closing(self.in_turn(write=False, state=False)) as turns:  # the masters alone are read
            for group in turns:
                self._cast(group)
        self._settle(list(range(len(self.buckets))))
        self._order.reverse()  # the sub-groups kept in memory come first in the next step

    def in_turn(self, write: bool, grads: bool = False, cast: bool = True,
                state: bool = True) -> Generator[list[int], None, None]:
        """Every bucket once, with its master and optimizer state (and with `grads` its gradient shard) in
        memory during its turn: the buckets in memory in one turn, then the disk tier sub-group by sub-group,
        the next ones read ahead. The step and the checkpoints go through them so, never holding more of the
        disk tier than `ahead` + 2 sub-groups.

        `write`: the caller changes the turn's values in place, or gives a master new optimizer state tensors
        of its size (`optimizer.state[master][key]`); after the turn each bucket's parameters take its master
        (`cast_master_to_params`, unless `cast` is False) and the disk tier's values are written back. Else
        they are only read (`state` False: the masters alone). The disk tier comes in this step's order (every
        pass between two steps sees the same one). Close the generator
        (`contextlib.closing`) where the caller may stop early: nothing then stays in flight."""
        in_memory = [i for i in range(len(self.buckets)) if i not in self.swaps]
        if in_memory:
            yield in_memory
            if write and cast:
                self._cast(in_memory)
                self._settle(in_memory)
        with closing(self.resident_groups(write, grads=grads, settle=cast, state=state)) as groups:
            for group in groups:
                yield group
                if write and cast:  # before `resident_groups` writes the group back; its `_finish` settles casts
                    self._cast(group)

    def _cast(self, indices: list[int]) -> None:
        for i in indices:
            self.buckets[i].cast_master_to_params()

    def resident_groups(self, write: bool, groups: list[list[int]] | None = None,
                        grads: bool = False, settle: bool = True, state: bool = True) -> Iterator[list[int]]:
        """Yield each disk sub-group with its masters and state (and with `grads` its gradient shards) in
        memory: the next `ahead` sub-groups are read meanwhile; after the caller's turn the sub-group's masters
        and state are written back (`write`) or dropped, its gradients dropped, and (`settle`) its parameter
        shards' writes to disk are waited for. At most `budget` sub-groups are in memory at once, and the last
        ones stay there after a pass that ends (`_kept`), their writes in flight."""
        groups = self._order if groups is None else groups
        self._release(keep=groups[: self.budget])
        behind: deque[list[int]] = deque()
        try:
            for n, group in enumerate(groups):
                for later in groups[n + 1 : n + 1 + self.ahead]:
                    self._each(later, Swapped.read, grads, state)
                self._each(group, Swapped.wait, grads, state)
                yield group
                if write:  # masters and state; a gradient is spent once stepped
                    self._bind_state(group)
                    self._each(group, Swapped.write, grads=False)
                behind.append(group)
                coming = min(self.ahead + 1, len(groups) - n - 1)  # in memory during the next turn
                while len(behind) > max(1, self.budget - coming):
                    self._finish(behind.popleft(), settle)
        except BaseException:  # an error, or the caller stopped early: nothing stays in flight
            self._kept = []
            for group in list(behind) + groups:
                self._finish(group, settle)
            raise
        self._kept = list(behind)
        for group in self._kept:  # in memory still: its gradients are spent, its parameter shards must land
            self._finish(group, settle, state=False)

    def _finish(self, group: list[int], settle: bool = True, state: bool = True) -> None:
        """Finish the group's swapped tensors (`state` False: its gradient shards alone) and (`settle`) wait
        for its parameter shards' writes."""
        if state:
            self._each(group, Swapped.finish)
        else:
            for i in group:
                if i in self.grad_swaps:
                    self.grad_swaps[i].finish()
        if settle:
            self._settle(group)

    def _release(self, keep: list[list[int]] = ()) -> None:
        """Finish the sub-groups the last pass left in memory, but those in `keep`: their writes waited for
        (a write's error is raised here), their buffers back in the pool."""
        kept, self._kept = self._kept, []
        for group in kept:
            if group in keep:
                self._kept.append(group)
            else:
                self._finish(group, settle=False)

    def release(self) -> None:
        """Finish every sub-group kept in memory and the parameter shards kept (before the swap files close, or to
        free the buffers)."""
        self._release()
        for i in self.shards_kept:
            self.buckets[i].settle()

    def _settle(self, indices: list[int]) -> None:
        """Wait for the parameter shards written to disk after their cast (parameter offload), but the kept."""
        for i in indices:
            if i not in self.shards_kept:
                self.buckets[i].settle()

    def _each(self, group: list[int], action, grads: bool = True, state: bool = True) -> None:
        for i in group:
            kept = self.swaps[i].values() if state else [self.swaps[i]["master"]]
            for swapped in [*kept, *([self.grad_swaps[i]] if grads and i in self.grad_swaps else [])]:
                if swapped.bound:
                    action(swapped)

    def _bind_state(self, group: list[int]) -> None:
        """After the optimizer's first step its state tensors exist: the swap files follow them."""
        for i in group:
            state = self.optimizer.state.get(self.buckets[i].master, {})
            for key, swapped in self.swaps[i].items():
                if key != "master" and key in state and state[key] is not swapped.tensor:
                    swapped.bind(state[key])

    def adopt(self) -> None:
        """Send the disk buckets' masters and state, as they are in memory now, to their swap files (at
        construction)."""
        for i, swaps in self.swaps.items():
            self._bind_state([i])
            for swapped in swaps.values():
                if swapped.bound and swapped.state is SwapState.RESIDENT:
                    swapped.swap_out()

    # -- reports -----------------------------------------------------------------

    def disk_bytes(self) -> dict[str, int]:
        """Bytes on disk by kind: {"master", "optimizer", "grads"} (values, without the files' alignment
        padding)."""
        master = sum(s["master"].nbytes for s in self.swaps.values())
        state = sum(w.nbytes for s in self.swaps.values() for k, w in s.items() if k != "master" and w.bound)
        return {"master": master, "optimizer": state, "grads": sum(g.nbytes for g in self.grad_swaps.values())}


def swap_grad(swap: SwapDir, index: int, bucket: Bucket, pool: BufferPool, write_behind: WriteBehind) -> Swapped:
    """Stages 2-3: bucket `index`'s fp32 gradient shard lives on disk too, between the reductions that add to
    it (ZeRO-Infinity's gradients on NVMe), and is read back with its sub-group for the step: host memory then
    holds no part of the model states that grows with the model beyond the sub-groups in flight. Not on a
    mesh: the step check's norm there counts parts of the gradients it cannot read."""
    grad = bucket.grad_shard
    swapped = Swapped(swap, f"bucket{index}.grad", grad.numel(), grad.dtype, pool, grad)
    bucket.swap_grads(swapped, write_behind)
    return swapped


def kept_shards(buckets: list[Bucket], budget_numel: int) -> frozenset[int]:
    """The buckets, first in build order (the forward's), whose parameter shards on disk fit together in
    `budget_numel` elements (offload_param's buffer_count x buffer_size): after a step their updated shards
    stay in memory until the next forward gathers them, their writes landing meanwhile, so that forward
    reads none of them from disk and the step waits for none of their writes."""
    kept, numel = [], 0
    for i, bucket in enumerate(buckets):
        if bucket.flat.shard_swap is None:
            continue
        numel += bucket.flat.shard_numel
        if numel > budget_numel:
            break
        kept.append(i)
    return frozenset(kept)


def _sub_groups(indices: list[int], numels: list[int], sub_group_numel: int) -> list[list[int]]:
    """Consecutive disk buckets packed up to `sub_group_numel` elements (at least one bucket each)."""
    groups: list[list[int]] = []
    size = 0
    for i in indices:
        if groups and size + numels[i] <= sub_group_numel:
            groups[-1].append(i)
            size += numels[i]
        else:
            groups.append([i])
            size = numels[i]
    return groups
