"""Unit: a module's parameters at stage 3, gathered together and reduced together.

A unit is made of buckets, one `Bucket` per optimizer param group and
persistence (a flat buffer holds one group: the optimizer steps one master
tensor per group):

- sharded buckets hold only this rank's shard between uses and are gathered
  around the module's forward and backward;
- persistent buckets (parameters under `stage3_param_persistence_threshold`
  elements, DeepSpeed's rule) stay whole on every rank, as at stage 2;
- frozen flats hold sharded parameters that do not require grad (the frozen
  base of a LoRA model): gathered with the unit, never reduced or stepped.
"""

from __future__ import annotations

from enum import Enum
from typing import Callable

import torch
import torch.nn as nn

from zeroshard.comm import Comm, CompressedReduction, PendingGroup, broadcast
from zeroshard.comm.agreement import Agreement
from zeroshard.core.bucket import FP32, Bucket
from zeroshard.core.switches import StageSwitches
from zeroshard.core.faults import offload_agreement
from zeroshard.core.flat import FlatParams
from zeroshard.core.precision import Precision
from zeroshard.core.staging import StagingPool
from zeroshard.stage3.gathers import Gathers
from zeroshard.stage3.materialize import Materializer
from zeroshard.stage3.wrapping import UnitPlan, flat_parts


class UnitState(Enum):
    """Where a unit's gathered parameters are within a step (`GatherSchedule` moves it)."""

    SHARDED = "sharded"  # only this rank's shard is held
    GATHERING = "gathering"  # an all-gather is in flight (a prefetch, or a need not yet waited for)
    GATHERED = "gathered"  # whole: forward or backward may use it


class Unit:
    """One unit module's buckets, with the interface `GradReducer` drives, and its gather state."""

    def __init__(self, name: str, module: nn.Module, buckets: list[Bucket], frozen: list[FlatParams]):
        self.name, self.module = name, module
        self.buckets = buckets
        self.frozen = frozen
        # What is gathered on demand; persistent buckets are always whole.
        self.gathered_flats = [b.flat for b in buckets if b.switches.shard_params] + frozen
        self.gathered_numel = sum(f.padded_numel for f in self.gathered_flats)
        self.switches = StageSwitches.for_stage(3)
        self.flats = [b.flat for b in buckets] + frozen
        self.params = [p for b in buckets for p in b.params]  # trainable, as the reducer indexes them
        self._where = [(bi, pi) for bi, b in enumerate(buckets) for pi in range(len(b.params))]
        self.state = UnitState.SHARDED
        self._gather: PendingGroup | None = None  # in flight while GATHERING
        self._read: Agreement | None = None  # with it: how every rank's reads of its shards went (offload)
        self.quantized = False  # the gathered buffers hold qwZ's dequantized values, not the shards' own
        self.hidden = False  # gathered, its parameters pointed away until the next use or the round that frees it

    @property
    def whole(self) -> bool:
        """Whether the gathered parameters are usable now."""
        return self.state is UnitState.GATHERED and not self.hidden

    @property
    def held(self) -> bool:
        """Whether a gather of it landed or is in flight (every rank started it: it lands)."""
        return self.state is not UnitState.SHARDED

    def start_gather(self, gathers: Gathers, exact: bool = True) -> None:
        """SHARDED -> GATHERING: all-gather every sharded flat buffer into its full buffer.

        `exact`: the shards' own values; else training's gather, which ZeRO++ may quantize or keep in the node.
        """
        if self.state is UnitState.GATHERING or self.whole:
            raise RuntimeError(f"unit '{self.name}' is {self.state.value}: it cannot start another gather")
        read = self._wait_shards(gathers.comm)
        self._gather = PendingGroup([gathers.start(flat, exact, what=f"unit '{self.name}'")
                                     for flat in self.gathered_flats])
        self._read = read
        self.quantized = gathers.quantizes(exact)
        self.state = UnitState.GATHERING

    def read_shards(self) -> None:
        """Start reading the shards that live on disk (parameter offload), ahead of this unit's gather."""
        if self.state is UnitState.SHARDED:
            for flat in self.gathered_flats:
                if flat.shard_swap is not None:
                    flat.shard_swap.read()

    def _wait_shards(self, comm: Comm) -> Agreement | None:
        """Shards on disk (parameter offload): wait for their reads (or, for shards a step kept in memory, their
        writes), and tell every rank how they went, in flight beside the gather (`core/faults.py`): a rank
        whose transfer failed still joins the gather (`Swapped.stand_in`), and every rank raises at
        `wait_gather`, before anything uses it."""
        swaps = [flat.shard_swap for flat in self.gathered_flats if flat.shard_swap is not None]
        if not swaps:
            return None
        problem = None
        for swap in swaps:
            try:
                swap.wait()
            except Exception as exc:  # every rank must hear of it; this one still joins the gather
                problem = problem or exc
                swap.stand_in()
        # The same words on every rank; the failed rank's own error says which transfer failed.
        return offload_agreement(comm, problem, f"reading the parameter shards of unit '{self.name}' from disk "
                                 "(or writing them back after the step)", self.gathered_flats[0].device)

    def wait_gather(self) -> None:
        """GATHERING -> GATHERED."""
        if self._gather is not None:
            gather, self._gather = self._gather, None
            read, self._read = self._read, None
            try:
                gather.wait()
                if read is not None:
                    read.settle()
            except BaseException:  # nothing landed: the full buffer must not pass for gathered
                self.forget()
                raise
        self.state = UnitState.GATHERED

    def hide(self, hidden: bool) -> None:
        """Its forward is over on this rank, but only a round may free it (stage3/agreement.py): its parameters
        read as empty meanwhile, as a released unit's, so a use outside its forward fails the same way."""
        if self.state is UnitState.GATHERED and self.hidden != hidden:
            for flat in self.gathered_flats:
                flat.point_params(whole=not hidden)
            self.hidden = hidden

    def release(self) -> None:
        """Any state -> SHARDED; a gather still in flight lands first (every rank launched it)."""
        self.wait_gather()
        for flat in self.gathered_flats:
            flat.release_full()
        self.state, self.hidden = UnitState.SHARDED, False

    def forget(self) -> None:
        """After a failure: back to SHARDED without waiting for a gather the other ranks may never join."""
        self._gather = self._read = None
        for flat in self.gathered_flats:
            flat.release_full()
        self.state, self.hidden = UnitState.SHARDED, False

    def drop_secondaries(self) -> None:
        """hpZ: the secondary shards no longer match the shards (a step, a load, an edit)."""
        for flat in self.gathered_flats:
            flat.secondary = None

    def scatter_edits(self) -> None:
        """Keep edits made to the gathered parameters: copy each rank's shard back, into the master too."""
        if self.quantized:  # never let qwZ's rounding into the masters
            raise RuntimeError(f"unit '{self.name}' holds qwZ's dequantized weights (gathered by a forward): "
                               "edit parameters outside forward and backward")
        self.drop_secondaries()
        with torch.no_grad():
            for flat in self.gathered_flats:
                if flat.shard_swap is not None:
                    flat.shard_swap.claim()
                flat.shard_data.copy_(flat.shard(flat.data))
        for bucket in self.buckets:
            bucket.take_params_into_master()
        for flat in self.gathered_flats:
            if flat.shard_swap is not None:
                flat.shard_swap.swap_out()

    # -- the reducer's interface ---------------------------------------------

    def attach_grads(self) -> None:
        """Gradients are staged per micro-step at stage 3; nothing persists on `.grad`."""

    def take_grad(self, index: int, pool: StagingPool) -> None:
        bucket, param_index = self._where[index]
        self.buckets[bucket].take_grad(param_index, pool)

    def reduce_grad(self, comm: Comm, pool: StagingPool, scale: float) -> PendingGroup:
        return PendingGroup([b.reduce_grad(comm, pool, scale) for b in self.buckets])


