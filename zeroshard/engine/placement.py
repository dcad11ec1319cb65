"""ParamPlacement: where this rank's parameters live (`engine.placement()`), and the start-up line that says so.

Parameters fall into four disjoint kinds on a rank:

- sharded: trained parameters gathered on demand (stage 3's units); the rank
  holds one shard of each flat buffer;
- persistent: trained parameters kept whole on every rank: at stage 3 those
  under `stage3_param_persistence_threshold` elements (DeepSpeed's rule),
  below stage 3 every one (the stage's rule: only optimizer states and
  gradients are sharded);
- frozen sharded: stage 3's flat buffers of parameters that do not require
  grad (a LoRA model's base), gathered with their unit;
- frozen whole: every other parameter, left as it is (frozen ones, and at
  stage 3 the frozen ones under the threshold).

Counted from the flat buffers the build made, on this rank alone (no
collective); on a tp or pp mesh, of this rank's part of the model. Bytes are
the training dtype's with the flat buffers' padding, as `memory_stats()`
counts them: `total.bytes` equals `memory_stats()["params"]` whenever no
unit is gathered (after `initialize`, between steps).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.nn as nn

from zeroshard.core.bucket import Bucket
from zeroshard.core.flat import FlatParams
from zeroshard.core.local import local
from zeroshard.stage3.unit import Unit

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParamShare:
    """One kind of parameters on this rank."""

    elements: int = 0  # of the model, without padding
    held: int = 0  # elements this rank holds, padding included (its shard of a sharded flat buffer)
    bytes: int = 0  # bytes this rank holds
    full_bytes: int = 0  # bytes of the whole padded buffers (what a gather makes); `bytes` for what is whole

    def __add__(self, other: ParamShare) -> ParamShare:
        return ParamShare(self.elements + other.elements, self.held + other.held, self.bytes + other.bytes,
                          self.full_bytes + other.full_bytes)


@dataclass(frozen=True)
class UnitPlacement:
    """One stage-3 unit on this rank (elements)."""

    name: str  # the module's qualified name; "(root)" for the model itself
    gathered: int  # elements gathered on demand around its forward and backward (trained and frozen)
    frozen: int  # of them, frozen
    shard: int  # elements of this rank's shards of them, padding included
    persistent: int  # trained elements kept whole: each parameter under stage3_param_persistence_threshold
    persistent_params: tuple[str, ...]  # their names


@dataclass(frozen=True)
class ParamPlacement:
    """Where this rank's parameters live: the kinds of the module's docstring, and stage 3's units."""

    stage: int
    world_size: int
    rank: int
    buckets: int  # trained flat buffers (at stage 3 the buckets of all units)
    persistence_threshold: int | None  # stage 3's stage3_param_persistence_threshold; None below stage 3
    units: tuple[UnitPlacement, ...]  # stage 3's units in build order; empty below stage 3
    sharded: ParamShare
    persistent: ParamShare
    frozen_sharded: ParamShare
    frozen_whole: ParamShare

    @property
    def trainable(self) -> ParamShare:
        return self.sharded + self.persistent

    @property
    def frozen(self) -> ParamShare:
        return self.frozen_sharded + self.frozen_whole

    @property
    def total(self) -> ParamShare:
        """Every parameter: `total.bytes` is memory_stats()["params"] with no unit gathered."""
        return self.trainable + self.frozen

    @property
    def shards_nothing(self) -> bool:
        """Stage 3 with every parameter whole on every rank (each under the persistence threshold)."""
        return self.stage == 3 and self.sharded.elements + self.frozen_sharded.elements == 0


def _share(flats: list[FlatParams], sharded: bool) -> ParamShare:
    share = ParamShare()
    for flat in flats:
        size = flat.dtype.itemsize
        held = flat.shard_numel if sharded else flat.padded_numel
        share += ParamShare(flat.numel, held, held * size, flat.padded_numel * size)
    return share


def param_placement(stage: int, world_size: int, rank: int, model: nn.Module, buckets: list[Bucket],
                    units: list[Unit], names: dict[int, str], persistence_threshold: int) -> ParamPlacement:
    """This rank's `ParamPlacement` from the built buckets (stages 0-2) or units (stage 3); `names`:
    id(parameter) -> its name."""
    sharded = [b.flat for b in buckets if b.switches.shard_params]
    persistent = [b.flat for b in buckets if not b.switches.shard_params]
    frozen = [f for unit in units for f in unit.frozen]
    in_flats = {id(p) for f in sharded + persistent + frozen for p in f.params}
    rest = [local(p) for p in model.parameters() if id(p) not in in_flats]  # a trained one is always in a bucket
    elements, whole = sum(t.numel() for t in rest), sum(t.numel() * t.element_size() for t in rest)
    return ParamPlacement(stage, world_size, rank, len(buckets), persistence_threshold if stage == 3 else None,
                          tuple(_unit(unit, names) for unit in units), _share(sharded, True),
                          _share(persistent, False), _share(frozen, True), ParamShare(elements, elements, whole, whole))


def _unit(unit: Unit, names: dict[int, str]) -> UnitPlacement:
    kept = [b.flat for b in unit.buckets if not b.switches.shard_params]
    return UnitPlacement(unit.name, sum(f.numel for f in unit.gathered_flats), sum(f.numel for f in unit.frozen),
                         sum(f.shard_numel for f in unit.gathered_flats), sum(f.numel for f in kept),
                         tuple(names[id(p)] for f in kept for p in f.params))


def log_placement(placement: ParamPlacement) -> None:
    """The start-up INFO line (rank 0 calls it), and the WARNING when stage 3 shards nothing."""
    p = placement
    made = [f"{p.buckets:,} bucket{'' if p.buckets == 1 else 's'}"]
    if p.units:
        largest = max(p.units, key=lambda u: u.gathered + u.persistent)  # the first of equals
        made.insert(0, f"{len(p.units):,} unit{'' if len(p.units) == 1 else 's'} (largest '{largest.name}': "
                       f"{largest.gathered:,} elements gathered on demand, {largest.persistent:,} persistent)")
    if p.stage == 3:
        held = (f"{p.sharded.bytes:,} sharded (of {p.sharded.full_bytes:,} in full), "
                f"{p.persistent.bytes:,} persistent (each parameter under stage3_param_persistence_threshold "
                f"{p.persistence_threshold:,} elements), {p.frozen.bytes:,} frozen "
                f"({p.frozen_sharded.bytes:,} sharded, {p.frozen_whole.bytes:,} whole)")
    else:
        held = f"all whole below stage 3, {p.persistent.bytes:,} trainable, {p.frozen.bytes:,} frozen"
    log.info("zeroshard stage %d on %d ranks: %s; %s parameter elements (%s trainable, %s frozen); this rank "
             "holds %s bytes of parameters: %s", p.stage, p.world_size, ", ".join(made), f"{p.total.elements:,}",
             f"{p.trainable.elements:,}", f"{p.frozen.elements:,}", f"{p.total.bytes:,}", held)
    if p.shards_nothing:
        log.warning("zeroshard stage 3 shards no parameter: each one has fewer than "
                    "zero_optimization.stage3_param_persistence_threshold (%d) elements, so every rank holds the "
                    "whole model (%s bytes, stage 2's parameter memory); lower the threshold below the sizes of "
                    "the parameters to shard (0 shards every parameter)", p.persistence_threshold,
                    f"{p.total.bytes:,}")