def build_units(
    plans: list[UnitPlan], groups: list[list[nn.Parameter]], comm: Comm, persistence_threshold: int,
    materialize: Materializer | None = None, precision: Precision = FP32, accumulation: int = 1,
    use_reduce_scatter: bool = True, compressed: CompressedReduction | None = None,
    offload: Callable[[int], bool] = lambda numel: False,
    own_master: bool = False, built: Callable[[Unit], None] | None = None,
    owned: Callable[[int | None, list[nn.Parameter]], list[int] | None] = lambda group, params: None,
) -> list[Unit]:
    """Flatten each planned unit's parameters, start them from rank 0's values, and shard them.

    Units are built one after another, so at most one unit's full buffer
    exists beside the model's original parameters; for a model on the meta
    device, `materialize` initialises each unit in its buffer, so no rank
    ever holds more than one unit of the full model. `compressed`: the quantized
    gradient reduction for the sharded buckets (persistent ones, small, reduce exactly). `offload(numel)`: whether a
    bucket's master and optimizer state go to the host (`Bucket`'s `offload`); `own_master`: the
    parameter shards are offloaded, so no master may share their storage. `built(unit)` runs after each
    unit is made, before the next (offload moves its shards out of memory there). `owned(group, params)`:
    the owning rank of each parameter, where the group's optimizer needs tensors whole (`plan/owners.py`).
    """
    group_of = {id(p): g for g, params in enumerate(groups) for p in params}
    device = materialize.device if materialize else None
    units = []
    for plan in plans:
        parts = [(g, persistent, FlatParams(params, comm.world_size, comm.rank, device, owned(g, params)))
                 for g, persistent, params in flat_parts(plan.params, group_of, len(groups), persistence_threshold)]
        if materialize:
            materialize(plan.owners, plan.params)
        units.append(_shard_parts(plan.name, plan.module, parts, comm, precision, accumulation, use_reduce_scatter,
                                  compressed, offload, own_master))
        if built is not None:
            built(units[-1])
    return units


def _shard_parts(name: str, module: nn.Module, parts, comm: Comm, precision: Precision, accumulation: int,
                 use_reduce_scatter: bool, compressed: CompressedReduction | None, offload: Callable[[int], bool],
                 own_master: bool) -> Unit:
    """Broadcast rank 0's values of each flat buffer, then keep only what this rank holds.

    In the model's dtype: fp32 masters start from the model's own values, and
    the parameters are cast to the training dtype after (frozen ones only under mixed precision).
    """
    buckets, frozen = [], []
    for g, persistent, flat in parts:
        with torch.no_grad():
            broadcast(comm, flat.data, src=0)
        if g is None:
            flat.keep_shard_only()
            # Frozen parameters keep their dtype unless mixed precision casts the model (as below stage 3):
            # a frozen bf16 base under an fp32 config stays bf16, as plain PyTorch runs it.
            if precision.mixed and flat.dtype != precision.param_dtype:
                flat.cast_(precision.param_dtype)
            frozen.append(flat)
        else:
            switches = StageSwitches.for_stage(2 if persistent else 3)
            kind = "persistent parameters" if persistent else "param group"
            buckets.append(Bucket(flat, switches, use_reduce_scatter, g, f"unit '{name}', {kind} {g}", precision,
                                  accumulation, None if persistent else compressed, offload=offload(flat.numel),
                                  own_master=own_master and not persistent))
    return Unit(name, module, buckets, frozen)
